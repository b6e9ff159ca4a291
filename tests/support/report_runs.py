"""Real result sets for the report/compare/history tests, made once per test session.

Every row comes from a real run on warm rank pools (`pools` fixture). Sets that must look like "the
same config, measured again after a change" (a slowed run, a smaller model) are real runs of a
different config whose identity columns are then set to the baseline config's: that is exactly what
a code change that slows a config (or changes its traffic) would produce.
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.config import RunConfig

BASE = dict(model="tiny", backend="native", steps=3, warmup=1)
CONFIGS = [RunConfig(**BASE, dp=1, micro_batches=2, repeat=r) for r in (0, 1)] + \
          [RunConfig(**BASE, dp=1, micro_batches=1)] + \
          [RunConfig(**BASE, dp=2, micro_batches=1, repeat=r) for r in (0, 1)]
FAILING = RunConfig(**BASE, dp=2, fault="raise")
IDENTITY = ("run_id", "config_id", "fault", "model_overrides", "repeat")

_CACHE: dict[str, Path] = {}


def write_rows(rows: list[dict], out: Path) -> Path:
    """A sweep-like output folder: out/runs/<run_id>.json (through the sweep's store when present)."""
    try:
        from bench.results.store import ResultStore
    except ImportError:
        ResultStore = None
    for row in rows:
        if ResultStore is not None:
            ResultStore(out).write(row)
        else:
            (out / "runs").mkdir(parents=True, exist_ok=True)
            (out / "runs" / f"{row['run_id']}.json").write_text(json.dumps(row, default=str))
    return out


def relabel(row: dict, as_cfg: RunConfig) -> dict:
    """The row of a real run, presented as a measurement of `as_cfg` (see the module docstring)."""
    identity = as_cfg.to_row()
    return {**row, **{k: identity[k] for k in IDENTITY}}


def result_sets(pools, root: Path) -> dict[str, Path]:
    """baseline, a fresh re-run, a slowed re-run (sleep 400 ms per step) and a changed-traffic re-run."""
    if _CACHE:
        return _CACHE
    run = lambda cfg: pools(cfg.world).run(cfg)  # noqa: E731
    baseline = [run(c) for c in CONFIGS] + [run(FAILING)]
    singles = [c for c in CONFIGS if c.repeat == 0]
    rerun = [run(c) for c in singles]
    slowed = [relabel(run(c.replace(fault="sleep:400")), c) for c in singles]
    fewer_layers = relabel(run(singles[-1].replace(model_overrides=("layers=2",))), singles[-1])
    _CACHE.update(
        baseline=write_rows(baseline, root / "baseline"),
        rerun=write_rows(rerun, root / "rerun"),
        slowed=write_rows(slowed, root / "slowed"),
        changed=write_rows([*rerun[:-1], fewer_layers], root / "changed"),
    )
    return _CACHE
