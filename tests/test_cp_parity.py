"""Context parallel reproduces the single-process model: loss and every gradient, on every layout cp
composes with (issue 24's parity grid), and the planted bugs that would break it are caught.

Each config trains `tiny` (learned positions) or `tiny-llama` (rope, GQA) from the reference weights
on the reference batch; its loss after 3 AdamW steps and its step-1 gradient, reduced over dp × cp and
reassembled whole, must equal the single-process run's within 1e-5 relative (fp32; the issue's number).
The native engine hands over its reduced gradient; FSDP's is the one its optimizer applied in one plain
SGD step (`support.parity.applied_gradients`' rule), which also sees a gradient off by a constant factor
(the planted `grad_scale:2`, what summing over dp × cp instead of averaging would give).
DeepSpeed (Ulysses) shows both the gradient it reduced (`safe_get_full_grad`) and the one its optimizer
applied (one SGD step); the planted bug `grad_scale:2` (summing over the cp ranks instead of taking
each rank's share of the mean) must fail the applied check.
"""
import math

import pytest
import torch

from bench.config import RunConfig
from support.parity import applied_gradients, deepspeed_runs, reference, run_layouts

RTOL, ATOL = 1e-5, 1e-7
RUN = dict(steps=1, warmup=0)

NATIVE = {  # world → name → fields
    2: {"cp2": dict(cp=2, micro_batch=2),
        "cp2_llama": dict(model="tiny-llama", cp=2, micro_batch=2, micro_batches=2),
        "cp2_selective": dict(cp=2, micro_batch=2, recompute="selective")},
    4: {"cp4": dict(cp=4, micro_batch=2),
        "cp2_tp2_sp": dict(cp=2, tp=2, micro_batch=2, sequence_parallel=True),
        "cp2_pp2_1f1b": dict(cp=2, pp=2, micro_batch=1, micro_batches=2),
        "cp2_pp2_interleaved": dict(cp=2, pp=2, micro_batch=1, micro_batches=2, schedule="interleaved",
                                    virtual_stages=2),
        "cp2_dp2_zero1": dict(cp=2, dp=2, micro_batch=1, micro_batches=2, zero=1),
        "cp2_tp2_llama": dict(model="tiny-llama", cp=2, tp=2, micro_batch=2)},
    8: {"cp2_tp2_pp2_full": dict(cp=2, tp=2, pp=2, micro_batch=1, micro_batches=2, recompute="full"),
        "cp2_pp2_dp2_zero1": dict(cp=2, pp=2, dp=2, micro_batch=1, micro_batches=2, zero=1)},
}


FSDP = {  # world → name → fields (backend fsdp; FSDP2 shards over dp × cp)
    2: {"cp2": dict(cp=2, micro_batch=2),
        "cp2_llama": dict(model="tiny-llama", cp=2, micro_batch=2, micro_batches=2, recompute="selective")},
    4: {"cp2_dp2_full": dict(cp=2, dp=2, micro_batch=1, micro_batches=2, fsdp="full"),
        "cp2_dp2_grad_op": dict(cp=2, dp=2, micro_batch=2, fsdp="grad-op"),
        "cp2_dp2_hybrid": dict(cp=2, dp=2, micro_batch=2, fsdp="hybrid"),
        "cp2_tp2": dict(model="tiny-llama", cp=2, tp=2, micro_batch=2),
        "cp2_pp2_1f1b": dict(cp=2, pp=2, micro_batch=1, micro_batches=2),
        "cp2_pp2_interleaved": dict(cp=2, pp=2, micro_batch=1, micro_batches=2, schedule="interleaved",
                                    virtual_stages=2, fsdp="grad-op")},
    8: {"cp2_tp2_pp2": dict(cp=2, tp=2, pp=2, micro_batch=1, micro_batches=2),
        "cp2_pp2_dp2_hybrid": dict(cp=2, pp=2, dp=2, micro_batch=1, micro_batches=2, fsdp="hybrid")},
}
PLANT = "grad_scale:2"
FSDP_PLANTED = {2: ("cp2",), 4: ("cp2_dp2_full",), 8: ()}  # FSDP configs rerun with the planted bug

DEEPSPEED = {  # world → name → fields (backend deepspeed: cp_comm ulysses, its one algorithm)
    2: {"cp2_zero0": dict(cp=2, micro_batch=2, zero=0),
        "cp2_zero1": dict(cp=2, micro_batch=2, zero=1),
        "cp2_zero2": dict(cp=2, micro_batch=1, micro_batches=2, zero=2),
        "cp2_zero3": dict(cp=2, micro_batch=2, zero=3),
        "cp2_llama_selective": dict(model="tiny-llama", cp=2, micro_batch=2, zero=1, recompute="selective")},
    4: {"cp2_dp2_zero3": dict(cp=2, dp=2, micro_batch=1, micro_batches=2, zero=3),
        "cp2_tp2_zero1": dict(cp=2, tp=2, micro_batch=2, zero=1)},
}
DS_PLANTED = {2: ("cp2_zero1",), 4: ("cp2_dp2_zero3",)}


def config(fields: dict, **extra) -> RunConfig:
    return RunConfig(**{"model": "tiny", **RUN, **fields, **extra})


@pytest.fixture(scope="module")
def native_runs(pools):
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            names = list(NATIVE[world])
            results = run_layouts(pools(world), [config(NATIVE[world][n]) for n in names], timeout_s=900)
            cache[world] = dict(zip(names, results))
        return cache[world]
    return get


def mismatches(cfg: RunConfig, got: dict) -> list[str]:
    ref = reference(cfg)
    out = []
    if not math.isclose(got["losses"][-1], ref["losses"][-1], rel_tol=RTOL):
        out.append(f"loss {got['losses']} vs {ref['losses']}")
    grads = got["grads"] if got["grads"] is not None else got["applied"]  # ZeRO-1: the applied SGD step
    return out + grad_mismatches(ref["grads"], grads)


def grad_mismatches(ref: dict, grads: dict) -> list[str]:
    return [f"grad {name}: max |Δ| {(grads[name] - g).abs().max():.2e}"
            for name, g in ref.items() if not torch.allclose(grads[name], g, rtol=RTOL, atol=ATOL)]


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w == 8 else [])
                                        for w in NATIVE for n in NATIVE[w]])
def test_native_cp_equals_the_single_process_model(native_runs, world, name):
    failures = mismatches(config(NATIVE[world][name]), native_runs(world)[name])
    assert not failures, f"{name}: " + "\n".join(failures)


@pytest.fixture(scope="module")
def fsdp_runs(pools):
    """world → {(name, fault): result}, every FSDP config of a world size in one pool call."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            keys = [(n, "none") for n in FSDP[world]] + [(n, PLANT) for n in FSDP_PLANTED[world]]
            cfgs = [config(FSDP[world][n], backend="fsdp", fault=f) for n, f in keys]
            cache[world] = dict(zip(keys, run_layouts(pools(world), cfgs, timeout_s=900)))
        return cache[world]
    return get


@pytest.fixture(scope="module")
def deepspeed_results(pools):
    """world → {name: losses, DeepSpeed's reduced gradients, the applied ones} and {name: planted applied}."""
    cache = {}

    def get(world: int) -> tuple[dict, dict]:
        if world not in cache:
            names = list(DEEPSPEED[world])
            cfgs = [config(DEEPSPEED[world][n], backend="deepspeed") for n in names]
            runs = deepspeed_runs(pools(world), cfgs, timeout_s=900)
            planted = [config(DEEPSPEED[world][n], backend="deepspeed", fault=PLANT) for n in DS_PLANTED[world]]
            applied = applied_gradients(pools(world), cfgs + planted, timeout_s=900)
            results = {n: {**run, "applied": a} for n, run, a in zip(names, runs, applied)}
            cache[world] = results, dict(zip(DS_PLANTED[world], applied[len(names):]))
        return cache[world]
    return get


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w == 8 else [])
                                        for w in FSDP for n in FSDP[w]])
def test_fsdp_cp_equals_the_single_process_model(fsdp_runs, world, name):
    cfg = config(FSDP[world][name], backend="fsdp")
    failures = mismatches(cfg, fsdp_runs(world)[name, "none"])
    assert not failures, f"{name}: " + "\n".join(failures)


@pytest.mark.parametrize("world,name", [(w, n) for w in FSDP_PLANTED for n in FSDP_PLANTED[w]])
def test_fsdp_cp_parity_catches_a_gradient_off_by_the_planted_factor(fsdp_runs, world, name):
    cfg = config(FSDP[world][name], backend="fsdp", fault=PLANT)
    assert any(f.startswith("grad") for f in mismatches(cfg, fsdp_runs(world)[name, PLANT]))


@pytest.mark.parametrize("world,name", [(w, n) for w in DEEPSPEED for n in DEEPSPEED[w]])
def test_deepspeed_ulysses_equals_the_single_process_model(deepspeed_results, world, name):
    cfg, got = config(DEEPSPEED[world][name], backend="deepspeed"), deepspeed_results(world)[0][name]
    applied = grad_mismatches(reference(cfg)["grads"], got["applied"])
    failures = mismatches(cfg, got) + [f"applied {m}" for m in applied]
    assert not failures, f"{name}: " + "\n".join(failures)


@pytest.mark.parametrize("world", list(DS_PLANTED))
def test_deepspeed_planted_cp_sum_fails(deepspeed_results, world):
    for name, applied in deepspeed_results(world)[1].items():
        ref = reference(config(DEEPSPEED[world][name], backend="deepspeed"))["grads"]
        assert len(grad_mismatches(ref, applied)) > len(ref) // 2, name  # every gradient 2× (those ~0 aside)
