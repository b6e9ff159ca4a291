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
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

ORDERS = ("tp-pp-dp", "tp-dp-pp", "tp-cp-pp-dp", "tp-cp-dp-pp")
DIMS = ("tp", "cp", "pp", "dp")


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

    def __post_init__(self):
        for dim in (*DIMS, "gpus_per_node"):
            value = getattr(self, dim)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{dim} must be a positive integer, got {value!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order is {self.order!r}; choose one of {', '.join(ORDERS)}")

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
        `groups("tp")`, or `groups("dp", "cp")`, the ranks a gradient is reduced over under context parallel."""
        for dim in dims:
            if dim not in DIMS:
                raise ValueError(f"dim is {dim!r}; choose one of {', '.join(DIMS)}")
        others = [d for d in DIMS if d not in dims]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(self._all_coords):
            buckets.setdefault(tuple(getattr(c, d) for d in others), []).append(r)
        return sorted(buckets.values())

    def group_of(self, rank: int, dim: str) -> list[int]:
        c = self.coords(rank)._asdict()
        return [self.rank(**{**c, dim: i}) for i in range(getattr(self, dim))]

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def crosses_node(self, group: list[int]) -> bool:
        return len({self.node(r) for r in group}) > 1

    def crossing_groups(self, dim: str) -> list[list[int]]:
        return [g for g in self.groups(dim) if self.crosses_node(g)]
