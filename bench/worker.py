"""One benchmark run on every rank: set up, train, measure, gather one result row on rank 0.

Phases: warm-up steps → timed steps (step timer + peak-memory probe; the batch is built before the
timer starts and the loss read after it stops) → the trainer's metered step, if it has a meter (the
pipeline bubble) → one step under the communication and host-sync counters. The instrumented steps
slow what they measure, so they are never timed; what they count per step is deterministic.
"""
from __future__ import annotations

import json
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from bench.analysis.estimate import predict_row
from bench.backends.registry import get_backend
from bench.config import RunConfig
from bench.distributed import ProcessGroups, init_from_env, resolve_device, shutdown
from bench.environment import environment
from bench.layout import Layout
from bench.metrics.comm import CommCounter
from bench.metrics.flops import peak_flops
from bench.metrics.memory import PeakMemory, tensor_bytes
from bench.metrics.sync import HostSyncCounter
from bench.metrics.timer import StepTimer
from bench.training import RunContext
from models import count_params, flops_per_token

STATUSES = ("ok", "failed", "timeout", "oom", "cancelled", "skipped")


def run(cfg: RunConfig) -> dict | None:
    """Run `cfg` on this rank (torch.distributed env already set). Returns the row on rank 0."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # events, streams and allocator statistics default to it
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


def _global_losses(ranks: list[dict]) -> list[float]:
    """Mean over the ranks that computed a loss: every data-parallel replica reports equally often."""
    steps = len(ranks[0]["losses"])
    out = []
    for i in range(steps):
        values = [r["losses"][i] for r in ranks if r["losses"][i] is not None]
        out.append(sum(values) / len(values) if values else float("nan"))
    return out


def make_row(cfg: RunConfig, ranks: list[dict], device: torch.device) -> dict:
    """The result row (schema in DESIGN.md and bench.results.COLUMNS) from every rank's measurements."""
    timer = StepTimer(device)
    timer.times = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]  # slowest rank
    timing = timer.summary()
    step_s = timing["step_time_s"]
    flops_step = flops_per_token(cfg.model_config, cfg.seq) * cfg.tokens_per_step
    peak, peak_src = ranks[0]["peak_flops"]
    losses = _global_losses(ranks)
    row = {**cfg.to_row(), "status": "ok", "error": None, "params": count_params(cfg.model_config), **timing,
           "tokens_per_s": cfg.tokens_per_step / step_s,
           "tflops_per_device": flops_step / step_s / cfg.world / 1e12,
           "peak_flops": peak, "peak_flops_source": peak_src,
           "peak_mem_bytes": max(r["peak_mem"] for r in ranks),
           "peak_mem_bytes_per_rank": json.dumps([r["peak_mem"] for r in ranks]),
           **_max_over_ranks(ranks, "peak_mem_reserved_bytes", "alloc_retries"),
           "host_syncs_per_step": max(r["host_syncs"] for r in ranks),
           "cuda_syncs_per_step": _max_over_ranks(ranks, "cuda_syncs")["cuda_syncs"],
           "loss_first": losses[0], "loss_last": losses[-1], "losses": json.dumps(losses),
           "device_name": ranks[0]["device_name"], **environment()}
    row["mfu"] = row["tflops_per_device"] * 1e12 / peak
    for kind in ("params", "grads", "optimizer"):
        row[f"{kind}_bytes"] = max(r["state"][kind] for r in ranks)
    persistent = [sum(r["state"].values()) for r in ranks]
    row.update(persistent_bytes=max(persistent), persistent_bytes_per_rank=json.dumps(persistent))
    comm_keys = {k for r in ranks for k in r["comm"]} | {f"comm_{m}_{d}" for m in ("bytes", "wire_bytes", "ops")
                                                         for d in ("tp", "pp", "dp")}
    for key in sorted(comm_keys):  # averaged over ranks (DESIGN.md)
        row[key] = sum(r["comm"].get(key, 0) for r in ranks) / len(ranks)
    row.update(_merge_extras([r["extras"] for r in ranks]))
    row.update(predict_row(cfg))  # pred_* columns beside the measured ones (bench.analysis)
    return row


def _max_over_ranks(ranks: list[dict], *keys: str) -> dict:
    """The worst rank's value of each per-rank measurement, None where no rank has one (CPU)."""
    values = {k: [r[k] for r in ranks if r.get(k) is not None] for k in keys}
    return {k: max(v) if v else None for k, v in values.items()}


def _merge_extras(extras: list[dict]) -> dict:
    out = dict(extras[0])
    for key, value in extras[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.fmean(e[key] for e in extras if key in e)
    return out


def format_exception(exc: BaseException) -> str:
    """The traceback's last 4,000 characters: enough to name the failing line, small enough for a row."""
    return "".join(traceback.format_exception(exc))[-4000:]
