"""Local launchers: a run of world size N as N real processes on this machine (`LocalLauncher`, through
the warm `bench.spawn.RankPool`), or in this very process (`DebugLauncher`, world size 1).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from bench.config import RunConfig
from bench.analysis.estimate import with_predictions
from bench.results import classify_error, failure_row
from bench.spawn import RankPool, free_port
from bench.sweep.launcher import Launcher

__all__ = ["DebugLauncher", "LocalLauncher", "run_debug", "run_local"]


class LocalLauncher(Launcher):
    """Each run as its world-size processes on this machine, one run at a time. A warm RankPool per
    world size serves every run of that size (fresh port and process groups per run); a failed or
    hung run gets its processes killed and the pool restarts.

    Order: with `repeat_order` interleaved, round by round (every config's repeat k before any repeat
    k+1), world sizes grouped within a round; a pool stays alive, idle, until the last run of its
    world size, so interleaving several world sizes restarts no process (an idle rank blocks on its
    queue: it costs memory, not CPU). Blocked: by world size, one pool alive at a time."""

    kind = "local"

    def __init__(self, log: Path | None = None, repeat_order: str = "interleaved", traces: Path | None = None,
                 hardware=None):
        self.log = log
        """Where the ranks' stdout/stderr go (the terminal shows the sweep's progress)."""
        self.repeat_order = repeat_order
        self.traces = traces
        """Folder of the profiled runs' traces (one sub-folder per run_id), when a run asks for one."""
        self.hardware = hardware
        """The profile the rows are predicted on (`--hardware`); None: each row's machine's."""
        self.pools: dict[int, RankPool] = {}

    def launch(self, runs: list[RunConfig], started: Callable, finished: Callable) -> None:
        interleaved = self.repeat_order == "interleaved"
        runs = sorted(runs, key=lambda c: (c.repeat, c.world) if interleaved else (c.world,))  # stable
        left = {w: sum(c.world == w for c in runs) for w in {c.world for c in runs}}
        for cfg in runs:
            pool = self.pool(cfg.world)
            started(cfg)
            t0 = time.monotonic()
            row = pool.run(cfg, trace_dir(self.traces, cfg), self.hardware)
            finished(cfg, {**row, "wall_s": time.monotonic() - t0})
            left[cfg.world] -= 1
            if not left[cfg.world]:
                self.pools.pop(cfg.world).close()

    def pool(self, world: int) -> RankPool:
        """The warm ranks of this world size (started on their first call), which the sweep's calibration
        also measures on."""
        if world not in self.pools:
            if self.log:
                self.log.parent.mkdir(parents=True, exist_ok=True)
            self.pools[world] = RankPool(world, log=self.log)
        return self.pools[world]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.kill()
        self.pools.clear()


class DebugLauncher(Launcher):
    """In this process, world size 1 (debuggers, profilers)."""

    kind = "debug"

    def __init__(self, traces: Path | None = None, hardware=None):
        self.traces, self.hardware = traces, hardware

    def unsupported(self, cfg: RunConfig) -> str | None:
        return None if cfg.world == 1 else f"the debug launcher runs world size 1 only, not {cfg.world}"

    def launch(self, runs: list[RunConfig], started: Callable, finished: Callable) -> None:
        for cfg in runs:
            started(cfg)
            t0 = time.monotonic()
            row = run_debug(cfg, self.traces, self.hardware)
            finished(cfg, {**row, "wall_s": time.monotonic() - t0})


def trace_dir(traces: Path | None, cfg: RunConfig) -> str | None:
    """Where a profiled run writes its traces: TRACES/<run_id> (None when the run is not profiled)."""
    return str(Path(traces, cfg.run_id).resolve()) if cfg.profile and traces is not None else None


def run_local(cfg: RunConfig, traces: Path | None = None, hardware=None) -> dict:
    """One run in fresh processes (predicted on `hardware` when given)."""
    with RankPool(cfg.world) as pool:
        return pool.run(cfg, trace_dir(traces, cfg), hardware)


def run_debug(cfg: RunConfig, traces: Path | None = None, hardware=None) -> dict:
    """In this process, world size 1: for debuggers and profilers (predicted on `hardware` when given)."""
    if cfg.world != 1:
        raise ValueError(f"the debug launcher runs world size 1 only, not {cfg.world}")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    from bench import worker
    try:
        return with_predictions(cfg, worker.run(cfg, trace_dir(traces, cfg)), hardware)
    except Exception as exc:  # noqa: BLE001
        text = worker.format_exception(exc)
        return failure_row(cfg, classify_error(text), f"rank 0 failed:\n{text}", 0)
