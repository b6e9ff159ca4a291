"""One benchmark run on every rank: set up, train, measure, gather one result row on rank 0.

Phases: warm-up steps → timed steps (step timer + peak-memory probe) → one extra step under the
communication counter (it slows the step, so it is never timed; traffic per step is deterministic).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench.backends.base import RunContext
from bench.backends.registry import get_backend
from bench.config import RunConfig
from bench.distributed import ProcessGroups, init_from_env, resolve_device, shutdown
from bench.layout import Layout
from bench.metrics.comm import CommCounter
from bench.metrics.flops import peak_flops
from bench.metrics.memory import PeakMemory, tensor_bytes
from bench.metrics.timer import StepTimer
from bench.results import format_exception, measured_row as make_row  # noqa: F401 - the row is built there


def run(cfg: RunConfig) -> dict | None:
    """Run `cfg` on this rank (torch.distributed env already set). Returns the row on rank 0."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    init_from_env(device, cfg.timeout_s)
    try:
        groups = ProcessGroups.build(Layout(cfg.tp, cfg.pp, cfg.dp, cfg.order))
        measured = _measure(cfg, RunContext(cfg, groups, device))
        ranks = [None] * groups.layout.world_size
        dist.all_gather_object(ranks, measured)
        return make_row(cfg, ranks, device) if groups.rank == 0 else None
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


def _measure(cfg: RunConfig, ctx: RunContext) -> dict:
    trainer = get_backend(cfg.backend).build(cfg, ctx)
    if cfg.fault != "none":
        trainer.train_step = _with_fault(trainer.train_step, cfg, ctx.groups.rank)
    try:
        losses = [trainer.train_step(step) for step in range(cfg.warmup)]
        timer = StepTimer(ctx.device)
        with PeakMemory(ctx.device) as mem:
            for step in range(cfg.warmup, cfg.warmup + cfg.steps):
                with timer:
                    losses.append(trainer.train_step(step))
        state = {k: tensor_bytes(v) for k, v in trainer.state_tensors().items()}
        with CommCounter(dim_of=ctx.groups.dim_of) as counter:
            trainer.train_step(cfg.warmup + cfg.steps)
        return {"rank": ctx.groups.rank, "losses": losses, "times": timer.times, "peak_mem": mem.peak_bytes,
                "state": state, "comm": counter.totals(), "extras": trainer.extras(),
                "peak_flops": peak_flops(ctx.device, cfg.dtype) if ctx.groups.rank == 0 else None,
                "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"}
    finally:
        trainer.close()


def _with_fault(step_fn, cfg: RunConfig, rank: int):
    def step(i):
        _inject_fault(cfg, rank)
        return step_fn(i)
    return step
