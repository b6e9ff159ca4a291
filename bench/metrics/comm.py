"""Communication counter: payload bytes and op counts per op and per parallel dimension.

A TorchDispatchMode sees every c10d op whichever layer issued it: Python `dist.*`, DDP's C++
reducer, FSDP, DTensor functional collectives, pipelining P2P, DeepSpeed. It costs ~50 % step
time, so the worker counts one separate, untimed step.

Payload convention (docs/row-schema.md, the comm columns): all-reduce → input; all-gather → output; reduce-scatter → input;
P2P → sent bytes only (a recv is counted as an op with 0 bytes); broadcast → the tensor.
Wire bytes are what a ring algorithm moves per rank: all-reduce 2(n−1)/n · S,
all-gather and reduce-scatter (n−1)/n · S_full, broadcast and P2P S.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.conventions import wire_bytes  # the one ring rule, shared with the cost model
from bench.results import comm_column, comm_op_column

# c10d op → (kind, index of the tensor argument that carries the payload)
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1), "scatter_": ("scatter", 1),
    "send": ("send", 0), "recv_": ("recv", None), "recv_any_source_": ("recv", None),
}
_FUNCOL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
           "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
           "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


CP_KINDS = ("send", "recv", "all_to_all")
"""What the attention sends over the cp group: the ring's K/V (P2P), Ulysses' heads (all-to-all)."""


def _data_parallel_if_reduction(dim: str, kind: str) -> str:
    """Any other collective on ranks that form a cp group is the gradient's (or FSDP's shards') over
    dp × cp, whose ranks are the cp group's when dp = 1: data-parallel traffic, as the cost model counts it."""
    return "dp" if dim == "cp" and kind not in CP_KINDS else dim


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


@dataclass
class OpStats:
    ops: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommCounter(TorchDispatchMode):
    """Counts every c10d op issued on this thread while active. `dim_of(ranks)` names a group;
    `group_dims` (group name → dim) names first the groups whose ranks can equal another dim's (the ep
    group's are the dp group's at dp = ep): `for_groups` passes both of a ProcessGroups."""

    dim_of: callable = None
    group_dims: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: defaultdict(OpStats))  # (dim, kind) → OpStats

    @classmethod
    def for_groups(cls, groups) -> "CommCounter":
        """The counter of a run: its groups named as `groups` (a bench.distributed.ProcessGroups) names them."""
        return cls(dim_of=groups.dim_of, group_dims=groups.group_dims)

    def __post_init__(self):
        super().__init__()
        self._group_cache: dict[str, tuple[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns == "c10d" and name in _C10D:
            kind, idx = _C10D[name]
            dim, n = self._group(args)
            if name in ("send", "recv_") and dim in ("world", "other"):
                dim = self._p2p_dim(args)
            self._add(_data_parallel_if_reduction(dim, kind), kind, 0 if idx is None else _nbytes(args[idx]), n)
        elif ns == "_c10d_functional" and name in _FUNCOL:
            out = func(*args, **kwargs)
            kind = _FUNCOL[name]
            group_name = [a for a in args if isinstance(a, str)][-1]
            dim, n = self._group_by_name(group_name)
            self._add(_data_parallel_if_reduction(dim, kind), kind, _nbytes(out if kind == "all_gather" else args[0]), n)
            return out
        return func(*args, **kwargs)

    def _add(self, dim, kind, payload, n):
        s = self.stats[(dim, kind)]
        s.ops += 1
        s.bytes += payload
        s.wire_bytes += wire_bytes(kind, payload, n)

    def _group(self, args) -> tuple[str, int]:
        for a in args:  # the group arrives as a ScriptObject; ReduceOp is one too and fails to unbox
            if type(a).__name__ == "ScriptObject":
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except Exception:
                    continue
                return self._classify(pg.group_name, pg)
        return "other", 1

    def _p2p_dim(self, args) -> str:
        """A send/recv on a wide group (DeepSpeed's pipeline sends on WORLD) belongs to the dim
        whose group holds both ends: args are (tensors, group, peer rank in group, tag)."""
        pg = next(dist.ProcessGroup.unbox(a) for a in args if type(a).__name__ == "ScriptObject")
        peer = dist.get_global_rank(pg, args[2])
        return self.dim_of([dist.get_rank(), peer]) if self.dim_of else "other"

    def _group_by_name(self, group_name: str) -> tuple[str, int]:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return self._classify(group_name, _resolve_process_group(group_name))

    def _classify(self, key: str, pg) -> tuple[str, int]:
        if key not in self._group_cache:
            ranks = dist.get_process_group_ranks(pg)
            dim = self.group_dims.get(key) or (self.dim_of(ranks) if self.dim_of else "other")
            self._group_cache[key] = (dim, len(ranks))
        return self._group_cache[key]

    def totals(self) -> dict[str, float]:
        """Row columns (bench.results): comm_{bytes,wire_bytes,ops}_<dim> and comm_<dim>_<kind>_{bytes,ops}."""
        out: dict[str, float] = defaultdict(float)
        for (dim, kind), s in self.stats.items():
            out[comm_column("bytes", dim)] += s.bytes
            out[comm_column("wire_bytes", dim)] += s.wire_bytes
            out[comm_column("ops", dim)] += s.ops
            out[comm_op_column(dim, kind, "bytes")] += s.bytes
            out[comm_op_column(dim, kind, "ops")] += s.ops
        return dict(out)
