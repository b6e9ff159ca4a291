"""The analytic model against published runs (bench/analysis/published.yaml): predicted vs published
per entry, and the mean and max |error| per kind. Pure maths; the figure is drawn by the CLI.

What each kind compares:
    time               the predicted step time (bench.analysis.time_model) vs the iteration time
    state_memory       parameters + gradients + optimizer state of the average GPU (what the paper's
                       figure plots: the state of the transformer layers, shared evenly)
    activation_memory  activations held at the peak by the first pipeline stage (the largest)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.analysis.estimate import CANDIDATE_FIELDS, estimate
from bench.config import RunConfig

PUBLISHED = Path(__file__).with_name("published.yaml")
KINDS = ("time", "state_memory", "activation_memory")
UNITS = {"s": 1.0, "GiB": 2.0**30}
_TOP = {"defaults", "models", "techniques", "entries"}
_ENTRY = {"name", "model", "technique", "kind", "value", "unit", "where", "source", "hardware", "mixed_state",
          "impl", "config"}
_DEFAULTS = {"source", "hardware", "mixed_state", "impl", "config"}


class PublishedError(ValueError):
    """A published-results file that cannot be read: names the file, the key and the fix."""


@dataclass(frozen=True)
class Entry:
    name: str
    source: str
    where: str
    kind: str
    value: float  # in seconds or bytes
    unit: str
    hardware: str
    mixed_state: str
    impl: str
    shape: RunConfig


PUBLISHED_RUN = {"dtype": "bf16-mixed", "micro_batch": 1}
"""What a published run's config means unless it says otherwise: mixed bf16, one sequence per micro-batch."""


def _check_keys(found, known, where: str, path) -> None:
    unknown = sorted(set(found) - set(known))
    if unknown:
        raise PublishedError(f"{path}: unknown key {unknown[0]!r} in {where}; known keys: {', '.join(sorted(known))}")


def load_published(path: str | Path = PUBLISHED) -> list[Entry]:
    from bench.typed_yaml import load_yaml  # names the file when it is missing, a folder, binary or not UTF-8
    path = Path(path)
    data = load_yaml(path, "published-results file") or {}
    if not isinstance(data, dict):
        raise PublishedError(f"{path}: expected a mapping with {', '.join(sorted(_TOP))}")
    _check_keys(data, _TOP, "the top level", path)
    defaults, models, techniques = data.get("defaults", {}), data.get("models", {}), data.get("techniques", {})
    _check_keys(defaults, _DEFAULTS, "defaults", path)
    out = []
    for i, raw in enumerate(data.get("entries", [])):
        where = f"entries[{i}]"
        _check_keys(raw, _ENTRY, where, path)
        e = {**defaults, **raw}
        for key in ("name", "model", "kind", "value", "unit"):
            if key not in e:
                raise PublishedError(f"{path}: {where} has no {key!r}; add it")
        if e["kind"] not in KINDS:
            raise PublishedError(f"{path}: {where}.kind is {e['kind']!r}; choose one of {', '.join(KINDS)}")
        if e["unit"] not in UNITS:
            raise PublishedError(f"{path}: {where}.unit is {e['unit']!r}; choose one of {', '.join(UNITS)}")
        if e["model"] not in models:
            raise PublishedError(f"{path}: {where}.model {e['model']!r} is not under models:; add it there")
        technique = techniques.get(e.get("technique", ""), {}) if "technique" in e else {}
        config = {**defaults.get("config", {}), **models[e["model"]], **technique, **e.get("config", {})}
        _check_keys(config, CANDIDATE_FIELDS, f"the config of {where}", path)
        shape = RunConfig.unchecked(**{**PUBLISHED_RUN, **config})
        out.append(Entry(e["name"], e.get("source", ""), e.get("where", ""), e["kind"], float(e["value"]) * UNITS[e["unit"]],
                         e["unit"], e["hardware"], e.get("mixed_state", "zero"), e.get("impl", "table2"), shape))
    return out


def predicted(entry: Entry) -> float:
    est = estimate(entry.shape, entry.hardware, mixed_state=entry.mixed_state,
                   activations="suite" if entry.impl == "suite" else "table2")
    if entry.kind == "time":
        return est["step_time_s"]
    if entry.kind == "activation_memory":
        return est["activation_bytes"]
    stages = est["stages"]
    return sum(s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"] for s in stages) / len(stages)


def validate(path: str | Path = PUBLISHED) -> dict:
    """Every entry with its prediction and error, and per kind the mean and max |error|."""
    rows = []
    for entry in load_published(path):
        pred = predicted(entry)
        rows.append({"name": entry.name, "kind": entry.kind, "source": entry.source, "where": entry.where,
                     "unit": entry.unit, "published": entry.value / UNITS[entry.unit],
                     "predicted": pred / UNITS[entry.unit], "error": pred / entry.value - 1})
    summary = {}
    for kind in KINDS:
        errs = [abs(r["error"]) for r in rows if r["kind"] == kind]
        if errs:
            summary[kind] = {"entries": len(errs), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs)}
    return {"file": str(path), "entries": rows, "summary": summary}
