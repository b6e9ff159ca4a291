"""Predicting a sweep's runs before they launch, and pruning them (`prune:` in the sweep file).

Each run is predicted as its row's `pred_*` columns will be (`bench.analysis.estimate.predict_row`:
the backend's own precision convention, this suite's activations) on the hardware profile that
applies: `prune.hardware` when the file names one, else the runs' device's (cpu: the profile
calibrated on this machine, or the built-in one; a GPU this machine has: its profile; a GPU the Slurm launcher
will find: unknown, so name it).

- `fit: true` skips a run whose predicted peak memory (the largest rank's) exceeds what one rank
  has: one device's memory on a GPU; on CPU the ranks of one host share its memory (the profile's
  memory per core × its cores), so each has that over the ranks the launcher puts on the host.
- `slower_than_best: K` skips a run whose predicted time per token is more than K times the best
  predicted one among the runs left. Per token, so that runs with different global batches compare
  fairly (with equal batches it is the step-time ratio).

A pruned run becomes a `skipped` row with its own run_id and the figures in the reason; the runner
never counts a stored skipped row as done, so a later sweep without `prune` (`--resume`) runs it
under the same id, and a pruned row never replaces a measurement already stored.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache

from bench.analysis.hardware import Hardware, format_bytes, get_hardware
from bench.config import RunConfig
from bench.results import skipped_row
from bench.sweep.spec import describe


@dataclass(frozen=True)
class Prediction:
    """What the dry-run table shows of a run and what pruning compares."""
    peak_bytes: float | None
    """The largest rank's predicted peak (pred_total_bytes)."""
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    hardware: str | None = None
    """The profile's name, as the row's pred_hardware says it (None: no profile applies)."""
    profile: str | None = None
    """Which profile that is, as the row's pred_profile says it (calibrated here, built-in, a file)."""
    rank_memory: float | None = None
    """The memory one rank has on that hardware (see the module docstring)."""
    memory_note: str = ""
    error: str | None = None


def shares_host_memory(hw: Hardware) -> bool:
    """CPU profiles describe a core ("device") of a host whose memory all its ranks share."""
    return hw.name == "cpu" or (hw.calibration is not None and hw.calibration.machine.get("device") == "cpu")


@cache
def _local_device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_hardware(cfg: RunConfig, named: str | None, launcher: str) -> Hardware | None:
    """The profile a run is predicted on (module docstring); None when it cannot be known here."""
    from bench.analysis.estimate import row_hardware
    if named:
        return get_hardware(named)
    if cfg.device == "cpu":
        return row_hardware("cpu", cfg.world)
    if launcher in ("local", "debug"):  # the run lands on this machine: auto is what it has
        name = _local_device_name()
        return row_hardware(name, cfg.world) if cfg.device == "auto" or name != "cpu" else None
    return None


def ranks_per_host(cfg: RunConfig, launch) -> int:
    profile = getattr(launch, "profile", None)
    return profile.shape(cfg)[1] if profile is not None and hasattr(profile, "shape") else cfg.world


def predict(cfg: RunConfig, hw: Hardware | None, ranks_on_host: int) -> Prediction:
    from bench.analysis.estimate import predict_row
    per_node = ranks_on_host if ranks_on_host < cfg.world else None  # None: one machine, all of them
    row = predict_row(cfg, cfg.device, hw, per_node)  # no profile (hw None): a device name no profile matches
    if "pred_error" in row:
        return Prediction(None, error=row["pred_error"])
    peak = row["pred_total_bytes"]
    if hw is None:
        return Prediction(peak)
    memory, note = hw.memory_bytes, f"one device's {format_bytes(hw.memory_bytes)}"
    if shares_host_memory(hw) and memory:
        host = hw.memory_bytes * hw.gpus_per_node
        memory, note = host / ranks_on_host, f"{format_bytes(host)} of host memory shared by {ranks_on_host} rank(s)"
    return Prediction(peak, row["pred_step_time_s"], row["pred_tokens_per_s"], row["pred_hardware"],
                      row["pred_profile"], memory or None, note)


def predict_runs(runs: list[RunConfig], named: str | None, launch) -> tuple[dict[str, Prediction], list[str]]:
    """run_id → Prediction of every run (repeats of a config share one), and the warnings to print once."""
    by_config, out, unknown = {}, {}, set()
    for cfg in runs:
        if cfg.config_id not in by_config:
            hw = run_hardware(cfg, named, launch.kind)
            if hw is None:
                unknown.add(cfg.device)
            by_config[cfg.config_id] = predict(cfg, hw, ranks_per_host(cfg, launch))
        out[cfg.run_id] = by_config[cfg.config_id]
    warnings = [f"no hardware profile for device {d} with the {launch.kind} launcher: its runs get no predicted "
                f"time and are not pruned; add `prune: {{hardware: NAME}}` (a100-80gb, h100-sxm, h200, a YAML file)"
                for d in sorted(unknown)]
    return out, warnings


def prune(spec, exp, launch) -> list[str]:
    """Move the runs `spec.prune` rules out into `exp.skipped` (their ids into `exp.pruned`); every run's
    prediction lands in `exp.predictions`. Returns warning lines (nothing could be pruned, and why)."""
    rules = spec.prune
    named = (rules.hardware if rules else None) or getattr(launch, "hardware", None)  # the file's, else --hardware
    preds, warnings = predict_runs(exp.runs, named, launch)
    exp.predictions.update(preds)
    if rules is None:
        return []
    reasons = {}
    if rules.fit:
        reasons.update(_too_big(exp.runs, preds))
        if not any(p.rank_memory for p in preds.values()):
            warnings.append("prune.fit: no run has a known device memory here; nothing is pruned by fit")
    if rules.slower_than_best:
        left = [c for c in exp.runs if c.run_id not in reasons]
        reasons.update(_too_slow(left, preds, rules.slower_than_best))
    exp.skipped += [skipped_row(cfg, reasons[cfg.run_id]) for cfg in exp.runs if cfg.run_id in reasons]
    exp.pruned |= set(reasons)
    exp.runs = [cfg for cfg in exp.runs if cfg.run_id not in reasons]
    return [f"prune: {w}" for w in warnings]


def _too_big(runs: list[RunConfig], preds: dict) -> dict[str, str]:
    out = {}
    for cfg in runs:
        p = preds[cfg.run_id]
        if p.peak_bytes is not None and p.rank_memory and p.peak_bytes > p.rank_memory:
            out[cfg.run_id] = (f"pruned: predicted peak memory {format_bytes(p.peak_bytes)} per rank exceeds the "
                               f"{format_bytes(p.rank_memory)} a rank has on {p.hardware} ({p.memory_note}); prune.fit = true")
    return out


def _too_slow(runs: list[RunConfig], preds: dict, factor: float) -> dict[str, str]:
    timed = [c for c in runs if preds[c.run_id].tokens_per_s]
    if not timed:
        return {}
    best = max(timed, key=lambda c: preds[c.run_id].tokens_per_s)
    top = preds[best.run_id]
    out = {}
    for cfg in timed:
        p = preds[cfg.run_id]
        ratio = top.tokens_per_s / p.tokens_per_s  # time per token over the best's
        if ratio > factor:
            out[cfg.run_id] = (f"pruned: predicted {_ms(p.step_time_s)}/step, {p.tokens_per_s:,.0f} tokens/s on "
                               f"{p.hardware}: {ratio:.1f}× the best predicted time per token ({_ms(top.step_time_s)}"
                               f"/step, {top.tokens_per_s:,.0f} tokens/s, {describe(best)}); "
                               f"prune.slower_than_best = {factor:g}")
    return out


def warn(lines: list[str]) -> None:
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
