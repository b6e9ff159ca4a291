"""Expert parallel as a layout dimension: the ep and edp groups carved from dp × cp (pure rank maths), the
config's checks and run ids, the backends' declared support, `bench layout`, and real gloo ProcessGroups whose
ep traffic the comm counter names by group identity (the ep group's ranks can be the dp or cp group's)."""
import itertools

import pytest

from bench.analysis.explain import explain, format_text
from bench.capabilities import CAPABILITIES, unsupported_reason
from bench.config import ConfigError, RunConfig, structural_reason
from bench.layout import Layout, experts_held
from bench.report.labels import layout as layout_label
from bench.sweep.spec import expand, parse_sweep

MOE = ("experts=4",)


# --- rank maths (pure) ----------------------------------------------------------------------------------
LAYOUTS = [Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, order=order, gpus_per_node=4)
           for order in ("tp-pp-dp", "tp-dp-pp") for tp, cp, pp, dp in ((1, 1, 1, 4), (2, 2, 2, 2), (2, 1, 2, 4), (1, 2, 1, 4))
           for ep in (1, 2, 4) if (dp * cp) % ep == 0]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_ep_and_edp_groups_partition_the_world_inside_the_data_parallel_groups(lay):
    world = list(range(lay.world_size))
    ep, edp = lay.groups("ep"), lay.groups("edp")
    assert sorted(itertools.chain(*ep)) == world and sorted(itertools.chain(*edp)) == world
    assert {len(g) for g in ep} == {lay.ep} and {len(g) for g in edp} == {lay.dp * lay.cp // lay.ep}
    data = lay.groups("dp", "cp")
    for rank in world:
        mine_ep, mine_edp = lay.group_of(rank, "ep"), lay.group_of(rank, "edp")
        assert mine_ep in ep and mine_edp in edp and set(mine_ep) & set(mine_edp) == {rank}
        assert any(set(mine_ep) | set(mine_edp) <= set(g) for g in data)  # carved from one dp × cp group
        c = lay.coords(rank)
        index = c.cp + lay.cp * c.dp  # the docstring's data index: cp fastest, then dp
        assert lay.ep_rank(rank) == index % lay.ep == mine_ep.index(rank)
        assert lay.edp_rank(rank) == index // lay.ep == mine_edp.index(rank)
    for g in edp:  # the ranks that hold the same experts: one ep rank each
        assert len({lay.ep_rank(r) for r in g}) == 1


def test_the_docstring_examples_and_ep_one():
    lay = Layout(dp=4, ep=2)
    assert lay.groups("ep") == [[0, 1], [2, 3]] and lay.groups("edp") == [[0, 2], [1, 3]]
    assert [lay.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(experts_held(1, 2, 8)) == [4, 5, 6, 7]
    # tp 2 · cp 2 · dp 2, tp-dp-pp: the cp groups {0, 2}, {1, 3} are the first ep groups, dp stride 4 the edp
    lay = Layout(tp=2, cp=2, dp=2, pp=2, ep=2, order="tp-dp-pp")
    assert lay.groups("ep")[:2] == lay.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert lay.group_of(0, "edp") == [0, 4]
    one = Layout(tp=2, cp=2, dp=2)
    assert one.groups("ep") == [[r] for r in range(8)] and one.groups("edp") == one.groups("dp", "cp")


def test_ep_must_divide_dp_times_cp_and_stands_alone():
    with pytest.raises(ValueError, match=r"ep \(4\) must divide dp × cp = 3 × 1|ep \(4\) must divide dp \(3\)"):
        Layout(dp=3, ep=4)
    with pytest.raises(ValueError, match=r"ep \(3\) must divide dp × cp = 2 × 2 = 4"):
        Layout(dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        Layout(ep=0)
    with pytest.raises(ValueError, match="alone"):
        Layout(dp=2, ep=2).groups("ep", "tp")


@pytest.mark.parametrize("lay", [Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, order=order, gpus_per_node=g)
                                 for tp, pp, dp, cp, ep in ((1, 8, 2, 1, 2), (2, 2, 4, 1, 4), (1, 1, 16, 1, 8),
                                                            (2, 1, 4, 2, 8), (4, 2, 2, 1, 2))
                                 for order in ("tp-pp-dp", "tp-dp-pp") for g in (2, 4, 8)], ids=str)
def test_crossing_nodes_agrees_with_the_groups(lay):
    for dim in ("ep", "edp"):
        assert lay.any_group_crosses_node(dim) == bool(lay.crossing_groups(dim))


# --- the config -----------------------------------------------------------------------------------------
def test_run_ids_of_ep_one_are_those_of_before():
    """Ids printed by the commit before ep existed: ep = 1 (the default) is left out of the canonical form."""
    assert RunConfig().run_id == RunConfig(ep=1).run_id == "4da68669aa95"
    assert RunConfig(dp=2, cp=2, seq=32).run_id == RunConfig(dp=2, cp=2, seq=32, ep=1).run_id
    assert "ep" not in RunConfig(dp=2).canonical()
    assert RunConfig.unchecked(dp=2, ep=2).canonical()["ep"] == 2
    assert RunConfig.unchecked(dp=2, ep=2).layout.ep == 2


@pytest.mark.parametrize("kw, match", [
    (dict(dp=2, ep=2), r"^ep \(2\) > 1 needs a mixture-of-experts model, but model tiny is dense"),
    (dict(dp=4, ep=3), r"^ep \(3\) must divide dp \(4\)"),
    (dict(dp=2, cp=2, ep=3), r"^ep \(3\) must divide dp × cp = 2 × 2 = 4"),
    (dict(ep=0), r"^ep must be a positive integer, got 0"),
])
def test_bad_ep_is_one_line_naming_the_field(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        RunConfig(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(dp=4, ep=4, model_overrides=("experts=6",)), r"^model experts \(6\) is not divisible by ep \(4\)"),
    (dict(dp=2, cp=2, model_overrides=(*MOE, "moe_capacity_factor=1.25")),
     r"^model moe_capacity_factor with cp \(2\) > 1 is not supported"),
])
def test_moe_layout_misfits_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kw)


def test_every_backend_declares_whether_it_runs_expert_parallel():
    for backend, caps in CAPABILITIES.items():
        cfg = RunConfig.unchecked(backend=backend, dp=2, ep=2, model_overrides=MOE)
        assert structural_reason(cfg) is None
        reason = unsupported_reason(cfg)
        if caps.ep_implemented:
            assert reason is None, reason
        elif caps.ep:
            assert reason == f"expert parallel is not implemented on backend {backend} yet: needs ep = 1, got ep=2"
        else:
            assert reason.startswith(f"backend {backend} has no expert parallel"), reason
        assert unsupported_reason(RunConfig.unchecked(backend=backend, dp=2)) is None  # dense at ep 1: as before
    assert [b for b, c in CAPABILITIES.items() if c.ep] == ["native", "deepspeed", "fsdp"]
    assert [b for b, c in CAPABILITIES.items() if c.ep_implemented] == ["native"]  # tests/test_ep_parity.py


def test_a_sweep_axis_of_ep_makes_skipped_rows():
    exp = expand(parse_sweep({"world_size": 4, "base": {"dp": 4}, "grid": {"ep": [1, 2, 3]}}, "ep.yaml"))
    assert [c.ep for c in exp.runs] == [1]
    reasons = sorted(r["error"] for r in exp.skipped)
    assert [r["status"] for r in exp.skipped] == ["skipped", "skipped"]
    assert reasons[0].startswith("ep (2) > 1 needs a mixture-of-experts model") and reasons[1].startswith("ep (3) must divide")
    assert len({r["run_id"] for r in exp.skipped}) == 2


# --- what reads it: labels, bench layout ------------------------------------------------------------------
def test_labels_name_ep_only_where_it_is_used():
    row = {"tp": 1, "cp": 1, "pp": 1, "dp": 4}
    assert layout_label(row) == layout_label({**row, "ep": 1}) == "tp1·pp1·dp4"
    assert layout_label({**row, "ep": 2}) == "tp1·pp1·dp4·ep2"


def test_layout_view_shows_ep_ranks_groups_and_crossings():
    info = explain(Layout(dp=2, pp=8, ep=2, gpus_per_node=8))  # dp stride 8: every ep group spans two nodes
    assert info["ep"] == 2 and info["groups"]["ep"] == [[r, r + 8] for r in range(8)]
    assert [r["ep_rank"] for r in info["ranks"]][:9] == [0] * 8 + [1]
    assert {l["link"] for l in info["links"] if l["dim"] == "ep"} == {"network"}
    assert any("ep groups span nodes" in w for w in info["warnings"])
    text = format_text(info)
    assert "ep groups (8 of 2 GPUs" in text and "ep rank 1" in text and "edp groups (16 of 1 GPUs" in text
    assert "ep" not in explain(Layout(dp=2, pp=8))["groups"]


def test_layout_view_names_the_experts_each_rank_holds():
    info = explain(Layout(dp=4, ep=4), cfg=RunConfig.unchecked(dp=4, ep=4, model_overrides=MOE))
    assert [r["experts"] for r in info["ranks"]] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert "ep rank 2 (experts 2-2)" in format_text(info)


# --- real gloo groups at world 4 and 8 --------------------------------------------------------------------
GLOO_LAYOUTS = {4: [Layout(dp=4, ep=2), Layout(tp=2, dp=2, ep=2), Layout(cp=2, dp=2, ep=2), Layout(dp=4)],
                8: [Layout(tp=2, dp=4, ep=4), Layout(tp=2, cp=2, dp=2, ep=2, order="tp-dp-pp"),
                    Layout(pp=2, dp=4, ep=2), Layout(dp=4, cp=2, ep=8)]}
ROWS = 3  # the rows each rank sends every ep peer in the counted all-to-all


def _groups_on_rank(layouts: list) -> list[dict]:
    """Per layout: this rank's groups as built, the groups made, and what the counter named the ep all-to-alls
    (one c10d, one functional), an edp all-reduce and a dp all-reduce."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _world
    from bench.distributed import ProcessGroups, rank_session
    from bench.metrics.comm import CommCounter
    torch.set_num_threads(1)
    out = []
    with rank_session("cpu"):
        for lay in layouts:
            made = _world.group_count
            groups = ProcessGroups.build(lay)
            made = _world.group_count - made
            with CommCounter.for_groups(groups) as counter:
                if groups.ep is not None:
                    rows = torch.ones(lay.ep * ROWS, 8)
                    dist.all_to_all_single(torch.empty_like(rows), rows, group=groups.ep)
                    funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, groups.ep))
                dist.all_reduce(torch.ones(5), group=groups.edp)
                dist.all_reduce(torch.ones(7), group=groups.dp)
            out.append({"ranks": groups.ranks, "made": made, "ep_is_none": groups.ep is None,
                        "ep_ranks": dist.get_process_group_ranks(groups.ep) if groups.ep is not None else None,
                        "edp_is_dp_cp": groups.edp is groups.dp_cp, "totals": counter.totals(),
                        "dim_of_ep": groups.dim_of(groups.ranks["ep"])})
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_process_groups_build_ep_and_edp_and_the_counter_names_them(pools, world):
    results = pools(world).call(_groups_on_rank, GLOO_LAYOUTS[world])
    for i, lay in enumerate(GLOO_LAYOUTS[world]):
        before = sum(len(lay.groups(d)) for d in ("tp", "cp", "pp", "dp")) + (len(lay.groups("dp", "cp")) if lay.cp > 1 else 0)
        for rank, res in enumerate(r[i] for r in results):
            t = res["totals"]
            assert res["ranks"]["ep"] == lay.group_of(rank, "ep") and res["ranks"]["edp"] == lay.group_of(rank, "edp")
            if lay.ep == 1:  # the groups of before, no more: no ep group, edp is dp × cp
                assert res["made"] == before and res["ep_is_none"] and res["edp_is_dp_cp"]
                assert t.get("comm_ops_ep", 0) == 0
                continue
            assert res["made"] == before + len(lay.groups("ep")) + len(lay.groups("edp"))
            assert res["ep_ranks"] == lay.group_of(rank, "ep")
            # identity wins over ranks: ep's ranks equal dp's (dp=ep, cp=1) or cp's (cp=ep) in some layouts
            assert t["comm_ep_all_to_all_ops"] == 2 and t["comm_ops_ep"] == 2
            assert t["comm_ep_all_to_all_bytes"] == 2 * lay.ep * ROWS * 8 * 4
            assert t.get("comm_cp_all_to_all_ops", 0) == 0 and t.get("comm_dp_all_to_all_ops", 0) == 0
            assert t["comm_dp_all_reduce_ops"] == 2 and t["comm_dp_all_reduce_bytes"] == (5 + 7) * 4  # edp is dp's
            shadowed = lay.group_of(rank, "ep") in [*(lay.group_of(rank, d) for d in ("tp", "cp", "pp", "dp")),
                                                    lay.groups("dp", "cp")[0], list(range(world))]
            if not shadowed:  # by ranks alone, ep is named where no other group has its ranks
                assert res["dim_of_ep"] == "ep"
    shadowing = [lay for lay in GLOO_LAYOUTS[world] if lay.ep > 1 and lay.groups("ep")[0] in
                 [*lay.groups("dp"), *lay.groups("cp"), *lay.groups("dp", "cp")]]
    assert shadowing  # every world checks a layout whose ep group has another group's ranks
