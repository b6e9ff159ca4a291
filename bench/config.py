"""RunConfig: one benchmark run, validated before any process starts.

Field names are the vocabulary of the whole suite: a field `micro_batches` is the CLI flag
`--micro-batches`, the YAML key `micro_batches` and the dataframe column `micro_batches`.
Each field's `help` is the CLI's help text.

Validation has two layers. This module checks what holds for any engine: field types and choices,
the world size, the model's divisibility and the pipeline's shape and schedule (`structural_reason`,
which the planner also applies to its candidates). bench/capabilities.py declares what each backend
supports and says why a backend cannot run a config. A RunConfig raises ConfigError with the first
reason of either, so a config that exists can run.
"""
from __future__ import annotations

import hashlib
import json
import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from functools import lru_cache
from typing import Any

from bench.capabilities import BACKENDS, CAPABILITIES, DTYPES, FSDP_MODES, RECOMPUTE, ZERO_STAGES, unsupported_reason
from bench.layout import ORDERS
from bench.schedule import SCHEDULES
from models.config import GPTConfig, get_preset


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the fields and the fix."""


def _f(default, help: str, choices: tuple | None = None, in_id: bool = True, bounds: tuple | None = None):
    """A RunConfig field; `bounds` = (low, high, low_open): the range of a number, read by RunConfig's own
    check, the CLI's option types and the sweep file's schema alike (check_number)."""
    kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, "choices": choices, "in_id": in_id, "bounds": bounds}, **kw)


# Sane ranges: beyond them a value is a typo, and would run for days or overflow a column (int64).
MAX_RANKS = 1_000_000
MAX_STEPS = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0
POSITIVE = lambda high: (1, high, False)  # noqa: E731
NON_NEGATIVE = lambda high: (0, high, False)  # noqa: E731


def check_number(name: str, value, integer: bool, bounds: tuple) -> str | None:
    """Why `value` cannot be `name` (not a number; a float where an integer is meant; nan or inf; out of
    range), or None. One rule for every door a number comes in by: CLI, sweep file, RunConfig(...)."""
    low, high, low_open = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}"
    if integer and not isinstance(value, int):
        return f"{name} must be an integer, got {value!r}"
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value!r}"
    if integer and low in (0, 1) and not low_open and value < low:
        return f"{name} must be a {'positive' if low else 'non-negative'} integer, got {value!r}"
    if value < low or (low_open and value == low):
        return f"{name} must be {'>' if low_open else '≥'} {_plain(low)}, got {value!r}"
    if value > high:
        return f"{name} must be ≤ {_plain(high)}, got {value!r}"
    return None


def _plain(number) -> str:
    return f"{number:,}" if isinstance(number, int) else f"{number:g}"


DEVICES = ("auto", "cpu", "cuda")


class BatchShape:
    """Sizes derived from the layout and batch fields; shared by RunConfig and the planner's
    unvalidated candidates (bench.analysis.estimate.Shape)."""

    @property
    def model_config(self) -> GPTConfig:
        return model_config(self.model, self.model_overrides)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq


@dataclass(frozen=True)
class RunConfig(BatchShape):
    model: str = _f("tiny", "model preset (models.PRESETS)")
    model_overrides: tuple = _f(tuple, "preset fields to override, as KEY=VALUE (e.g. layers=8)")
    backend: str = _f("native", "training backend", BACKENDS)
    tp: int = _f(1, "tensor-parallel size", bounds=POSITIVE(MAX_RANKS))
    pp: int = _f(1, "pipeline-parallel size (stages)", bounds=POSITIVE(MAX_RANKS))
    dp: int = _f(1, "data-parallel size (replicas)", bounds=POSITIVE(MAX_RANKS))
    order: str = _f("tp-pp-dp", "rank order, fastest dimension first", ORDERS)
    zero: int = _f(0, "ZeRO stage: native 0-1, deepspeed 0-3", ZERO_STAGES)
    fsdp: str | None = _f(None, "FSDP sharding (backend fsdp only; default full)", FSDP_MODES)
    schedule: str = _f("1f1b", "pipeline schedule", SCHEDULES)
    virtual_stages: int = _f(1, "model chunks per pipeline rank (interleaved schedule)", bounds=POSITIVE(1024))
    micro_batch: int = _f(2, "sequences per micro-batch", bounds=POSITIVE(1 << 20))
    micro_batches: int = _f(1, "micro-batches per step and pipeline (gradient accumulation when pp = 1)",
                            bounds=POSITIVE(1 << 20))
    seq: int | None = _f(None, "sequence length (default: the model's seq_len)", bounds=POSITIVE(1 << 24))
    dtype: str = _f("fp32", "training precision", DTYPES)
    sequence_parallel: bool = _f(False, "shard norm/dropout regions along the sequence (needs tp > 1)")
    recompute: str = _f("none", "activation recomputation", RECOMPUTE)
    compile: bool = _f(False, "torch.compile each block (native, fsdp, ddp); the first warm-up step compiles "
                              "(column compile_s), never a timed one")
    bucket_mb: float = _f(25.0, "gradient all-reduce bucket size in MiB", bounds=(0, 1 << 20, True))
    steps: int = _f(5, "timed optimizer steps", bounds=POSITIVE(MAX_STEPS))
    warmup: int = _f(2, "untimed optimizer steps before timing", bounds=NON_NEGATIVE(MAX_STEPS))
    seed: int = _f(0, "seed of weights and data", bounds=NON_NEGATIVE(2**32 - 1))
    device: str = _f("auto", "device (auto = cuda when available, else cpu)", DEVICES)
    ds_set: tuple = _f(tuple, "DeepSpeed config override KEY=VALUE with a dotted key (repeatable)")
    world_size: int | None = _f(None, "expected world size; must equal tp × pp × dp when given",
                                bounds=POSITIVE(MAX_RANKS))
    repeat: int = _f(0, "repeat index of the same config (noise estimation)", bounds=NON_NEGATIVE(10_000))
    fault: str = _f("none", "test-only fault injection, comma-separated: raise | hang | oom | oom_real on the "
                            "last rank; sleep:MS per step; stage_sleep:MS per pipeline compute section (native); "
                            "grad_scale:K, lr_scale:K, sgd:LR at every optimizer step")
    timeout_s: float = _f(600.0, "wall-clock limit of the run in seconds", in_id=False,
                          bounds=(0, MAX_TIMEOUT_S, True))
    profile: bool = _f(False, "trace one extra, untimed step per rank with torch.profiler (Chrome JSON + op table)",
                       in_id=False)  # the profiled step is extra and untimed: the measurement, hence the id, is the same

    def __post_init__(self):
        _normalize(self)
        _validate(self)

    @property
    def run_id(self) -> str:
        """Short hash of the canonical form: the key for resume, de-duplication and baselines."""
        return _digest(self.canonical())

    @property
    def config_id(self) -> str:
        """Like run_id but equal for every repeat of a config (groups repeats for statistics)."""
        return _digest({k: v for k, v in self.canonical().items() if k != "repeat"})

    def canonical(self) -> dict[str, Any]:
        """Fields that identify the run: those off their defaults, plus the layout and backend.

        Leaving defaults out keeps run ids stable when a new field with a default is added."""
        out = {}
        for f in fields(self):
            if not f.metadata["in_id"]:
                continue
            value = getattr(self, f.name)
            if f.name in ("model", "backend", "tp", "pp", "dp") or value != DEFAULTS[f.name]:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_row(self) -> dict[str, Any]:
        """Flat columns for the results dataframe (tuples become JSON strings)."""
        row = {k: (json.dumps(list(v)) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        row.update(world_size=self.world, global_batch=self.global_batch, run_id=self.run_id,
                   config_id=self.config_id)
        return row

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown run config field(s) {unknown}{suggest(unknown[0], known)}")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()})

    def replace(self, **changes) -> "RunConfig":
        return replace(self, **changes)


@lru_cache(maxsize=None)
def field_types(cls: type = None) -> dict[str, tuple[type, bool]]:
    """Each field's value type (int, float, bool, str or tuple) and whether None is allowed, from the
    annotations as Python evaluates them, of RunConfig (default) or another dataclass such as GPTConfig:
    the CLI, the sweep-file schema and model overrides given as text are typed by it."""
    out = {}
    for name, hint in typing.get_type_hints(cls or RunConfig).items():
        args = typing.get_args(hint)
        out[name] = (next(a for a in args if a is not type(None)), True) if args else (hint, False)
    return out


FIELDS = {f.name: f for f in fields(RunConfig)}
DEFAULTS = {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(RunConfig)}
"""Every RunConfig field's default (None for the ones derived from others, e.g. seq)."""


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def suggest(name, known) -> str:
    """'; did you mean X?' for the closest known name, or ''."""
    import difflib
    close = difflib.get_close_matches(str(name), sorted(str(k) for k in known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def model_config(preset: str, overrides: tuple | dict = ()) -> GPTConfig:
    items = overrides.items() if isinstance(overrides, dict) else overrides
    items = tuple(tuple(i) if isinstance(i, list) else i for i in items)
    try:
        return _model_config(preset, items)
    except TypeError:  # an unhashable value: not cacheable, and the override check below words the mistake
        return _model_config.__wrapped__(preset, items)


@lru_cache(maxsize=1024)
def _model_config(preset: str, items: tuple) -> GPTConfig:
    """Cached: the planner and the cost model ask for the same (frozen) model config thousands of times."""
    parsed = {}
    for item in items:
        key, value = item if isinstance(item, tuple) else _split_kv(item, "model_overrides")
        parsed[key] = value
    try:
        cfg = get_preset(preset)
        if not parsed:
            return cfg
        return cfg.with_overrides(**{k: _coerce(k, v) for k, v in parsed.items()})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _split_kv(item: str, name: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"{name} entry {item!r} must look like KEY=VALUE")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def _coerce(key: str, value):
    """An override given as text (KEY=VALUE) as the GPTConfig field's type; none/null for an optional field
    (kv_heads=none: back to its default)."""
    if not isinstance(value, str) or key not in field_types(GPTConfig):
        return value  # an unknown key: with_overrides names it
    kind, optional = field_types(GPTConfig)[key]
    if optional and value.lower() in ("none", "null"):
        return None
    if kind is bool:
        if value.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"model_overrides {key}={value}: {key} must be true or false")
        return value.lower() in ("1", "true", "yes", "on")
    try:
        return kind(value)
    except ValueError:
        wanted = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ConfigError(f"model_overrides {key}={value}: {key} must be {wanted}") from None


def _normalize(cfg: RunConfig) -> None:
    """Fill the defaults that depend on other fields (frozen: set through object.__setattr__)."""
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731
    for name in ("model_overrides", "ds_set"):
        value = getattr(cfg, name)
        if isinstance(value, dict):
            value = tuple(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, (list, str)):
            value = tuple([value] if isinstance(value, str) else value)
        set_(name, tuple(value))
    if cfg.fsdp is None and cfg.backend in CAPABILITIES:
        set_("fsdp", CAPABILITIES[cfg.backend].fsdp_default)
    if cfg.seq is None:
        set_("seq", cfg.model_config.seq_len)


def _validate(cfg: RunConfig) -> None:
    """Field types and choices, then what no engine could run, then what this backend cannot run."""
    _validate_fields(cfg)
    reason = structural_reason(cfg) or unsupported_reason(cfg)
    if reason:
        raise ConfigError(reason)


def _validate_fields(cfg: RunConfig) -> None:
    for f in fields(cfg):
        choices, value = f.metadata["choices"], getattr(cfg, f.name)
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{f.name} is {value!r}{suggest(str(value), map(str, choices))} "
                              f"(choose one of {', '.join(map(str, choices))})")
        reason = field_reason(f.name, value)
        if reason:
            raise ConfigError(reason)
    if fault_reason(cfg.fault):
        raise ConfigError(fault_reason(cfg.fault))
    if cfg.world_size is not None and cfg.world != cfg.world_size:
        raise ConfigError(f"tp ({cfg.tp}) × pp ({cfg.pp}) × dp ({cfg.dp}) = {cfg.world}, "
                          f"but world_size is {cfg.world_size}")


def field_reason(name: str, value) -> str | None:
    """Why `value` cannot be RunConfig field `name` by its type and bounds (None: fine, or a field
    without bounds). A number field's None is its default-to-derive (seq, world_size) or not given."""
    bounds = FIELDS[name].metadata["bounds"]
    if bounds is None or value is None:
        return None
    return check_number(name, value, field_types()[name][0] is int, bounds)


# Test-only faults: name → whether it takes a number (`sleep:400`). See bench.worker for what each does.
FAULTS = {"raise": False, "hang": False, "oom": False, "oom_real": False, "sleep": True, "stage_sleep": True,
          "grad_scale": True, "lr_scale": True, "sgd": True}
FAULT_LIMIT = 3_600_000
"""No fault number may exceed this (an hour in milliseconds for the sleeps; far above any sane scale)."""


def parse_fault(fault: str) -> dict[str, float | None]:
    """`"sgd:1,grad_scale:2"` → {"sgd": 1.0, "grad_scale": 2.0}; "none" → {}. Raises ConfigError."""
    if fault == "none":
        return {}
    if not isinstance(fault, str):
        raise ConfigError(f"fault is {fault!r}; choose none or a comma-separated list of test-only faults")
    out: dict[str, float | None] = {}
    for part in fault.split(","):
        name, _, number = part.strip().partition(":")
        if name not in FAULTS or FAULTS[name] != bool(number):
            usage = ", ".join(f"{k}:X" if v else k for k, v in FAULTS.items())
            raise ConfigError(f"fault is {fault!r}; choose none or a comma-separated list of {usage}")
        try:
            value = float(number) if number else None
        except ValueError:
            raise ConfigError(f"fault {part!r}: {number!r} is not a number (e.g. sleep:50)") from None
        reason = value is not None and check_number(name, value, False, (0, FAULT_LIMIT, False))
        if reason:
            raise ConfigError(f"fault {part!r}: {reason}")
        out[name] = value
    return out


def fault_reason(fault) -> str | None:
    """Why `fault` is not a valid test-only fault list, or None."""
    try:
        parse_fault(fault)
    except ConfigError as e:
        return str(e)
    return None


def structural_reason(shape) -> str | None:
    """Why no engine could run this shape (model fit, pipeline shape, schedule rules), or None.

    Reads only the layout and batch fields, so the planner's unvalidated candidates use it too; the
    second layer, what one backend supports, is bench.capabilities.unsupported_reason."""
    return _model_fit_reason(shape) or _pipeline_reason(shape)


def _model_fit_reason(cfg) -> str | None:
    m = cfg.model_config
    # kv_heads: tensor parallel splits whole query groups with their K/V head (no K/V replication)
    for what, value in (("heads", m.heads), ("kv_heads", m.num_kv_heads), ("ffn_hidden", m.ffn_hidden),
                        ("vocab", m.vocab)):
        if value % cfg.tp:
            return f"model {what} ({value}) is not divisible by tp ({cfg.tp}); pick tp from the divisors of {value}"
    if cfg.seq > m.seq_len and m.position == "learned":
        return f"seq ({cfg.seq}) exceeds the model's seq_len ({m.seq_len})"
    if cfg.sequence_parallel and cfg.tp == 1:
        return "sequence_parallel needs tp > 1 (it shards along the sequence within a tp group)"
    if cfg.sequence_parallel and cfg.seq % cfg.tp:
        return f"sequence_parallel needs seq ({cfg.seq}) divisible by tp ({cfg.tp})"
    return None


def _pipeline_reason(cfg) -> str | None:
    m, chunks = cfg.model_config, cfg.pp * cfg.virtual_stages
    if m.layers < chunks:
        return (f"model layers ({m.layers}) < pp ({cfg.pp}) × virtual_stages ({cfg.virtual_stages}) "
                f"= {chunks}: every pipeline stage needs at least one layer")
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        return f"virtual_stages ({cfg.virtual_stages}) > 1 needs schedule interleaved, not {cfg.schedule}"
    if cfg.virtual_stages > 1 and cfg.pp == 1:
        return (f"virtual_stages ({cfg.virtual_stages}) > 1 needs pp > 1 "
                "(interleaving spreads model chunks over pipeline ranks)")
    if cfg.schedule == "interleaved" and cfg.pp > 1:
        if m.layers % chunks:
            return (f"interleaved: model layers ({m.layers}) must be divisible by pp ({cfg.pp}) × "
                    f"virtual_stages ({cfg.virtual_stages}) = {chunks}")
        if cfg.micro_batches % cfg.pp:
            return f"interleaved: micro_batches ({cfg.micro_batches}) must be a multiple of pp ({cfg.pp})"
    return None
