"""Expert parallel on the native engine: every layout reproduces the single-process reference, and the
analytic model predicts its bytes and ops exactly.

tiny-moe (4 experts, top-2, aux-loss coefficient 0.01, block 0 dense) on global batch 4: ep 2 and 4,
ep × dp with ZeRO-1, ep × pp, dropless and with a capacity factor of 1.0 (tokens over capacity dropped:
routing is a pure function of the weights, so every layout drops the same ones). Compared, against
`support.parity.reference` (one process, whole batch; its gradient includes the aux loss's, at scale 1):
- the losses of 3 Adam steps (rtol 1e-5), and the step-1 reduced gradient (native, outside ZeRO) and the
  gradient one plain-SGD step applied (any ZeRO), each reassembled whole: expert stacks concatenated over
  ep (`bench.training.whole_over_ep`), under the native tests' tolerance (rtol 1e-4, atol 1e-6);
- the communication of one more step, per group and op, against `bench.analysis.estimate`: the ep
  all-to-alls (5 per MoE layer and micro-batch, bench.expert_parallel) and the dp buckets, the expert
  weights' reduced over the expert-data-parallel ranks.
The planted bugs: `grad_scale:2` (a gradient summed instead of averaged) fails the SGD check; at
ep = 1 the same layouts must agree too (dp 2: the aux loss takes backward's 1/dp, bench.native.pipeline).
"""
import pytest
import torch

from bench.analysis.estimate import estimate
from bench.capabilities import unsupported_reason
from bench.config import RunConfig
from support.parity import gradient_mismatches, reference, run_layouts

RUN = dict(model="tiny-moe", steps=1, warmup=0)
CAPACITY = ("moe_capacity_factor=1.0",)
LAYOUTS = {  # name → RunConfig fields (global batch 4 each)
    2: {
        "dp2": dict(dp=2, micro_batch=2),  # ep = 1: the MoE block on dp alone
        "ep2": dict(dp=2, ep=2, micro_batch=2),
        "ep2_zero1_m2": dict(dp=2, ep=2, micro_batch=1, micro_batches=2, zero=1),
        "ep2_capacity": dict(dp=2, ep=2, micro_batch=2, model_overrides=CAPACITY),
    },
    4: {
        "ep4": dict(dp=4, ep=4, micro_batch=1),
        "ep2_dp4_zero1": dict(dp=4, ep=2, micro_batch=1, zero=1),
        "ep2_pp2_dp2": dict(pp=2, dp=2, ep=2, micro_batch=1, micro_batches=2),
        "ep4_capacity_zero1": dict(dp=4, ep=4, micro_batch=1, zero=1, model_overrides=CAPACITY),
    },
}
PLANT = "grad_scale:2"
PLANTED = {2: ("ep2",), 4: ("ep2_dp4_zero1",)}


def config(name: str, world: int, fault: str = "none") -> RunConfig:
    return RunConfig(**RUN, **LAYOUTS[world][name], fault=fault)


@pytest.fixture(scope="module")
def runs(pools):
    """world → {(name, fault): run_layouts' result}, every config of a world size in one pool call."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            keys = [(n, "none") for n in LAYOUTS[world]] + [(n, PLANT) for n in PLANTED[world]]
            results = run_layouts(pools(world), [config(n, world, f) for n, f in keys], timeout_s=900)
            cache[world] = dict(zip(keys, results))
        return cache[world]
    return get


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg: RunConfig) -> dict:
        key = cfg.model_overrides
        if key not in cache:
            cache[key] = reference(cfg)
        return cache[key]
    return get


CASES = [(w, n) for w in LAYOUTS for n in LAYOUTS[w]]


@pytest.mark.parametrize("world,name", CASES)
def test_losses_and_gradients_equal_the_reference(runs, references, world, name):
    cfg = config(name, world)
    assert cfg.global_batch == 4
    got, ref = runs(world)[name, "none"], references(cfg)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    failures = gradient_mismatches(f"{name} (applied)", got["applied"], ref["grads"])
    if not cfg.zero:
        failures += gradient_mismatches(f"{name} (reduced)", got["grads"], ref["grads"])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world,name", [(w, n) for w in PLANTED for n in PLANTED[w]])
def test_a_doubled_gradient_is_caught(runs, references, world, name):
    got = runs(world)[name, PLANT]
    assert gradient_mismatches(name, got["applied"], references(config(name, world))["grads"])


@pytest.mark.parametrize("world,name", [c for c in CASES if "capacity" not in c[1]])
def test_predicted_bytes_and_ops_equal_measured(runs, world, name):
    """Dropless routing: every assignment travels, so the prediction is exact (with a capacity factor
    it counts every assignment: an upper bound)."""
    cfg = config(name, world)
    measured, predicted = runs(world)[name, "none"]["comm"], estimate(cfg)
    keys = [k for k in predicted if k.startswith("comm_") and (k.endswith("_ep") or k.endswith("_dp") or "_ep_" in k
                                                             or "_dp_" in k)]
    assert keys and (cfg.ep == 1 or predicted["comm_ops_ep"] > 0)
    wrong = {k: (measured.get(k, 0.0), predicted[k]) for k in keys if abs(measured.get(k, 0.0) - predicted[k]) > 1e-6}
    assert not wrong, wrong


def test_the_ep_traffic_is_the_dispatch_formula(runs):
    """ep 2 at dp 2: 3 MoE layers × (forward: counts, rows out, results back; backward: 2) = 15 ops, and
    per layer 8·E + 4 · (tokens · k) · h · 4 bytes: 2 sequences of 32 tokens, top-2, h 64, fp32."""
    comm = runs(2)["ep2", "none"]["comm"]
    assert comm["comm_ops_ep"] == 15
    assert comm["comm_bytes_ep"] == 3 * (8 * 4 + 4 * (2 * 32 * 2) * 64 * 4)


def test_expert_weights_are_split_over_ep(runs):
    """Each ep rank holds E/ep experts: a rank's parameter bytes drop by the experts it does not hold."""
    from bench.analysis.stage_plan import stage_plan
    dense, split = stage_plan(config("dp2", 2)).ranks[0].params, stage_plan(config("ep2", 2)).ranks[0].params
    m = config("ep2", 2).model_config
    from models.config import expert_params
    assert dense - split == m.moe_layers * m.experts * expert_params(m) / 2


@pytest.mark.parametrize("fields,needle", [
    (dict(tp=2, dp=2, ep=2), "tp > 1 with a mixture-of-experts model is not supported yet; use tp = 1"),
    (dict(cp=2, dp=2, ep=2), "cp > 1 with a mixture-of-experts model is not supported yet; use cp = 1"),
])
def test_what_native_moe_does_not_combine_is_refused_with_the_fix(fields, needle):
    assert needle in unsupported_reason(RunConfig.unchecked(model="tiny-moe", backend="native", **fields))
