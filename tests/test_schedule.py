"""The schedule module (pure): partition, chunk placement, the action lists, the simulator, and the
paper formulas the simulator must reproduce; the cost model reads the executor's action lists."""
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction

import pytest

from bench.analysis.comm import stage_traffic
from bench.analysis.estimate import estimate
from bench.analysis.memory import stage_memory
from bench.analysis.stage_plan import stage_plan
from bench.config import RunConfig
from bench.schedule import (Deadlock, chunk_rank, interleaved, partition, peak_held, rank_chunks, schedule,
                            schedule_step, simulate, simulate_schedule)

COSTS = [(1, 2), (1, 1), (2, 3)]  # (forward, backward) per action


def _orders(name, m, p, v=1, fill=True):
    return [schedule(name, m, p, r, v, fill) for r in range(p)]


def _exact_fraction(st) -> Fraction:
    return Fraction(st.idle) / Fraction(st.ranks * st.makespan)


# --- where the layers live -------------------------------------------------------------------------
def test_partition_is_contiguous_and_balanced():
    assert partition(4, 2) == [[0, 1], [2, 3]]
    assert partition(5, 2) == [[0, 1, 2], [3, 4]]
    assert partition(5, 3) == [[0, 1], [2, 3], [4]]
    assert [len(p) for p in partition(10, 4)] == [3, 3, 2, 2]
    parts = partition(10, 4)
    assert sum(parts, []) == list(range(10)) and max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("p,v", [(1, 1), (2, 1), (2, 2), (4, 3), (8, 5)])
def test_every_chunk_lives_on_one_rank(p, v):
    held = [c for r in range(p) for c in rank_chunks(r, p, v)]
    assert sorted(held) == list(range(p * v))
    assert all(chunk_rank(c, p) == r for r in range(p) for c in rank_chunks(r, p, v))


# --- the action lists played against each other ----------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 4), (4, 1), (4, 4), (4, 8), (4, 16)])
def test_schedules_complete_without_deadlock(p, m):
    for name in ("gpipe", "1f1b"):
        orders = _orders(name, m, p)
        for order in orders:
            assert sorted(order) == sorted([("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)])
        sim = simulate(orders)
        # in flight: GPipe all m; 1F1B min(p − r, m) on rank r (PTD-P §2.2)
        assert sim.peak_in_flight == [m if name == "gpipe" else min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,v,m", [(2, 1, 2), (4, 1, 8), (2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 4, 8)])
def test_interleaved_schedule_completes(p, v, m):
    for fill in (True, False):
        orders = _orders("interleaved", m, p, v, fill)
        for order in orders:
            assert sorted(order) == sorted([(k, c, i) for k in "FB" for c in range(v) for i in range(m)])
        simulate(orders, v)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_in_flight_is_megatrons_warm_up_plus_one(p, v):
    # Megatron-LM's interleaved warm-up: (p − r − 1)·2 + (v − 1)·p forwards, then one in steady state
    for m in (2 * p, 3 * p, 5 * p):
        got = simulate_schedule("interleaved", m, p, v).peak_in_flight
        assert got == [min(m * v, (p - r - 1) * 2 + (v - 1) * p + 1) for r in range(p)]


def test_timelines_run_one_action_at_a_time_after_their_input():
    sim = simulate(_orders("interleaved", 4, 2, 2), 2, 1, 2)
    ends = {}
    for r, line in enumerate(sim.timelines):
        for (s0, e0, _), (s1, _, _) in zip(line, line[1:]):
            assert e0 <= s1
        for start, end, (kind, chunk, mb) in line:
            assert end - start == (1 if kind == "F" else 2)
            ends[kind, chunk * 2 + r, mb] = end
    for (kind, sid, mb), end in ends.items():
        src = ("F", sid - 1, mb) if kind == "F" else ("B", sid + 1, mb) if sid < 3 else ("F", sid, mb)
        if kind == "B" or sid > 0:
            assert ends[src] <= end - (1 if kind == "F" else 2)
    assert sim.step.makespan == max(line[-1][1] for line in sim.timelines)


def test_orders_that_wait_on_each_other_deadlock():
    # rank 1 (the last stage) waits for a forward that rank 0 only sends after rank 1's backward
    orders = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(Deadlock):
        simulate(orders)


def test_peak_held_weights_chunks():
    order = [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 0, 0)]
    assert peak_held(order) == 2 and peak_held(order, (3, 5)) == 8 and peak_held(order, (0, 1)) == 1


# --- the paper's closed forms, reproduced by the simulation ----------------------------------------
@pytest.mark.parametrize("forward,backward", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ptdp_bubble_gpipe_and_1f1b(p, forward, backward):
    # PTD-P §2.2: the bubble is (p−1)/(m+p−1) of the step, (p−1)/m of the ideal time
    for name in ("gpipe", "1f1b"):
        for m in range(1, 3 * p + 1):
            st = simulate(_orders(name, m, p), 1, forward, backward).step
            assert _exact_fraction(st) == Fraction(p - 1, m + p - 1), (name, m)
            assert st.bubble_over_ideal == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("forward,backward", COSTS)
@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (4, 2), (4, 4), (8, 3)])
def test_ptdp_bubble_interleaved(p, v, forward, backward):
    # PTD-P §2.2: interleaving v chunks divides the bubble by v: (p−1)/(v·m+p−1); with either warm-up
    for fill in (True, False):
        for m in (p, 2 * p, 3 * p):
            st = simulate(_orders("interleaved", m, p, v, fill), v, forward, backward).step
            assert _exact_fraction(st) == Fraction(p - 1, v * m + p - 1), (fill, m)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_step_reuses_the_steady_state_exactly(name, v, p):
    """`step` simulates large m at 2p and 3p micro-batches: it must equal the full simulation."""
    for fill in (True, False):
        for m in range(1, 8 * p + 1):
            if name == "interleaved" and m % p:
                continue
            assert schedule_step(name, m, p, v, fill) == simulate_schedule(name, m, p, v, fill).step, (m, fill)


def test_schedule_module_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import bench.schedule"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the cost model reads the same action lists ----------------------------------------------------
def test_cost_model_in_flight_equals_the_executors_when_m_is_p():
    # p = 4, v = 2, m = 4: the executor runs every forward first (Megatron-LM's m == p case), so every
    # rank peaks at all 8 chunk-micro-batches; the cost model now says so (it said [8, 8, 7, 5]).
    cfg = RunConfig(model="tiny", model_overrides=("layers=8",), pp=4, schedule="interleaved", virtual_stages=2,
                    micro_batches=4)
    executor = [peak_held(interleaved(4, 4, r, 2)) for r in range(4)]
    plan = stage_plan(cfg)
    assert executor == [8, 8, 8, 8]
    assert [plan.ranks[r].in_flight for r in range(4)] == executor
    assert [plan.ranks[r].layers_in_flight for r in range(4)] == [8, 8, 8, 8]  # 1 layer per chunk
    assert plan.ranks[3].head_in_flight == 4  # the last chunk holds every micro-batch's logits
    # torch.distributed.pipelining keeps the warm-up rule: the FSDP backend's pipeline holds fewer
    fsdp = stage_plan(replace(cfg, backend="fsdp"))
    assert [fsdp.ranks[r].in_flight for r in range(4)] == [8, 8, 7, 5]


def test_cost_model_bubble_is_the_simulated_one():
    shape = RunConfig.unchecked(model="llama2-70b", tp=8, pp=8, dp=4, micro_batch=1, micro_batches=64, seq=4096,
                                dtype="bf16-mixed", schedule="interleaved", virtual_stages=5)
    est = estimate(shape, "h100-sxm", 8)
    assert est["bubble_fraction"] == schedule_step("interleaved", 64, 8, 5).bubble_fraction == 7 / (5 * 64 + 7)
    # the simulated idle/busy ratio times the busiest rank's busy time (bench.analysis.time_model); this
    # config has no once-per-step tp or pp collective, so all of comm_tp_s and comm_pp_s is per micro-batch
    busy = est["compute_s"] + est["overhead_s"] + est["comm_tp_s"] + est["comm_pp_s"]
    assert est["bubble_s"] == pytest.approx(busy * 7 / (5 * 64))


def test_fsdp_hybrid_memory_and_comm_share_one_shard():
    # 2 GPUs per node: HSDP shards over the 2 dp ranks of a node, memory and traffic alike
    cfg = RunConfig.unchecked(model="tiny", dp=8, backend="fsdp", fsdp="hybrid", micro_batch=1, dtype="bf16-mixed")
    plan = stage_plan(cfg, gpus_per_node=2)
    assert plan.shard == 2
    sharded = sum(n for _, n in plan.fsdp_groups(0, 2)) / 2
    assert stage_memory(plan, 0)["params_bytes"] == sharded * 2  # bf16 under the zero convention
    groups = {tr.what: tr.group for tr in stage_traffic(plan, 0) if tr.dim == "dp"}
    assert groups == {"parameters": 2, "gradients": 2, "gradient shards across replicas": 4}
