"""torch.distributed set-up: the backend choice, initialisation from the environment, ProcessGroups.

Nothing else in the suite calls `init_process_group` or `new_group`; everything that needs a group
receives the `ProcessGroups` built here.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

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
    """In a Slurm task that submitit started (one task per rank), export what torch.distributed's env://
    reads: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (the job's first host) and
    MASTER_PORT (drawn from the job id, so every task of the job agrees: `job_port`), with submitit's own
    `TorchDistributedEnvironment`. A MASTER_ADDR or MASTER_PORT already set wins; a rank already set
    (our spawner, torchrun) means there is nothing to do."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or "RANK" in os.environ:
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment
    env = TorchDistributedEnvironment()  # reads SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST, …
    env.master_addr = os.environ.get("MASTER_ADDR", env.master_addr)
    env.master_port = int(os.environ.get("MASTER_PORT") or job_port(JobEnvironment().job_id))
    env.export(set_cuda_visible_devices=False, overwrite=True)  # devices: `resolve_device` picks by LOCAL_RANK


def job_port(job_id: str) -> int:
    """A port every task of the job draws alike, below the kernel's ephemeral range. (submitit draws
    from 20000–60000, mostly inside that range, where any process's outgoing connection may already
    hold the port: rank 0 then fails to listen, EADDRINUSE, as a CI run saw.)"""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return random.Random(job_id).randint(20000, max(20000, low - 1))


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
