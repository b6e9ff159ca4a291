"""Pure rank maths: hand-written golden groups, and invariants on layouts up to thousands of ranks."""
import itertools

import pytest

from bench.layout import DIMS, ORDERS, Coord, Layout, named_dims, zigzag_chunks, zigzag_tokens


def test_64_gpu_example_default_order():
    lay = Layout(tp=4, pp=4, dp=4, gpus_per_node=8)
    assert [lay.rank(dp=0, pp=0, tp=t) for t in range(4)] == [0, 1, 2, 3]  # stage 0 of replica 0
    assert [lay.rank(dp=0, pp=1, tp=t) for t in range(4)] == [4, 5, 6, 7]  # its stage 1
    assert [lay.rank(dp=1, pp=0, tp=t) for t in range(4)] == [16, 17, 18, 19]  # stage 0 of replica 1
    assert lay.coords(17) == Coord(dp=1, pp=0, tp=1)
    assert lay.groups("tp")[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert lay.groups("pp")[0] == [0, 4, 8, 12]
    assert lay.groups("dp")[0] == [0, 16, 32, 48]
    assert lay.crossing_groups("tp") == []
    assert len(lay.crossing_groups("pp")) == 16 and len(lay.crossing_groups("dp")) == 16


def test_megatron_order_tp_dp_pp():
    # Megatron's docstring example: 16 GPUs, tp=2, pp=4, dp=2.
    lay = Layout(tp=2, pp=4, dp=2, order="tp-dp-pp")
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_small_layouts_by_hand():
    lay = Layout(tp=2, pp=2, dp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Layout(tp=1, pp=1, dp=4).groups("dp") == [[0, 1, 2, 3]]


def test_tp_crossing_nodes():
    lay = Layout(tp=16, pp=2, dp=2, gpus_per_node=8)
    assert lay.crossing_groups("tp") == lay.groups("tp")
    assert lay.node(15) == 1 and lay.nodes() == 8


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
@pytest.mark.parametrize("tp,pp,dp", [(8, 16, 32), (4, 8, 128), (1, 1, 4096), (8, 1, 512), (2, 3, 5)])
def test_partition_invariants_large(order, tp, pp, dp):
    lay = Layout(tp=tp, pp=pp, dp=dp, order=order)
    for dim in ("tp", "pp", "dp"):
        groups = lay.groups(dim)
        assert len(groups) == lay.world_size // getattr(lay, dim)
        assert sorted(itertools.chain(*groups)) == list(range(lay.world_size))  # a partition
    for r in range(0, lay.world_size, max(1, lay.world_size // 257)):
        c = lay.coords(r)
        assert lay.rank(**c._asdict()) == r
        for dim in ("tp", "pp", "dp"):
            assert r in lay.group_of(r, dim) and len(lay.group_of(r, dim)) == getattr(lay, dim)
    assert all(g == list(range(g[0], g[0] + tp)) for g in lay.groups("tp"))  # tp is always fastest


def test_bad_layout_messages():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="order"):
        Layout(order="dp-tp-pp")
    with pytest.raises(ValueError, match="outside world size"):
        Layout(tp=2).coords(2)


def test_context_parallel_sits_next_to_tp():
    # Megatron's tp-cp-dp-pp: 16 GPUs, tp 2, cp 2, dp 2, pp 2 (the three-name order places cp after tp)
    lay = Layout(tp=2, cp=2, dp=2, pp=2, order="tp-cp-dp-pp")
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lay.groups("pp")[0] == [0, 8]
    assert lay.groups("dp", "cp")[0] == [0, 2, 4, 6]  # the gradient's reduction group
    assert lay.coords(6) == Coord(dp=1, pp=0, tp=0, cp=1)
    assert Layout(tp=2, cp=2, dp=2, pp=2, order="tp-dp-pp").groups("cp") == lay.groups("cp")
    assert Layout(tp=2, cp=2, dp=2, pp=2).groups("pp")[0] == [0, 4]  # tp-pp-dp = tp-cp-pp-dp


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
def test_cp_1_keeps_every_rank(order):
    for named in (order, order.replace("tp-", "tp-cp-")):
        lay, old = Layout(tp=2, pp=3, dp=2, order=named), Layout(tp=2, pp=3, dp=2, order=order)
        assert [lay.coords(r) for r in range(12)] == [old.coords(r) for r in range(12)]
        assert all(len(g) == 1 for g in lay.groups("cp"))
        assert lay.groups("dp", "cp") == lay.groups("dp")


@pytest.mark.parametrize("order", ["tp-cp-pp-dp", "tp-cp-dp-pp"])
def test_partition_invariants_with_cp(order):
    lay = Layout(tp=2, cp=4, pp=3, dp=2, order=order)
    for dims in (("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp")):
        groups = lay.groups(*dims)
        assert sorted(itertools.chain(*groups)) == list(range(48))
        assert all(len(g) == 48 // len(groups) for g in groups)
    for r in range(48):
        assert lay.rank(**lay.coords(r)._asdict()) == r
        assert r in lay.group_of(r, "cp") and len(lay.group_of(r, "cp")) == 4
        for dim in DIMS:
            assert lay.group_of(r, dim) in lay.groups(dim)


def test_zigzag_chunks_balance_the_causal_work():
    for cp in (1, 2, 3, 4, 8):
        held = [zigzag_chunks(r, cp) for r in range(cp)]
        assert sorted(c for pair in held for c in pair) == list(range(2 * cp))  # every chunk once
        assert {a + b for a, b in held} == {2 * cp - 1}  # a causal chunk's work grows with its index
    assert zigzag_chunks(1, 4) == (1, 6)
    assert zigzag_tokens(1, 4, 1024) == (range(128, 256), range(768, 896))
    with pytest.raises(ValueError, match="2 × cp = 6"):
        zigzag_tokens(0, 3, 1000)


def test_any_group_crosses_node_agrees_with_the_groups():
    """The planner's periodic shortcut against the listed groups, every dim, small layouts exhaustively."""
    for tp, cp, pp, dp, g in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (1, 2, 4), (2, 3, 4)):
        for order in ORDERS:
            lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, order=order, gpus_per_node=g)
            for dim in DIMS:
                assert lay.any_group_crosses_node(dim) == bool(lay.crossing_groups(dim)), (lay, dim)


def test_named_dims_name_cp_only_when_used():
    assert named_dims(1) == ("tp", "pp", "dp") and named_dims(2) == DIMS
