"""The analytic model against published runs (bench/analysis/published.yaml): predicted vs published
per entry, and the mean and max |error| per kind, per source and per engine family. Pure maths; the
figure is drawn by the CLI.

What each kind compares:
    time               the predicted step time (bench.analysis.time_model) vs the iteration time (a
                       published rate, TFLOP/s or tokens/s per GPU, turned into one: see the file's header)
    state_memory       parameters + gradients + optimizer state of the average GPU (what the papers'
                       figures plot: the state of the transformer layers, shared evenly)
    activation_memory  activations held at the peak by the first pipeline stage (the largest)
    peak_memory        the step's peak memory of the rank that holds the most
An entry the model refuses (no engine could run its configuration) is kept and reported refused, with
the reason. The error is on the kind's quantity (seconds, bytes): predicted / published − 1, so a
positive time error is a prediction too slow.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.analysis.estimate import ATTENTION_KERNELS, CANDIDATE_FIELDS, estimate, estimate_params, model_flops_per_step
from bench.analysis.memory import sharding
from bench.config import RunConfig, structural_reason

PUBLISHED = Path(__file__).with_name("published.yaml")
KINDS = ("time", "state_memory", "activation_memory", "peak_memory")
MEMORY_KINDS = KINDS[1:]
UNITS = {"s": 1.0, "GiB": 2.0**30, "GB": 1e9, "TFLOP/s": 1e12, "tokens/s": 1.0}
RATES = ("TFLOP/s", "tokens/s")  # per GPU; turned into seconds per iteration
FLOP_COUNTS = ("eq3", "model")
FAMILIES = ("3D", "ZeRO-3/FSDP", "single node")
_TOP = {"sources"}
_GROUP_ONLY = {"models", "techniques", "entries", "note"}
_SHARED = {"source", "hardware", "mixed_state", "impl", "attention", "config", "flops"}
_ENTRY = {"name", "model", "params", "technique", "kind", "value", "unit", "where", "read_off_plot"} | _SHARED


class PublishedError(ValueError):
    """A published-results file that cannot be read: names the file, the entry, the key and the fix."""


@dataclass(frozen=True)
class Entry:
    name: str
    source: str
    where: str
    kind: str
    value: float  # as printed, in `unit`
    unit: str
    hardware: str
    mixed_state: str
    impl: str
    attention: str
    shape: RunConfig  # with `params`: only its dp, zero and dtype count
    params: float = 0.0  # a bare parameter count (the ZeRO paper's Ψ) instead of a model
    flops: str = ""
    read_off_plot: bool = False
    note: str = ""  # what the source leaves unprinted and what is assumed for it

    @property
    def family(self) -> str:
        """single node (8 GPUs or fewer), ZeRO-3/FSDP (parameters sharded over dp) or 3D (tp/pp/dp with
        whole parameters on every dp rank: Megatron-style, and ZeRO ≤ 2)."""
        if self.shape.world <= 8:
            return "single node"
        return "ZeRO-3/FSDP" if sharding(self.shape)[0] == "params" else "3D"

    def published_base(self) -> float:
        """The published figure in seconds (time) or bytes (memory)."""
        if self.unit not in RATES:
            return self.value * UNITS[self.unit]
        return self._work_per_gpu() / (self.value * UNITS[self.unit])

    def in_unit(self, base: float) -> float:
        """A figure in seconds or bytes, in this entry's unit (a rate: the rate that time means)."""
        return self._work_per_gpu() / base / UNITS[self.unit] if self.unit in RATES else base / UNITS[self.unit]

    def _work_per_gpu(self) -> float:
        """FLOPs (TFLOP/s) or tokens (tokens/s) of one iteration per GPU, as the source counts them."""
        cfg = self.shape
        if self.unit == "tokens/s":
            return cfg.tokens_per_step / cfg.world
        if self.flops == "eq3":  # Narayanan et al. 2021 eq. (3): F = 96·B·s·l·h²·(1 + s/6h + V/16lh)
            m, s, batch = cfg.model_config, cfg.seq, cfg.micro_batch * cfg.micro_batches * cfg.dp
            l, h = m.layers, m.hidden
            return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + m.vocab / (16 * l * h)) / cfg.world
        return model_flops_per_step(cfg) / cfg.world


def _check_keys(found, known, where: str, path) -> None:
    unknown = sorted(set(found) - set(known))
    if unknown:
        raise PublishedError(f"{path}: unknown key {unknown[0]!r} in {where}; known keys: {', '.join(sorted(known))}")


def _check_choice(value, choices, where: str, path) -> None:
    if value not in choices:
        raise PublishedError(f"{path}: {where} is {value!r}; choose one of {', '.join(map(str, choices))}")


def load_published(path: str | Path = PUBLISHED) -> list[Entry]:
    from bench.typed_yaml import load_yaml  # names the file when it is missing, a folder, binary or not UTF-8
    path = Path(path)
    data = load_yaml(path, "published-results file") or {}
    if not isinstance(data, dict) or not isinstance(data.get("sources"), list):
        raise PublishedError(f"{path}: expected a mapping with sources: (a list of source groups)")
    _check_keys(data, _TOP, "the top level", path)
    out = []
    for g, group in enumerate(data["sources"]):
        where = f"sources[{g}]"
        if not isinstance(group, dict):
            raise PublishedError(f"{path}: {where} must be a mapping (source, hardware, config, entries, ...)")
        _check_keys(group, _SHARED | _GROUP_ONLY, where, path)
        for i, raw in enumerate(group.get("entries") or []):
            out.append(_entry(path, f"{where}.entries[{i}]", group, raw))
    return out


def _entry(path, where: str, group: dict, raw: dict) -> Entry:
    if not isinstance(raw, dict):
        raise PublishedError(f"{path}: {where} must be a mapping (name, model, kind, value, unit, where)")
    _check_keys(raw, _ENTRY, where, path)
    e = {**{k: group[k] for k in _SHARED if k in group}, **raw}
    for key in ("name", "source", "where", "kind", "value", "unit", "hardware"):
        if not e.get(key):
            raise PublishedError(f"{path}: {where} has no {key!r}; add it (to the entry or its source group)")
    where = f"{where} ({e['name']})"
    _check_choice(e["kind"], KINDS, f"{where}.kind", path)
    _check_choice(e["unit"], UNITS, f"{where}.unit", path)
    _check_choice(e.get("attention", "flash"), ATTENTION_KERNELS, f"{where}.attention", path)
    if e["unit"] == "TFLOP/s":
        _check_choice(e.get("flops"), FLOP_COUNTS, f"{where}.flops (how the source counts a step's FLOPs)", path)
    for key in ("value", "params"):
        if key in e and (not isinstance(e[key], (int, float)) or isinstance(e[key], bool) or e[key] <= 0):
            raise PublishedError(f"{path}: {where}.{key} is {e[key]!r}; give a number > 0 (e.g. 7.5e+9)")
    common = dict(name=e["name"], source=e["source"], where=e["where"], kind=e["kind"], value=float(e["value"]),
                  unit=e["unit"], hardware=e["hardware"], mixed_state=e.get("mixed_state", "zero"),
                  impl=e.get("impl", "table2"), attention=e.get("attention", "flash"), flops=e.get("flops", ""),
                  read_off_plot=bool(e.get("read_off_plot", False)), note=str(group.get("note", "")))
    config = _config(path, where, group, e)
    if "params" in e:  # a bare parameter count: model state only (the ZeRO paper's Ψ)
        if e["kind"] != "state_memory":
            raise PublishedError(f"{path}: {where} gives params; only a state_memory entry can (else give model)")
        return Entry(**common, shape=RunConfig.unchecked(**{**PUBLISHED_RUN, **config}), params=float(e["params"]))
    from models.config import PRESETS
    if config.get("model") not in PRESETS:
        raise PublishedError(f"{path}: {where}.model {e.get('model')!r} is neither under its group's models: nor a "
                             f"model preset; add it to one (models/config.py for a preset)")
    return Entry(**common, shape=RunConfig.unchecked(**{**PUBLISHED_RUN, **config}))


def _config(path, where: str, group: dict, e: dict) -> dict:
    """The entry's run: its group's config, then its model's (a name under the group's models:, else the
    preset of that name), its technique's, and its own config, each over the one before."""
    models, techniques = group.get("models") or {}, group.get("techniques") or {}
    if "params" not in e and "model" not in e:
        raise PublishedError(f"{path}: {where} has no 'model'; name a model preset or one of its group's models:")
    if "technique" in e and e["technique"] not in techniques:
        raise PublishedError(f"{path}: {where}.technique {e['technique']!r} is not under its group's techniques:")
    model = models.get(e.get("model"), {"model": e["model"]} if "model" in e else {})
    config = {**group.get("config", {}), **model, **techniques.get(e.get("technique"), {}), **e.get("config", {})}
    _check_keys(config, CANDIDATE_FIELDS, f"the config of {where}", path)
    return config


PUBLISHED_RUN = {"dtype": "bf16-mixed", "micro_batch": 1}
"""What a published run's config means unless it says otherwise: mixed bf16, one sequence per micro-batch."""


def refusal(entry: Entry) -> str | None:
    """Why the model cannot predict this entry (no engine could run its configuration), or None."""
    if entry.params:
        return None
    return structural_reason(entry.shape)


def predicted(entry: Entry) -> float:
    """The prediction in seconds (time) or bytes (memory)."""
    if entry.params:
        cfg = entry.shape
        return estimate_params(entry.params, cfg.dp, cfg.zero, cfg.dtype, entry.mixed_state)["total_bytes"]
    est = estimate(entry.shape, entry.hardware, mixed_state=entry.mixed_state,
                   activations="suite" if entry.impl == "suite" else "table2", attention=entry.attention)
    if entry.kind == "time":
        return est["step_time_s"]
    if entry.kind == "activation_memory":
        return est["activation_bytes"]
    stages = est["stages"]
    if entry.kind == "peak_memory":
        return max(s["peak_mem_bytes"] for s in stages)
    return sum(s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"] for s in stages) / len(stages)


def validate(path: str | Path = PUBLISHED) -> dict:
    """Every entry with its prediction and error (or why it is refused), and the mean and max |error| per
    kind, per source and per family (time and memory apart); entries read off a plot are summarised apart."""
    rows = [_row(entry) for entry in load_published(path)]
    off_plot = [r for r in rows if r["read_off_plot"]]
    return {"file": str(path), "entries": rows, "summary": _summary(rows, "kind"),
            "by_source": _grouped(rows, "source"), "by_family": _grouped(rows, "family"),
            "read_off_plot": _grouped([{**r, "read_off_plot": False} for r in off_plot], "source"),
            "refused": [r for r in rows if r["refused"]]}


def _row(entry: Entry) -> dict:
    base = entry.published_base()
    row = {"name": entry.name, "kind": entry.kind, "source": entry.source, "where": entry.where,
           "family": entry.family, "unit": entry.unit, "published": entry.value,
           "base_unit": "s" if entry.kind == "time" else "GiB",
           "published_base": base / (1 if entry.kind == "time" else UNITS["GiB"]),
           "read_off_plot": entry.read_off_plot, "note": entry.note, "refused": refusal(entry)}
    if row["refused"]:
        return {**row, "predicted": None, "predicted_base": None, "error": None}
    pred = predicted(entry)
    return {**row, "predicted": entry.in_unit(pred),
            "predicted_base": pred / (1 if entry.kind == "time" else UNITS["GiB"]), "error": pred / base - 1}


def _stats(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows]
    return {"entries": len(errs), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs)}


def _summary(rows: list[dict], key: str) -> dict:
    """Mean and max |error| per value of `key` over the predicted entries not read off a plot."""
    out = {}
    for r in rows:
        if r["error"] is not None and not r["read_off_plot"]:
            out.setdefault(r[key], []).append(r)
    return {k: _stats(v) for k, v in out.items()}


def _grouped(rows: list[dict], key: str) -> dict:
    """Per value of `key`: time and memory (every memory kind) apart."""
    out = {}
    for what, kinds in (("time", ("time",)), ("memory", MEMORY_KINDS)):
        for k, s in _summary([r for r in rows if r["kind"] in kinds], key).items():
            out.setdefault(k, {})[what] = s
    return out
