"""The timed window holds training only: no host synchronisation per micro-batch in `train(batch)`.

The worker builds each step's batch before the timer starts, times `train(batch)` alone and reads the
loss after the timer stops; on one extra, untimed step it counts the ops that make the host wait for
the device (`bench.metrics.sync`) inside that same `train(batch)`: the row's `host_syncs_per_step`.
A `.item()` per micro-batch would show as a count that grows with the micro-batches.
"""
import pytest
import torch

from bench.config import RunConfig
from bench.metrics.sync import HostSyncCounter
from bench.training import make_optimizer

RUN = dict(model="tiny", steps=1, warmup=1)
NO_SYNC = {  # name → RunConfig fields, 4 micro-batches each
    "native": dict(backend="native"),
    "native_pp2": dict(backend="native", pp=2, schedule="1f1b"),
    "native_tp2": dict(backend="native", tp=2),
    "native_pp2_interleaved": dict(backend="native", pp=2, schedule="interleaved", virtual_stages=2),
    "native_dp2_zero1": dict(backend="native", dp=2, zero=1),
    "ddp": dict(backend="ddp", dp=2),
    "fsdp": dict(backend="fsdp", dp=2),
    "fsdp_pp2": dict(backend="fsdp", pp=2),
    "deepspeed_pp2": dict(backend="deepspeed", pp=2),
}


def host_syncs(pools, micro_batches: int, **kw) -> int:
    cfg = RunConfig(**RUN, micro_batches=micro_batches, **kw)
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row["host_syncs_per_step"]


# --- the counter itself: it sees what syncs, and only that ---------------------------------------------
def test_counter_sees_each_kind_of_host_sync():
    x = torch.arange(4.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        bool(x[0])
        torch.equal(x, x)
        x.nonzero()
    assert syncs.total == 4, syncs.by_op


def test_counter_sees_a_sync_inside_backward():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            grad.sum().item()  # what a loss-scaler overflow check does
            return grad * 2

    w = torch.ones(3, requires_grad=True)
    with HostSyncCounter() as syncs:
        ReadsInBackward.apply(w).sum().backward()
    assert syncs.total == 1, syncs.by_op


def test_counter_ignores_the_optimizers_host_step_counter():
    model = torch.nn.Linear(8, 8)
    opt = make_optimizer(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # creates the state, step counters included
    with HostSyncCounter() as syncs:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()  # AdamW reads each step counter with .item(): a host tensor on every device
    assert syncs.total == 0, syncs.by_op


# --- every backend: none per micro-batch --------------------------------------------------------------
@pytest.mark.parametrize("name", list(NO_SYNC))
def test_train_never_syncs_the_host(pools, name):
    assert host_syncs(pools, 4, **NO_SYNC[name]) == 0


@pytest.mark.parametrize("zero", [1, 3])
def test_deepspeed_zero_syncs_once_per_step_whatever_the_micro_batches(pools, zero):
    # DeepSpeed's ZeRO optimizer reads its gradient norm on the host at each optimizer step (its
    # overflow check, stage_1_and_2 / stage3 `step`), at the accumulation boundary: a library
    # constant per step, which must not grow with the micro-batches.
    counts = [host_syncs(pools, m, backend="deepspeed", dp=2, zero=zero) for m in (1, 4)]
    assert counts[0] == counts[1] <= 1, counts


# --- CUDA only: the event timer and the allocator statistics ------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timer_and_memory_probe():
    from bench.metrics.memory import PeakMemory
    from bench.metrics.timer import StepTimer
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    timer = StepTimer(device)
    with PeakMemory(device) as mem:
        for _ in range(3):
            with timer:
                b = a @ a  # a new 64 MiB product each step
        torch.cuda.synchronize(device)
    assert len(timer.times) == 3 and all(0 < t < 1 for t in timer.times)
    assert mem.peak_bytes >= b.numel() * 4 and mem.reserved_peak_bytes >= mem.peak_bytes + a.numel() * 4
    assert mem.alloc_retries == 0
