"""Where and with what a run ran: recorded in every result row."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import socket
import subprocess
from functools import lru_cache
from pathlib import Path


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "hostname": socket.gethostname(),
        "torch_version": _version("torch"),
        "deepspeed_version": _version("deepspeed"),
        "submitit_version": _version("submitit"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
    }
