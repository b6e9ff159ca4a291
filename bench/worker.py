"""One benchmark run on every rank: set up, train, measure, gather one result row on rank 0.

Phases: warm-up steps → timed steps (step timer + peak-memory probe; the batch is built before the
timer starts and the loss read after it stops) → the trainer's metered step, if it has a meter (the
pipeline bubble) → one step under the communication and host-sync counters → with `profile`, one step
under torch.profiler (bench.metrics.profile: a trace and an op table per rank). The instrumented steps
slow what they measure, so they are never timed; what they count per step is deterministic.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench.backends.registry import get_backend
from bench.config import RunConfig
from bench.distributed import ProcessGroups, init_from_env, resolve_device, shutdown
from bench.layout import Layout
from bench.metrics.comm import CommCounter
from bench.metrics.flops import peak_flops
from bench.metrics.memory import PeakMemory, tensor_bytes
from bench.metrics.sync import HostSyncCounter
from bench.metrics.timer import StepTimer
from bench.results import format_exception, measured_row as make_row  # noqa: F401 - the row is built there
from bench.training import RunContext


def run(cfg: RunConfig, trace_dir: str | None = None) -> dict | None:
    """Run `cfg` on this rank (torch.distributed env already set). Returns the row on rank 0.
    `trace_dir`: where a profiled run (cfg.profile) writes its traces (bench.metrics.profile)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # events, streams and allocator statistics default to it
    torch.manual_seed(cfg.seed)
    init_from_env(device, cfg.timeout_s)
    try:
        groups = ProcessGroups.build(Layout(cfg.tp, cfg.pp, cfg.dp, cfg.order))
        measured = _measure(cfg, RunContext(cfg, groups, device), trace_dir if cfg.profile else None)
        ranks = [None] * groups.layout.world_size
        dist.all_gather_object(ranks, measured)
        if groups.rank != 0:
            return None
        row = make_row(cfg, ranks, device)
        return {**row, "trace_dir": trace_dir} if cfg.profile and trace_dir else row
    finally:
        shutdown()


def _inject_fault(cfg: RunConfig, rank: int) -> None:
    """Test-only faults (RunConfig.fault) on the last rank; `sleep:MS` slows every step of every rank."""
    if cfg.fault.startswith("sleep:"):
        time.sleep(float(cfg.fault.split(":", 1)[1]) / 1e3)
    elif rank == cfg.world - 1 and cfg.fault == "raise":
        raise RuntimeError("injected fault (fault=raise)")
    elif rank == cfg.world - 1 and cfg.fault == "oom":
        raise MemoryError("injected fault (fault=oom): out of memory")
    elif rank == cfg.world - 1 and cfg.fault == "hang":
        time.sleep(10**6)


def _measure(cfg: RunConfig, ctx: RunContext, trace_dir: str | None = None) -> dict:
    """This rank's measurements. Each step's batch is built before its timer starts, only `train` is
    timed, and the loss is read (the step's one host sync) after the timer stops. Instruments that
    would disturb a timed step run on extra, untimed steps: the trainer's own meter (e.g. the pipeline
    bubble), then the communication and host-sync counters."""
    trainer = get_backend(cfg.backend).build(cfg, ctx)
    train = _with_fault(trainer.train, cfg, ctx.groups.rank) if cfg.fault != "none" else trainer.train
    try:
        losses = [_value(train(trainer.batch(step))) for step in range(cfg.warmup)]
        timer = StepTimer(ctx.device)
        with PeakMemory(ctx.device) as mem:
            for step in range(cfg.warmup, cfg.warmup + cfg.steps):
                batch = trainer.batch(step)
                with timer:
                    loss = train(batch)
                losses.append(_value(loss))
        state = {k: tensor_bytes(v) for k, v in trainer.state_tensors().items()}
        extra = cfg.warmup + cfg.steps
        meter = trainer.meter()
        if meter is not None:
            with meter:
                train(trainer.batch(extra))
        batch = trainer.batch(extra)
        with CommCounter(dim_of=ctx.groups.dim_of) as counter, HostSyncCounter() as syncs:
            train(batch)
        if trace_dir:  # last: the profiler's start-up and bookkeeping touch no other step
            from bench.metrics.profile import StepProfile
            batch = trainer.batch(extra)
            with StepProfile(trace_dir, ctx.groups.rank, ctx.device):
                train(batch)
        return {"rank": ctx.groups.rank, "losses": losses, "times": timer.times, "peak_mem": mem.peak_bytes,
                "peak_mem_reserved_bytes": mem.reserved_peak_bytes, "alloc_retries": mem.alloc_retries,
                "host_syncs": syncs.total, "cuda_syncs": syncs.cuda_syncs,
                "state": state, "comm": counter.totals(), "extras": trainer.extras(),
                "peak_flops": peak_flops(ctx.device, cfg.dtype) if ctx.groups.rank == 0 else None,
                "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"}
    finally:
        trainer.close()


def _value(loss: torch.Tensor | None) -> float | None:
    return None if loss is None else float(loss)


def _with_fault(train, cfg: RunConfig, rank: int):
    def faulty(batch):
        _inject_fault(cfg, rank)
        return train(batch)
    return faulty
