"""One benchmark run on every rank: set up, train, measure, gather one result row on rank 0.

Phases: warm-up steps → timed steps (step timer, and on CUDA the peak-memory probe; the batch is
built before the timer starts and the loss read after it stops) → on CPU a lead-in step and one step under the
peak-memory probe → the trainer's metered step, if it has a meter (the pipeline bubble) → one step
under the communication and host-sync counters → with `profile`, one step under torch.profiler
(bench.metrics.profile: a trace and an op table per rank). The instrumented steps
slow what they measure, so they are never timed; what they count per step is deterministic.
"""
from __future__ import annotations

import contextlib
import ctypes
import resource
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from bench.backends.registry import get_backend
from bench.config import RunConfig, parse_fault
from bench import device as bench_device
from bench.distributed import ProcessGroups, rank_session
from bench.environment import node_name
from bench.metrics.comm import CommCounter
from bench.metrics.flops import peak_flops
from bench.metrics.memory import PeakMemory, state_bytes
from bench.metrics.sync import HostSyncCounter
from bench.metrics.timer import StepTimer
from bench.results import RankResult, format_exception, measured_row as make_row  # noqa: F401 - the row is built there
from bench.training import ADAMW, RunContext, Trainer


# glibc hands freed memory back to the kernel: it trims the heap's top once 128 KiB lie free there and
# unmaps blocks above its mmap threshold, so a CPU step page-faults afresh the activations, gradients
# and buffers the step before freed (5-8 % of a `small` step here, 2-6 % with FSDP and ZeRO-3, varying
# with the allocation pattern). CUDA's caching allocator keeps them; so do the ranks: the heap is trimmed
# only past 256 MiB free, and blocks up to 32 MiB (glibc's largest threshold) come from the heap.
GLIBC_MALLOPT = {-1: 256 << 20, -3: 32 << 20}  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)


def keep_freed_memory() -> None:
    """Set GLIBC_MALLOPT in this process (a no-op without glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    for param, value in GLIBC_MALLOPT.items():
        libc.mallopt(param, value)


def run(cfg: RunConfig, trace_dir: str | None = None) -> dict | None:
    """Run `cfg` on this rank (torch.distributed env already set). Returns the row on rank 0.
    `trace_dir`: where a profiled run (cfg.profile) writes its traces (bench.metrics.profile)."""
    keep_freed_memory()  # a Slurm task's rank starts here; a RankPool's already did (bench.spawn)
    with rank_session(cfg.device, cfg.timeout_s) as device:
        with optimizer_faults(cfg.fault), trainer_on_rank(cfg, device) as (trainer, groups):
            measured = _measure(trainer, trace_dir if cfg.profile else None)
        ranks = [None] * groups.layout.world_size
        dist.all_gather_object(ranks, measured)
    if groups.rank != 0:
        return None
    row = make_row(cfg, ranks)
    return {**row, "trace_dir": trace_dir} if cfg.profile and trace_dir else row


@contextmanager
def trainer_on_rank(cfg: RunConfig, device: torch.device) -> Iterator[tuple[Trainer, ProcessGroups]]:
    """The one way a rank gets a config's trainer: seeded, on this config's own process groups (built on
    the default group `setup_rank` made), by its backend's `build`; closed on leaving. The worker, the
    parity harness, the tests and the benchmarks all enter it."""
    torch.manual_seed(cfg.seed)
    groups = ProcessGroups.build(cfg.layout)
    trainer = get_backend(cfg.backend).build(RunContext(cfg, groups, device))
    try:
        yield trainer, groups
    finally:
        trainer.close()


def _inject_fault(cfg: RunConfig, rank: int) -> None:
    """Test-only faults (RunConfig.fault) before a step: `raise`, `hang`, `oom` (an injected MemoryError)
    and `oom_real` (a real allocation failure) on the last rank; `sleep:MS` slows every step of every rank."""
    faults, last = parse_fault(cfg.fault), rank == cfg.world - 1
    if "sleep" in faults:
        time.sleep(faults["sleep"] / 1e3)
    if last and "raise" in faults:
        raise RuntimeError("injected fault (fault=raise)")
    if last and "oom" in faults:
        raise MemoryError("injected fault (fault=oom): out of memory")
    if last and "oom_real" in faults:
        _allocate_beyond_a_limit()
    if last and "hang" in faults:
        time.sleep(10**6)


def _allocate_beyond_a_limit(gib: int = 1) -> None:
    """A real allocation failure: cap this process's address space just above what it maps now and
    allocate `gib` GiB (the allocator's own error propagates). The cap is lifted again either way."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 64 * 2**20, hard))
    try:
        torch.ones(gib * 2**30, dtype=torch.uint8)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def optimizer_faults(fault: str):
    """Test-only faults at every optimizer step while inside, through torch's global step hooks: the one
    place every backend's update goes through (DeepSpeed steps its client torch optimizer on its flat
    fp32 partitions, FSDP on DTensor shards, native ZeRO-1 on its shards).

    grad_scale:K  multiplies every gradient by K before the step (K = dp: the dp-sum bug, gradients
                  summed over replicas instead of averaged)
    lr_scale:K    runs the step at K × the learning rate (0: a run that does not train)
    sgd:LR        replaces the update by plain SGD, p ← p − LR · grad: unlike Adam's, scale-sensitive, so
                  θ₀ − θ₁ is the gradient the optimizer applied (tests/support/parity.py compares it)"""
    faults, handles = parse_fault(fault), []
    if "grad_scale" in faults:
        @torch.no_grad()
        def scale_grads(opt, args, kwargs):
            for p in _stepped(opt):
                _local(p.grad).mul_(faults["grad_scale"])
        handles.append(register_optimizer_step_pre_hook(scale_grads))
    if "lr_scale" in faults:
        def scale_lr(opt, args, kwargs):
            for group in opt.param_groups:
                group["lr"] = ADAMW["lr"] * faults["lr_scale"]
        handles.append(register_optimizer_step_pre_hook(scale_lr))
    if "sgd" in faults:
        before: dict[int, torch.Tensor] = {}

        @torch.no_grad()
        def keep(opt, args, kwargs):
            before.update({id(p): _local(p).clone() for p in _stepped(opt)})

        @torch.no_grad()
        def sgd(opt, args, kwargs):  # undo the optimizer's own update, apply plain SGD instead
            for p in _stepped(opt):
                _local(p).copy_(before.pop(id(p)) - faults["sgd"] * _local(p.grad))
        handles += [register_optimizer_step_pre_hook(keep), register_optimizer_step_post_hook(sgd)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _stepped(opt) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP, DTensor TP), updated in place; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _measure(trainer: Trainer, trace_dir: str | None = None) -> RankResult:
    """This rank's measurements. Each step's batch is built before its timer starts, only `train` is
    timed, and the loss is read (the step's one host sync) after the timer stops. Instruments that
    would disturb a timed step run on extra, untimed steps: the trainer's own meter (e.g. the pipeline
    bubble), then the communication and host-sync counters."""
    cfg, groups, device = trainer.ctx.cfg, trainer.ctx.groups, trainer.ctx.device
    train = _with_fault(trainer.train, cfg, groups.rank) if cfg.fault != "none" else trainer.train
    losses, warmup_s = _warm_up(train, trainer, cfg, device)
    timer, mem = StepTimer(device), PeakMemory(device)
    on_host = not bench_device.for_device(device).is_accelerator
    with mem if mem.free else contextlib.nullcontext():
        for step in range(cfg.warmup, cfg.warmup + cfg.steps):
            batch = trainer.batch(step)
            if on_host:  # every rank's step starts together: a rank's time is its own, not its wait for a slower one
                dist.barrier()
            with timer:
                loss = train(batch)
            losses.append(_value(loss))
    state = state_bytes(trainer.state_tensors())
    extra = cfg.warmup + cfg.steps
    if not mem.free:  # a probe that slows its step watches an extra one, after a lead-in
        batch = trainer.batch(extra)
        with mem:
            train(batch)
            with mem.measured():
                train(batch)
    meter = trainer.meter()
    if meter is not None:
        with meter:
            train(trainer.batch(extra))
    batch = trainer.batch(extra)
    with CommCounter.for_groups(groups) as counter, HostSyncCounter() as syncs:
        train(batch)
    extras = trainer.extras()
    if cfg.compile:
        extras["compile_s"] = compile_seconds(warmup_s, timer.times)
    if trace_dir:  # last: the profiler's start-up and bookkeeping touch no other step
        from bench.metrics.profile import StepProfile
        batch = trainer.batch(extra)
        with StepProfile(trace_dir, groups.rank, device):
            train(batch)
    return RankResult(rank=groups.rank, losses=losses, times=timer.times, peak_mem=mem.peak_bytes,
                      peak_mem_reserved_bytes=mem.reserved_peak_bytes, alloc_retries=mem.alloc_retries,
                      host_syncs=syncs.total, cuda_syncs=syncs.cuda_syncs, state=state, comm=counter.totals(),
                      extras=extras, peak_flops=peak_flops(device, cfg.dtype) if groups.rank == 0 else None,
                      device_name=bench_device.device_name(device), node=node_name())


def _warm_up(train, trainer, cfg: RunConfig, device: torch.device) -> tuple[list[float], list[float]]:
    """The untimed warm-up steps: their losses and wall-clock seconds (the device is waited for at the end
    of each: these steps are not timed, and with `compile` the first of them compiles)."""
    losses, seconds = [], []
    for step in range(cfg.warmup):
        batch = trainer.batch(step)
        t0 = time.perf_counter()
        losses.append(_value(train(batch)))
        bench_device.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def compile_seconds(warmup_s: list[float], timed_s: list[float]) -> float:
    """Time the warm-up spent beyond steady-state steps (the median timed step): compilation, on the first
    step, and any recompilation after it."""
    steady = statistics.median(timed_s)
    return sum(max(0.0, s - steady) for s in warmup_s)


def _value(loss: torch.Tensor | None) -> float | None:
    return None if loss is None else float(loss)


def _with_fault(train, cfg: RunConfig, rank: int):
    """`train` with the test-only faults; `slow_rank:MS` sleeps after the step's last collective, on the last
    rank only, so that the other ranks wait for it outside their timed steps (a straggler, seen per rank)."""
    slow = parse_fault(cfg.fault).get("slow_rank") if rank == cfg.world - 1 else None

    def faulty(batch):
        _inject_fault(cfg, rank)
        loss = train(batch)
        if slow:
            time.sleep(slow / 1e3)
        return loss
    return faulty
