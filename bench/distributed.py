"""torch.distributed set-up: the backend choice, initialisation from the environment, ProcessGroups.

Nothing else in the suite calls `init_process_group` or `new_group`; everything that needs a group
receives the `ProcessGroups` built here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.layout import DIMS, Layout


def resolve_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda was requested but no CUDA device is available; use --device cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def comm_backend(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for CPU tensors: decided here once."""
    return "nccl" if device.type == "cuda" else "gloo"


def env_from_slurm() -> None:
    """Map Slurm task variables to the torch.distributed ones (submitit runs one task per rank)."""
    if "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        os.environ["MASTER_ADDR"] = _first_host(nodes)
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def _first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'gpu[003-005,007],cpu1' → 'gpu003'."""
    head = nodelist.split(",")[0]
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    return prefix + rest.split("-")[0].split(",")[0].rstrip("]")


def init_from_env(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default group from RANK/WORLD_SIZE/MASTER_* (our spawner, torchrun or Slurm)."""
    env_from_slurm()
    if not dist.is_initialized():
        dist.init_process_group(comm_backend(device), timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ProcessGroups:
    """Every group this rank belongs to, built once from a Layout and passed explicitly."""

    layout: Layout
    rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """Global ranks of this rank's tp, pp and dp groups."""

    @classmethod
    def build(cls, layout: Layout) -> "ProcessGroups":
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(f"tp ({layout.tp}) × pp ({layout.pp}) × dp ({layout.dp}) = {layout.world_size}, "
                               f"but {world} processes were started")
        mine, ranks = {}, {}
        for dim in DIMS:  # every rank creates every group, in the same order (new_group is collective)
            for group in layout.groups(dim):
                pg = dist.new_group(group)
                if rank in group:
                    mine[dim], ranks[dim] = pg, group
        return cls(layout=layout, rank=rank, ranks=ranks, **mine)

    @property
    def coord(self):
        return self.layout.coords(self.rank)

    def size(self, dim: str) -> int:
        return getattr(self.layout, dim)

    def dim_of(self, group_ranks: tuple[int, ...] | list[int]) -> str:
        """Name a group by its ranks: tp, pp, dp (or a sub-group of one), world, or other."""
        key = sorted(group_ranks)
        for dim in DIMS:
            if len(key) > 1 and key == self.ranks[dim]:
                return dim
        if key == list(range(self.layout.world_size)):
            return "world"
        for dim in DIMS:  # a sub-group of one dim's group (HSDP's replicate/shard groups split dp)
            if len(key) > 1 and set(key) <= set(self.ranks[dim]):
                return dim
        return "other"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
