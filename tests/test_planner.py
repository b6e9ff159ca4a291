"""The planner's shortcuts give the answers of the uncached, unpruned cost model: each memo is keyed
on every field its part reads (a part reading a field its key misses fails here), the bubble bound
that prunes before simulating never exceeds the simulated bubble, and the ranking equals timing every
fitting candidate."""
from collections import Counter

import pytest

from bench.analysis.estimate import extreme_stages, memory, predict_time
from bench.analysis.hardware import get_hardware
from bench.analysis.memory import (_fsdp_gathered, _zero3_gather_bytes, _zero3_reduction_bytes, _zero12_reduction_bytes,
                                   model_state, precision)
from bench.analysis.planner import (_PointCosts, _rank_key, _step_floor, _tp_floor, _Validator,
                                    _valid_shapes, bubble_floor, plan, points)
from bench.analysis.stage_plan import stage_plan
from bench.schedule import SCHEDULES, schedule_step
from models import PRESETS

PLANS = [("tiny", 8, 16, "any"), ("gpt2-124m", 24, 48, "suite"), ("llama2-7b", 32, 64, "any"),
         ("tiny-moe", 8, 16, "suite")]  # experts: ep searched, the native engine's MoE refusals cached


def candidates(model: str, gpus: int, batch: int, engines: str, per_node: int = 4):
    """Every distinct valid candidate the planner costs, point by point (4 GPUs a node: FSDP hybrid's
    shard and the rank orders vary)."""
    validate = _Validator(engines)
    for point, orders, skip in points(model, gpus, batch, PRESETS[model].seq_len, "bf16-mixed", per_node):
        if not skip:
            yield point, list(_valid_shapes(point, orders, validate, Counter()))


@pytest.mark.parametrize("model,gpus,batch,engines", PLANS)
def test_point_costs_agree_with_the_uncached_plan_and_memory(model, gpus, batch, engines):
    n = 0
    for _, shapes in candidates(model, gpus, batch, engines):
        costs = _PointCosts(4, "autocast", "suite", "flash")
        for shape in shapes:
            stages = costs.plan(shape)
            assert stages == stage_plan(shape, 4, extreme_stages(shape.pp)), shape
            assert costs.memory(stages) == memory(stages, "autocast", "suite", "flash"), shape
            n += 1
    assert n > 300


STATE_PARTS = (model_state, _fsdp_gathered, _zero3_gather_bytes, _zero3_reduction_bytes, _zero12_reduction_bytes)


@pytest.mark.parametrize("model,gpus,batch,engines", PLANS)
def test_state_parts_agree_with_the_uncached_parts(model, gpus, batch, engines):
    """Candidates are visited in the planner's order, so most lookups hit an entry another candidate made."""
    n = 0
    for _, shapes in candidates(model, gpus, batch, engines):
        for shape in shapes:
            stages = stage_plan(shape, 4, extreme_stages(shape.pp))
            for mixed_state in ("zero", "autocast"):
                prec = precision(shape.dtype, mixed_state)
                for stage in stages.ranks:
                    for part in STATE_PARTS:
                        assert part(stages, stage, prec) == part.__wrapped__(stages, stage, prec), (part, shape)
                    n += 1
    assert n > 1000


def test_moe_plans_search_ep_and_dense_plans_do_not():
    """ep: every divisor of dp·cp that divides the experts (tiny-moe: 4), for a mixture of experts only."""
    def eps(model):
        return {(p.dp * p.cp, p.ep) for p, _, skip in points(model, 8, 16, 32, "bf16-mixed", 4) if not skip}
    assert eps("tiny") == {(n, 1) for n in (1, 2, 4, 8)}
    assert eps("tiny-moe") == {(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)}
    validate = _Validator("suite")  # the native engine runs ep: its candidates pass and are costed
    valid = {s.ep for p, orders, skip in points("tiny-moe", 8, 16, 32, "bf16-mixed", 4) if not skip
             for s in _valid_shapes(p, orders, validate, Counter())}
    assert valid == {1, 2, 4}


def test_bubble_floor_is_below_the_simulated_bubble():
    """(p − 1)/(m·v) never exceeds the simulator's idle / busy, with or without its extrapolation beyond
    3p micro-batches, and equals it for GPipe and 1F1B."""
    class Plan:  # what bubble_floor reads of a StagePlan
        def __init__(self, name, m, p, v):
            self.schedule, self.cfg = name, type("Cfg", (), {"pp": p, "micro_batches": m, "virtual_stages": v})

    n = 0
    for name in SCHEDULES:
        for p in range(1, 9):
            for v in ((1, 2, 3, 4) if name == "interleaved" else (1,)):
                for m in range(1, 4 * p + 3):
                    if name == "interleaved" and m % p:
                        continue
                    for fill in (True, False):
                        simulated = schedule_step(name, m, p, v if p > 1 else 1, fill).bubble_over_ideal
                        floor = bubble_floor(Plan(name, m, p, v))
                        assert floor <= simulated + 1e-12, (name, m, p, v, fill)
                        if name != "interleaved":
                            assert floor == pytest.approx(simulated, abs=1e-12), (name, m, p, fill)
                        n += 1
    assert n > 500


@pytest.mark.parametrize("model,gpus,batch,engines,top", [("gpt2-124m", 8, 16, "any", 12),
                                                          ("llama2-7b", 16, 32, "suite", 8)])
def test_ranking_equals_timing_every_fitting_candidate(model, gpus, batch, engines, top):
    hw = get_hardware("h100-sxm")
    seq = PRESETS[model].seq_len
    result = plan(model, gpus, 8, hw, batch, seq, top=top, engines=engines)
    limit, ranked = hw.memory_bytes * 0.9, []
    validate, i = _Validator(engines), 0
    for point, orders, skip in points(model, gpus, batch, seq, "bf16-mixed", 8):
        for shape in [] if skip else _valid_shapes(point, orders, validate, Counter()):
            stages = stage_plan(shape, 8, extreme_stages(shape.pp))
            mem = memory(stages)  # the planner's defaults: the rows' conventions (estimate.conventions)
            if mem["total_bytes"] <= limit:
                ranked.append((_rank_key(predict_time(stages, hw)["tokens_per_s"], mem, i), shape))
                i += 1
    assert len(ranked) == result.fitting > top
    best = [shape for _, shape in sorted(ranked, key=lambda r: r[0])[:top]]
    assert [(c["tp"], c["pp"], c["backend"], c["zero"], c["fsdp"], c["schedule"], c["virtual_stages"],
             c["micro_batch"], c["sequence_parallel"], c["recompute"], c["order"]) for c in result.configs] == [
        (s.tp, s.pp, s.backend, s.zero, s.fsdp, s.schedule, s.virtual_stages, s.micro_batch, s.sequence_parallel,
         s.recompute, s.order) for s in best]


@pytest.mark.parametrize("model,gpus,batch,engines,hardware,mixed_state", [
    ("gpt2-124m", 16, 32, "any", "h100-sxm", "zero"), ("llama2-7b", 32, 64, "suite", "a100-80gb", "autocast"),
    ("tiny", 8, 16, "any", "cpu", "zero")])
def test_step_floors_are_below_the_step_time(model, gpus, batch, engines, hardware, mixed_state):
    """Both bounds the ranking prunes with, the compute one and the one with the tp collectives, for every
    candidate (fitting or not), under either time-model implementation and attention kernel given to both."""
    hw, n = get_hardware(hardware), 0
    for _, shapes in candidates(model, gpus, batch, engines, per_node=8):
        for shape in shapes:
            stages = stage_plan(shape, 8, extreme_stages(shape.pp))
            for impl, attention in (("table2", "flash"), ("table2", "unfused"), ("suite", "flash"), ("suite", "unfused")):
                step = predict_time(stages, hw, mixed_state, impl, attention)["step_time_s"]
                with_tp = _step_floor(stages, hw, impl, attention, _tp_floor(stages, hw, mixed_state))
                assert _step_floor(stages, hw, impl, attention) <= with_tp <= step, (impl, attention, shape)
                # no convention (the CLI's default): the bound under the one predict_time resolves
                own = predict_time(stages, hw, None, impl, attention)["step_time_s"]
                assert _step_floor(stages, hw, impl, attention, _tp_floor(stages, hw, None)) <= own, (impl, shape)
            n += 1
    assert n > 300
