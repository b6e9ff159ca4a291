"""torch.distributed set-up: a rank's device and default group from the environment, and ProcessGroups.

A rank enters `rank_session` (`setup_rank`: its device, then its default group bound to it; the group
destroyed on leaving); nothing else in the suite calls `init_process_group`. The communication backend
for a device is `bench.device.comm_backend`. Everything that needs a layout's groups receives the `ProcessGroups` built here.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench import device as bench_device
from bench.layout import DIMS, EXPERT_DIMS, Layout, layout_product


class DeviceSetupError(ValueError):
    """A rank's device cannot be chosen from its environment (one line: the variable and the fix)."""


def resolve_device(requested: str = "auto") -> torch.device:
    """This rank's device: the CPU, or the accelerator's device LOCAL_RANK (DeepSpeed's own rule: its
    engine calls set_device(LOCAL_RANK), so both always name one GPU). Refuses, in one line, a CUDA
    request with no GPU visible, more ranks per node than GPUs, and a LOCAL_RANK beyond the visible
    devices, which would otherwise put two ranks on one GPU (NCCL: "Duplicate GPU detected")."""
    accel = bench_device.accelerator()
    if requested == "cpu" or (requested == "auto" and accel is None):
        return torch.device("cpu")
    if accel is None:
        raise DeviceSetupError(f"--device {requested}: no CUDA device is visible here "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                               "use --device cpu, or run on a GPU node")
    count, local = accel.device_count(), int(os.environ.get("LOCAL_RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
    if per_node > count:
        raise DeviceSetupError(f"LOCAL_WORLD_SIZE={per_node} ranks on this node but {count} GPU(s) visible: "
                               "run at most one rank per GPU (Slurm profile tasks_per_node, or a smaller world)")
    if local >= count:
        raise DeviceSetupError(f"LOCAL_RANK={local} but this task sees {count} GPU(s) "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give "
                               "every task all of its node's GPUs (no --gpus-per-task or --gpu-bind)")
    return accel.device(local)


def claim_device(requested: str = "auto") -> torch.device:
    """This rank's device, chosen from its environment and made current: the Slurm task's RANK,
    LOCAL_RANK, … exported first (the device index is the local rank), then `resolve_device`, then
    set_device, before any stream, event or group touches a device (else they land on GPU 0)."""
    env_from_slurm()
    device = resolve_device(requested)
    bench_device.for_device(device).set_device(device)
    return device


def setup_rank(requested: str = "auto", timeout_s: float = 600.0) -> torch.device:
    """Everything a rank does before its first collective, in the order NCCL needs: `claim_device`,
    then the default group initialised and bound to that device (`device_id`: every group made after
    it is bound too). Returns the device."""
    device = claim_device(requested)
    init_from_env(device, timeout_s)
    return device


@contextmanager
def rank_session(requested: str = "auto", timeout_s: float = 600.0) -> Iterator[torch.device]:
    """This rank's device and default group (`setup_rank`) while inside; the group destroyed on leaving,
    so the next run in this process starts clean. Every rank entry point enters it: the worker, calibration,
    the parity harness, the tests' rank bodies and the benchmarks."""
    device = setup_rank(requested, timeout_s)
    try:
        yield device
    finally:
        shutdown()


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
    env.export(set_cuda_visible_devices=False, overwrite=True)  # `resolve_device` picks by LOCAL_RANK


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
    """Initialise the default group from RANK/WORLD_SIZE/MASTER_* (our spawner, torchrun or Slurm) on
    `device`, already chosen and made current (`setup_rank` does all three)."""
    env_from_slurm()
    if not dist.is_initialized():
        dist.init_process_group(bench_device.comm_backend(device), timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ProcessGroups:
    """Every group this rank belongs to, built once from a Layout and passed explicitly."""

    layout: Layout
    rank: int
    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    """The ranks a gradient is reduced over: dp × cp (each cp rank saw a share of the same sequences,
    as Megatron's data-parallel group with cp); the dp group itself at cp = 1."""
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """Global ranks of this rank's tp, cp, pp, dp, dp_cp, ep and edp groups."""
    ep: dist.ProcessGroup | None = None
    """The ranks that split the experts (bench.layout: blocks of ep inside dp × cp), over which tokens are
    dispatched; None at ep = 1 (no group of one is made: every expert is local)."""
    edp: dist.ProcessGroup | None = None
    """The ranks that hold the same experts, over which expert gradients are reduced; dp_cp at ep = 1."""

    @classmethod
    def build(cls, layout: Layout) -> "ProcessGroups":
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(f"{layout_product(layout)} = {layout.world_size}, but {world} processes were started")
        mine, ranks = {}, {}
        wanted = ({dim: (dim,) for dim in DIMS} | ({"dp_cp": ("dp", "cp")} if layout.cp > 1 else {})
                  | ({dim: (dim,) for dim in EXPERT_DIMS} if layout.ep > 1 else {}))  # ep = 1: the groups of before
        for name, dims in wanted.items():  # every rank creates every group, in the same order (collective)
            for group in layout.groups(*dims):
                pg = dist.new_group(group)  # its own group even where its ranks equal another's: named by identity
                if rank in group:
                    mine[name], ranks[name] = pg, group
        mine.setdefault("dp_cp", mine["dp"])
        ranks.setdefault("dp_cp", ranks["dp"])
        mine.setdefault("edp", mine["dp_cp"])
        ranks.setdefault("edp", ranks["dp_cp"])
        ranks.setdefault("ep", [rank])
        return cls(layout=layout, rank=rank, ranks=ranks, **mine)

    @property
    def coord(self):
        return self.layout.coords(self.rank)

    def size(self, dim: str) -> int:
        return self.layout.size(dim)

    @property
    def data_ranks(self) -> int:
        """How many ranks a gradient is reduced over: dp × cp."""
        return self.layout.dp * self.layout.cp

    @property
    def data_rank(self) -> int:
        """This rank's index in the dp × cp group (its ranks sorted: the group's own order)."""
        return self.ranks["dp_cp"].index(self.rank)

    @property
    def group_dims(self) -> dict[str, str]:
        """Group name → dim for the groups whose ranks may equal another dim's (the ep group's are the cp or
        dp group's when ep = cp or ep = dp at cp = 1): the comm counter names these by identity, not ranks.
        The expert-gradient reduction over edp counts as dp: it is data-parallel traffic."""
        named = {"ep": self.ep, "dp": self.edp if self.layout.ep > 1 else None}
        return {pg.group_name: dim for dim, pg in named.items() if pg is not None}

    def dim_of(self, group_ranks: tuple[int, ...] | list[int]) -> str:
        """Name a group by its ranks: tp, cp, pp, dp (or a sub-group of one), ep, world, or other. The
        gradient reductions over dp × cp and over edp count as dp: they are the data-parallel traffic.
        Where ep's ranks equal another dim's, ranks say that dim: `group_dims` names the ep group."""
        key = sorted(group_ranks)
        for dim in DIMS:
            if len(key) > 1 and key == self.ranks[dim]:
                return dim
        if len(key) > 1 and key == self.ranks["dp_cp"]:
            return "dp"
        if len(key) > 1 and key == self.ranks.get("ep"):
            return "ep"
        if len(key) > 1 and key == self.ranks.get("edp"):
            return "dp"
        if key == list(range(self.layout.world_size)):
            return "world"
        for dim in DIMS:  # a sub-group of one dim's group (HSDP's replicate/shard groups split dp)
            if len(key) > 1 and set(key) <= set(self.ranks[dim]):
                return dim
        if len(key) > 1 and set(key) <= set(self.ranks["dp_cp"]):  # HSDP's shard group under cp: dp_shard × cp
            return "dp"
        return "other"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
