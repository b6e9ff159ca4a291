"""The shared vocabulary of the readers: a field table per framework and the report of one import.

Each framework module declares what it reads as data, one line per source key:

    MAPPED = {"--tensor-model-parallel-size": Flag("tp", 1), ...}         # key → target, framework default
    BLOCKS = {"--qk-layernorm": "qk-layernorm"}                            # changes the math: not expressible
    NO_EFFECT = {"--log-interval": "logging"}                              # dropped: no effect on the layout

A target is a RunConfig field (`tp`) or a model field (`model.layers`). Reading a source gives an
`Imported`: one `Entry` per source key (mapped, defaulted, dropped or conflict, with why), the values
of the RunConfig fields and of the model, and whether the config is exactly expressible. A new
RunConfig or GPTConfig field is one more line in a table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Status = Literal["mapped", "defaulted", "dropped", "conflict"]
NAMES = {"megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "torchtitan": "torchtitan", "transformers": "transformers"}
_SAME = object()


class SourceError(ValueError):
    """A source nothing sensible can be read from: '<file>: <key>: <problem>' (exit 2)."""

    def __init__(self, source: str, key: str, problem: str):
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


@dataclass(frozen=True)
class Flag:
    """A source key read into one target, `convert` turning the source's value into the target's."""

    target: str
    default: Any = None
    """The framework's own default (None: it has none, or it follows from other keys)."""
    convert: Callable[[Any], Any] | dict | None = None

    def value(self, raw):
        if isinstance(self.convert, dict):
            if raw not in self.convert:
                raise KeyError(raw)
            return self.convert[raw]
        return self.convert(raw) if self.convert else raw


@dataclass(frozen=True)
class Entry:
    """One row of the field table: a source key, its value and what became of it."""

    key: str
    value: Any
    status: Status
    detail: str
    """mapped: 'tp = 2'; defaulted: the framework's default and where it went; dropped: why; conflict: what disagrees"""
    blocks: bool = False
    """The dropped key changes the math or the cost (qk-layernorm, MoE): the config is not exactly expressible."""

    def to_dict(self) -> dict:
        return {"key": self.key, "value": self.value, "status": self.status, "detail": self.detail,
                "blocks": self.blocks}


@dataclass
class Imported:
    """What one config of a source reads as: the RunConfig values, the model, the table of every key."""

    framework: str
    source: str
    label: str = ""
    """Which config of the source (a YAML block name), '' for the only one."""
    values: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)

    def on_gpus(self) -> None:
        """Every framework read here trains on GPUs: the config's device is cuda (`--device cpu` overrides it)."""
        self.add("(device)", None, "defaulted", f"device = cuda ({NAMES.get(self.framework, self.framework)} trains on GPUs)")
        self.values["device"] = "cuda"

    def mapped(self, key, value, target: str, to=_SAME, note: str = "") -> None:
        """`key` (its `value` as the source wrote it) sets `target` to `to` (default: the value itself)."""
        self._record(key, value, "mapped", target, value if to is _SAME else to, note)

    def defaulted(self, key, value, target: str, to=_SAME, note: str = "") -> None:
        """`key` is not in the source: the framework's default `value` sets `target`."""
        self._record(key, value, "defaulted", target, value if to is _SAME else to,
                     note or f"{NAMES.get(self.framework, self.framework)}'s default")

    def dropped(self, key, value, why: str, blocks: bool = False) -> None:
        self.add(key, value, "dropped", why, blocks)

    def conflict(self, key, value, why: str) -> None:
        self.add(key, value, "conflict", why)

    def add(self, key, value, status: Status, detail: str, blocks: bool = False) -> None:
        self.entries.append(Entry(key, value, status, detail, blocks))

    def _record(self, key, value, status: Status, target: str, to, note: str) -> None:
        self.set(target, to)
        self.add(key, value, status, f"{target} = {to}" + (f" ({note})" if note else ""))

    def set(self, target: str, value) -> None:
        kind, _, name = target.rpartition(".")
        (self.model if kind == "model" else self.values)[name] = value

    def get(self, target: str):
        kind, _, name = target.rpartition(".")
        return (self.model if kind == "model" else self.values).get(name)

    def has(self, key: str) -> bool:
        return any(e.key == key for e in self.entries)

    @property
    def blockers(self) -> list[Entry]:
        return [e for e in self.entries if e.blocks]

    def config(self):
        """The RunConfig of the mapped values; a ConfigError when this suite cannot run it (then the source
        is not expressible either: `problems` says why)."""
        from bench.config import RunConfig
        from bench.ecosystem.model import preset_and_overrides
        if not self.model or self.model.get("vocab") is None:
            from bench.config import ConfigError
            raise ConfigError("no model shape (see the blockers)")
        preset, overrides = preset_and_overrides(self.model)
        return RunConfig(model=preset, model_overrides=overrides, **self.values)

    @property
    def problems(self) -> list[str]:
        """Why the source is not exactly expressible: each blocking key, then RunConfig's refusal if any."""
        from bench.config import ConfigError
        reasons = [f"{e.key}: {e.detail}" for e in self.blockers]
        if self.model.get("vocab") is None:  # no shape to build a config of: a blocker above says why
            return reasons
        try:
            self.config()
        except (ConfigError, ValueError, TypeError) as e:
            reasons.append(f"this suite cannot run it: {e}")
        return reasons

    @property
    def exact(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"framework": self.framework, "source": self.source, "label": self.label, "problems": self.problems,
                "values": self.values, "model": self.model, "entries": [e.to_dict() for e in self.entries]}


def flag_name(text: str) -> str:
    """A Megatron-style flag in one spelling: '--use_tp_pp_dp_mapping' → '--use-tp-pp-dp-mapping'."""
    return "--" + text.lstrip("-").replace("_", "-") if text.startswith("-") else text


def prefix_reason(key: str, table: dict[str, str]) -> str | None:
    """The reason of the longest prefix of `key` in `table` (exact keys are prefixes of themselves)."""
    best = max((p for p in table if key.startswith(p)), key=len, default=None)
    return table[best] if best is not None else None
