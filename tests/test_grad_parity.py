"""Gradient parity for every backend, layout and ZeRO/FSDP stage — not only the loss.

A loss after Adam steps cannot see a gradient off by a constant factor (Adam divides it out: scaling
every gradient by 2 moves the 3-step loss by < 1e-7 relative). So every layout here takes one step of
plain SGD from the reference weights (the test-only fault `sgd:1`, applied through torch's optimizer
step hooks that every backend goes through, DeepSpeed's client optimizer included), and
θ₀ − θ₁ — the gradient the optimizer really applied, after tp/pp/dp reduction and ZeRO/FSDP
partitioning, reassembled whole on rank 0 (tests/support/parity.py) — must equal the single-process step-1
gradient under the native tests' assert_close(rtol=1e-4, atol=1e-6).

DeepSpeed also exposes its reduced gradient: `deepspeed.utils.safe_get_full_grad` at its optimizer
boundary (ZeRO-1/2 partitions and ZeRO-3 shards gathered) must equal the same reference gradient.

The planted bug: `grad_scale:2` doubles every gradient right before the optimizer step, as summing
instead of averaging over dp = 2 replicas would; every backend's check must then fail.
All configs of one world size run in one pool call (tiny model, global batch 4, fp32, one step); the
3-D layouts of world 8 are in the slow tier.
"""
import pytest

from bench.config import RunConfig
from support.parity import applied_gradients, deepspeed_gradients, gradient_mismatches, reference

RUN = dict(model="tiny", steps=1, warmup=0)
PLANT = "grad_scale:2"

LAYOUTS = {  # name → RunConfig fields (global batch 4 each)
    2: {
        "native_zero1": dict(backend="native", dp=2, micro_batch=2, zero=1),
        "native_tp2_pp": dict(backend="native", tp=2, micro_batch=2, micro_batches=2, sequence_parallel=True),
        "ddp": dict(backend="ddp", dp=2, micro_batch=2),
        "fsdp_full": dict(backend="fsdp", fsdp="full", dp=2, micro_batch=1, micro_batches=2),
        "fsdp_grad_op": dict(backend="fsdp", fsdp="grad-op", dp=2, micro_batch=2),
        "fsdp_hybrid": dict(backend="fsdp", fsdp="hybrid", dp=2, micro_batch=2),
        "fsdp_none": dict(backend="fsdp", fsdp="none", dp=2, micro_batch=2),
        "ds_zero0": dict(backend="deepspeed", zero=0, dp=2, micro_batch=2),
        "ds_zero1": dict(backend="deepspeed", zero=1, dp=2, micro_batch=2),
        "ds_zero2": dict(backend="deepspeed", zero=2, dp=2, micro_batch=1, micro_batches=2),
        "ds_zero3": dict(backend="deepspeed", zero=3, dp=2, micro_batch=2),
        "ds_tp2": dict(backend="deepspeed", tp=2, micro_batch=4),
        "ds_pipe2": dict(backend="deepspeed", pp=2, micro_batch=2, micro_batches=2),
    },
    4: {
        "native_pp2_dp2_zero1": dict(backend="native", pp=2, dp=2, micro_batch=1, micro_batches=2, zero=1),
        "fsdp_hybrid_2x2": dict(backend="fsdp", fsdp="hybrid", dp=4, micro_batch=1),
        "fsdp_tp2_dp2": dict(backend="fsdp", fsdp="full", tp=2, dp=2, micro_batch=2),
        "fsdp_pp2_dp2_1f1b": dict(backend="fsdp", fsdp="full", pp=2, dp=2, micro_batch=1, micro_batches=2),
        "fsdp_pp2_dp2_interleaved": dict(backend="fsdp", fsdp="grad-op", pp=2, dp=2, micro_batch=1,
                                         micro_batches=2, schedule="interleaved", virtual_stages=2),
        "ds_zero3_dp4": dict(backend="deepspeed", zero=3, dp=4, micro_batch=1),
        "ds_tp2_dp2_zero3": dict(backend="deepspeed", zero=3, tp=2, dp=2, micro_batch=2),
        "ds_pp2_dp2_zero1": dict(backend="deepspeed", zero=1, pp=2, dp=2, micro_batch=1, micro_batches=2),
        "ds_tp2_pp2": dict(backend="deepspeed", tp=2, pp=2, micro_batch=2, micro_batches=2),
    },
    8: {  # slow tier: full 3-D
        "native_3d_zero1": dict(backend="native", tp=2, pp=2, dp=2, micro_batch=1, micro_batches=2, zero=1),
        "fsdp_3d_hybrid": dict(backend="fsdp", fsdp="hybrid", tp=2, pp=2, dp=2, micro_batch=1, micro_batches=2),
        "ds_3d_zero1": dict(backend="deepspeed", zero=1, tp=2, pp=2, dp=2, micro_batch=1, micro_batches=2),
    },
}
# The planted bug, on every backend and each way it reduces gradients (ZeRO 0-3, DeepSpeed's pipeline,
# FSDP's reduce-scatter and HSDP's all-reduce, DDP, native buckets and ZeRO-1 shards).
PLANTED = {2: ("native_zero1", "native_tp2_pp", "ddp", "fsdp_full", "fsdp_hybrid", "ds_zero0", "ds_zero1",
               "ds_zero2", "ds_zero3", "ds_pipe2"),
           4: ("fsdp_tp2_dp2", "ds_tp2_dp2_zero3"), 8: ()}


def config(name: str, world: int, fault: str = "none") -> RunConfig:
    return RunConfig(**RUN, **LAYOUTS[world][name], fault=fault)


@pytest.fixture(scope="module")
def applied(pools):
    """world → {(name, fault): applied gradients}, every config of a world size in one pool call."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            keys = [(n, "none") for n in LAYOUTS[world]] + [(n, PLANT) for n in PLANTED[world]]
            cfgs = [config(n, world, f) for n, f in keys]
            cache[world] = dict(zip(keys, applied_gradients(pools(world), cfgs, timeout_s=900)))
        return cache[world]
    return get


@pytest.fixture(scope="module")
def ds_grads(pools):
    """world → {name: DeepSpeed's own full gradients} for its DeepSpeed layouts, one pool call per world."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            names = [n for n in LAYOUTS[world] if n.startswith("ds_")]
            grads = deepspeed_gradients(pools(world), [config(n, world) for n in names], timeout_s=900)
            cache[world] = dict(zip(names, grads))
        return cache[world]
    return get


@pytest.fixture(scope="module")
def ref_grads():
    return reference(config("ddp", 2), steps=1)["grads"]  # global batch 4, seq, seed: the same for all


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w == 8 else [])
                                        for w in LAYOUTS for n in LAYOUTS[w]])
def test_applied_gradient_equals_the_reference(applied, ref_grads, world, name):
    assert config(name, world).global_batch == 4
    failures = gradient_mismatches(name, applied(world)[name, "none"], ref_grads)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w == 8 else [])
                                        for w in LAYOUTS for n in LAYOUTS[w] if n.startswith("ds_")])
def test_deepspeed_reduced_gradient_equals_the_reference(ds_grads, ref_grads, world, name):
    failures = gradient_mismatches(name, ds_grads(world)[name], ref_grads)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [w for w in PLANTED if PLANTED[w]])
def test_planted_dp_sum_bug_fails_every_backend(applied, ref_grads, world):
    caught = {name: len(gradient_mismatches(name, applied(world)[name, PLANT], ref_grads)) for name in PLANTED[world]}
    n_params = len(ref_grads)
    # every parameter's gradient is off by 2× (those whose gradient is ~0 aside)
    assert all(n > n_params // 2 for n in caught.values()), caught
