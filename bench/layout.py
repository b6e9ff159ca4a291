"""Rank maths for tp × cp × pp × dp: pure integers, no torch.

A rank order names the dimensions fastest first. `tp-pp-dp` (the default) puts the tp ranks of a
stage next to each other, then the stages of a replica, then the replicas: with tp=4, pp=4, dp=4
ranks 0-3 are stage 0 of replica 0, 4-7 its stage 1 and 16-19 stage 0 of replica 1.
`tp-dp-pp` is Megatron's order without context parallel: tp fastest, then data-parallel replicas,
then stages.

Context parallel (cp) sits next to tp, as in Megatron's `tp-cp-ep-dp-pp`: its ring passes K/V every
layer, so it wants the fastest links after tp's. An order that does not name cp places it there, so
`tp-pp-dp` is `tp-cp-pp-dp` and `tp-dp-pp` is `tp-cp-dp-pp` (the names the ecosystem writes), and
every layout of cp = 1 keeps its ranks.

    rank = tp + TP · (cp + CP · (pp + PP · dp))        order tp-pp-dp  (= tp-cp-pp-dp)
    rank = tp + TP · (cp + CP · (dp + DP · pp))        order tp-dp-pp  (= tp-cp-dp-pp)

Expert parallel (ep) does not multiply the world: as in Megatron, the expert ranks are carved from the
dp × cp ranks of one (tp, pp) coordinate. Those ranks, sorted (cp fastest, then dp), have the data index
d = cp + CP · dp; consecutive blocks of ep of them form an ep group (they split the experts), and the
ranks with the same place in their block form an expert-data-parallel group, edp, of dp · cp / ep ranks
(they hold the same experts, so their expert gradients are averaged together):

    ep rank = d mod ep      edp rank = d div ep      (ep divides dp · cp)

With dp = 4, cp = 1, ep = 2 (order tp-pp-dp, tp = pp = 1) the ep groups are {0, 1} and {2, 3}, the edp
groups {0, 2} and {1, 3}; ep rank j holds experts [j · E/ep, (j + 1) · E/ep).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import lcm
from typing import NamedTuple

ORDERS = ("tp-pp-dp", "tp-dp-pp", "tp-cp-pp-dp", "tp-cp-dp-pp")
DIMS = ("tp", "cp", "pp", "dp")
EXPERT_DIMS = ("ep", "edp")
"""Groups carved from the dp × cp ranks, not dimensions of the world: expert parallel and expert data parallel."""


def named_dims(cp: int, ep: int = 1) -> tuple[str, ...]:
    """The dimensions a label or a table names: cp and ep only where they are used, so everything of
    cp = 1 and ep = 1 reads as it did before they existed."""
    return (*(DIMS if cp > 1 else ("tp", "pp", "dp")), *(("ep",) if ep > 1 else ()))


def layout_product(cfg, dims=DIMS) -> str:
    """'tp (2) × pp (2) × dp (2)' of those `dims` a config (or a Layout) has, cp named only when it is used."""
    return " × ".join(f"{d} ({getattr(cfg, d)})" for d in named_dims(cfg.cp) if d in dims)


def ep_split_reason(dp: int, cp: int, ep: int) -> str | None:
    """Why `ep` cannot be carved from the dp × cp ranks, or None."""
    if (dp * cp) % ep == 0:
        return None
    data = f"dp × cp = {dp} × {cp} = {dp * cp}" if cp > 1 else f"dp ({dp})"
    return (f"ep ({ep}) must divide {data}: expert-parallel ranks are carved from the data-parallel ranks; "
            f"pick ep from the divisors of {dp * cp}")


def experts_held(ep_rank: int, ep: int, experts: int) -> range:
    """The experts ep rank `ep_rank` holds: [ep_rank · E/ep, (ep_rank + 1) · E/ep)."""
    per_rank = experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def zigzag_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of the sequence's 2·cp equal chunks that rank `cp_rank` of a cp group holds: r and
    2·cp − 1 − r, so that every rank does the same causal attention work (Megatron's, Llama 3's)."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} outside a cp group of {cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def seq_split_reason(seq: int, cp: int) -> str | None:
    """Why `seq` tokens do not split into the 2·cp equal zig-zag chunks, or None."""
    if seq % (2 * cp) == 0:
        return None
    return (f"cp ({cp}) needs seq ({seq}) divisible by 2 × cp = {2 * cp} "
            "(each rank holds two equal chunks, zig-zag); pick seq or cp to fit")


def zigzag_tokens(cp_rank: int, cp: int, seq: int) -> tuple[range, range]:
    """The token positions of those two chunks in a sequence of `seq` tokens (seq divisible by 2·cp)."""
    if reason := seq_split_reason(seq, cp):
        raise ValueError(reason)
    size = seq // (2 * cp)
    first, second = zigzag_chunks(cp_rank, cp)
    return range(first * size, (first + 1) * size), range(second * size, (second + 1) * size)


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-pp-dp"
    cp: int = 1
    gpus_per_node: int = 8
    ep: int = 1
    """Expert-parallel size: divides dp × cp, not part of the world size."""

    def __post_init__(self):
        for dim in (*DIMS, "gpus_per_node", "ep"):
            value = getattr(self, dim)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{dim} must be a positive integer, got {value!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order is {self.order!r}; choose one of {', '.join(ORDERS)}")
        if reason := ep_split_reason(self.dp, self.cp, self.ep):
            raise ValueError(reason)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def _dims(self) -> tuple[str, ...]:
        dims = self.order.split("-")  # fastest first
        return tuple(dims if "cp" in dims else [dims[0], "cp", *dims[1:]])

    def coords(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out = {}
        for dim in self._dims:
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return Coord(**out)

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        coord = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        r = 0
        for dim in reversed(self._dims):
            if not 0 <= coord[dim] < getattr(self, dim):
                raise ValueError(f"{dim} coordinate {coord[dim]} is outside 0..{getattr(self, dim) - 1}")
            r = r * getattr(self, dim) + coord[dim]
        return r

    @cached_property
    def _all_coords(self) -> tuple[Coord, ...]:
        return tuple(self.coords(r) for r in range(self.world_size))

    def groups(self, *dims: str) -> list[list[int]]:
        """Rank lists of every group over `dims` (ranks that differ only in those coordinates), sorted:
        `groups("tp")`, or `groups("dp", "cp")`, the ranks a gradient is reduced over under context parallel;
        `groups("ep")` and `groups("edp")`, the expert groups (alone: they are carved from dp × cp)."""
        if any(dim in EXPERT_DIMS for dim in dims):
            if len(dims) != 1:
                raise ValueError(f"dims {dims}: an expert group ({' or '.join(EXPERT_DIMS)}) is asked for alone")
            return sorted(g for data in self.groups("dp", "cp") for g in self._split_data_group(data, dims[0]))
        for dim in dims:
            if dim not in DIMS:
                raise ValueError(f"dim is {dim!r}; choose one of {', '.join(DIMS)}")
        others = [d for d in DIMS if d not in dims]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(self._all_coords):
            buckets.setdefault(tuple(getattr(c, d) for d in others), []).append(r)
        return sorted(buckets.values())

    def group_of(self, rank: int, dim: str) -> list[int]:
        if dim in EXPERT_DIMS:
            return next(g for g in self._split_data_group(self._data_group(rank), dim) if rank in g)
        stride = self._stride(dim)
        first = rank - getattr(self.coords(rank), dim) * stride
        return [first + i * stride for i in range(getattr(self, dim))]

    def data_index(self, rank: int) -> int:
        """`rank`'s place in its dp × cp group, sorted (cp fastest): cp + CP · dp."""
        c = self.coords(rank)
        return c.cp + self.cp * c.dp

    def ep_rank(self, rank: int) -> int:
        """`rank`'s index in its ep group: which share of the experts it holds (`experts_held`)."""
        return self.data_index(rank) % self.ep

    def edp_rank(self, rank: int) -> int:
        """`rank`'s index in its expert-data-parallel group."""
        return self.data_index(rank) // self.ep

    def _data_group(self, rank: int) -> list[int]:
        """The dp × cp group of `rank`, sorted: in data-index order (cp is faster than dp in every order)."""
        c = self.coords(rank)
        return [self.rank(dp=d, pp=c.pp, tp=c.tp, cp=k) for d in range(self.dp) for k in range(self.cp)]

    def _split_data_group(self, data: list[int], dim: str) -> list[list[int]]:
        """A sorted dp × cp group cut into its ep groups (consecutive blocks of ep) or its edp groups (the
        ranks at the same place of every block)."""
        blocks = [data[i:i + self.ep] for i in range(0, len(data), self.ep)]
        return blocks if dim == "ep" else [list(ranks) for ranks in zip(*blocks)]

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def crosses_node(self, group: list[int]) -> bool:
        return len({self.node(r) for r in group}) > 1

    def crossing_groups(self, dim: str) -> list[list[int]]:
        return [g for g in self.groups(dim) if self.crosses_node(g)]

    def size(self, dim: str) -> int:
        """How many ranks a `dim` group has (edp: dp · cp / ep)."""
        return self.dp * self.cp // self.ep if dim == "edp" else getattr(self, dim)

    def any_group_crosses_node(self, dim: str) -> bool:
        """Whether some `dim` group spans nodes, without listing the groups (the planner asks for layouts
        of 16,384 ranks): group starts and nodes repeat every lcm(stride · size, gpus_per_node) ranks, so
        only that span is checked. The expert groups are walked one (tp, pp) coordinate at a time, each
        group's ranks ascending: it crosses when its first and last ranks do."""
        size = self.size(dim)
        if size == 1:
            return False
        if dim in EXPERT_DIMS:
            return any(self.node(g[0]) != self.node(g[-1]) for tp in range(self.tp) for pp in range(self.pp)
                       for g in self._split_data_group(self._data_group(self.rank(pp=pp, tp=tp)), dim))
        stride = self._stride(dim)
        period = min(self.world_size, lcm(stride * size, self.gpus_per_node))
        return any((base // stride) % size == 0 and self.node(base) != self.node(base + (size - 1) * stride)
                   for base in range(period))

    def _stride(self, dim: str) -> int:
        """Rank distance between neighbours of a `dim` group: the sizes of the faster dimensions."""
        stride = 1
        for d in self._dims[:self._dims.index(dim)]:
            stride *= getattr(self, d)
        return stride
