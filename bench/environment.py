"""Where and with what a run ran: the environment fingerprint recorded in every result row.

Two rows compare only if their fingerprints do: the same device (name, count, driver), the same CUDA
and NCCL, the same CPU, the same torch / DeepSpeed / submitit, the same commit. Package versions come
from the installed metadata and the rest from /proc, so this module imports no torch itself (the
sweep writes skipped rows before any rank starts); the CUDA fields are filled where torch is already
imported (in a rank, where the run happened) and are None elsewhere.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    return _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent)


@lru_cache(maxsize=1)
def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


@lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc or nvidia-smi; None without one."""
    try:
        with open("/proc/driver/nvidia/version") as f:  # "NVRM version: NVIDIA UNIX ... Module  550.54.15 ..."
            words = f.readline().split()
        return next((w for w in words if w[:1].isdigit() and "." in w), None)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return out.splitlines()[0].strip() if out else None
    return None


def _cuda() -> dict:
    """CUDA runtime, NCCL and the visible device count, from torch if this process has imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {"device_count": None if torch is None else 0,
                "cuda_version": None if torch is None else torch.version.cuda, "nccl_version": None}
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        nccl = None
    return {"device_count": torch.cuda.device_count(), "cuda_version": torch.version.cuda, "nccl_version": nccl}


def node_name() -> str:
    """The node this process runs on: the node name Slurm started the task on (SLURMD_NODENAME), else
    the host name. On a real cluster the two agree; on the emulated cluster of slurm/local-cluster every
    node is one slurmd of this one host, so its Slurm node name is the only truthful distinction."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def cache_dir() -> Path:
    """This suite's user cache (calibrated profiles, saved tracebacks): $XDG_CACHE_HOME/parabench, else
    ~/.cache/parabench."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parabench"


@lru_cache(maxsize=8)
def machine_identity(device: str = "cpu") -> dict:
    """What a measured profile holds for: this host, its CPU and cores, the torch build and the device
    measured (cpu or the CUDA device's name). A profile measured under another identity is not this
    machine's (bench.analysis.hardware.measured_profile)."""
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "torch": _version("torch"), "device": device}


def fingerprint(identity: dict) -> str:
    """A short, stable name for a machine identity (the cached profile's file name)."""
    import hashlib
    import json
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def environment() -> dict:
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        **_cuda(),
        "driver_version": driver_version(),
        "python_version": platform.python_version(),
        "torch_version": _version("torch"),
        "deepspeed_version": _version("deepspeed"),
        "submitit_version": _version("submitit"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
    }
