"""Helpers for backends that shard the shared GPT with DTensor: the device mesh and shard-only init.

The mesh is built from our `Layout`, never from torch's default rank order, so every group torch
creates from it has exactly the ranks of one of our tp/pp/dp groups (or, for HSDP, a sub-group of
a dp group), and the communication counter names it correctly.

Initialisation never builds the whole model: the GPT is constructed on the meta device, sharded,
`to_empty`-ed, and each local shard is cut from `models.init_value` of its one full parameter.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from bench.layout import Layout
from models import GPTConfig, init_value


def hybrid_shape(dp: int, dp_ranks_per_node: int) -> tuple[int, int]:
    """(replicate, shard) sizes of HSDP over `dp` ranks.

    Shard within a node (cheap all-gathers and reduce-scatters), replicate across nodes: the shard
    size is the largest divisor of dp that fits the dp ranks of one node and still leaves at least
    two replicas (a single replica would just be full sharding). dp = 2 → (2, 1); dp = 4 on one
    node → (2, 2); dp = 16 with 8 dp ranks per node → (2, 8).
    """
    if dp < 2:
        raise ValueError(f"hybrid sharding needs dp ≥ 2, got dp={dp}")
    shard = max(d for d in range(1, dp) if dp % d == 0 and d <= max(dp_ranks_per_node, 1))
    return dp // shard, shard


def dp_ranks_per_node(layout: Layout, rank: int) -> int:
    """How many ranks of this rank's dp group share its node (node size: LOCAL_WORLD_SIZE if set)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.gpus_per_node))
    node = rank // per_node
    return sum(1 for r in layout.group_of(rank, "dp") if r // per_node == node)


def device_mesh(layout: Layout, device: torch.device, hybrid: tuple[int, int] | None = None):
    """A DeviceMesh over the world, dims ("pp", "dp", "tp"), or ("pp", "dp_rep", "dp_shard", "tp").

    mesh[p, d, t] = layout.rank(dp=d, pp=p, tp=t), so slicing a dim yields our own groups whatever
    the rank order. For HSDP the dp index splits as d = rep · shard + s (shard ranks contiguous).
    """
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor([[[layout.rank(dp=d, pp=p, tp=t) for t in range(layout.tp)]
                           for d in range(layout.dp)] for p in range(layout.pp)], dtype=torch.int)
    names = ("pp", "dp", "tp")
    if hybrid is not None:
        rep, shard = hybrid
        ranks = ranks.view(layout.pp, rep, shard, layout.tp)  # (pp, dp, tp) → (pp, rep, shard, tp)
        names = ("pp", "dp_rep", "dp_shard", "tp")
    return DeviceMesh(device.type, ranks, mesh_dim_names=names)


def meta_module(build) -> nn.Module:
    """Construct a module on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return build()


@torch.no_grad()
def materialize(module: nn.Module, cfg: GPTConfig, seed: int, device: torch.device) -> nn.Module:
    """Allocate `module`'s local shards and fill them from `init_value` (names are the full GPT's)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    module.to_empty(device=device)
    for name, p in module.named_parameters():
        full = init_value(name, p.shape, cfg, seed).to(p.dtype)  # ONE full parameter, global shape
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank cuts its own shard from its own copy, no communication.
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
    return module


def reset_dtensor_caches() -> None:
    """Forget DTensor's process-wide caches of sharding and redistribution plans.

    They are keyed by meshes that compare equal across runs (same ranks, same dim names), so in a
    warm rank process a later run would reuse a plan bound to the previous run's destroyed groups
    ("Could not resolve the process group registered under the name …"). Call between runs."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()
