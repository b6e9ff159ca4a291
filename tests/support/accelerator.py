"""A recording accelerator for CPU tests of the device paths (bench.device): it answers like a machine
with `count` GPUs and records every call with the device index the caller named.

type "cpu": its devices are `cpu:k`, so a rank's tensors are ordinary CPU tensors (gloo runs them) while
each call still names k: the worker and calibration run on it for real. type "cuda": devices `cuda:k`
for set-up code that allocates nothing (`setup_rank` with `init_process_group` recorded).
"""
from __future__ import annotations

import os
import time

import torch

from bench import device as bench_device


class RecordingAccelerator:
    is_accelerator, tracks_memory = True, True

    def __init__(self, count: int, type: str = "cpu"):
        self.count, self.type = count, type
        self.backend = "gloo" if type == "cpu" else "nccl"
        self.calls: list[tuple[str, int | None]] = []

    def _call(self, op: str, device: torch.device, value=None):
        self.calls.append((op, torch.device(device).index))
        return value

    def device_count(self) -> int:
        return self.count

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.type, index or 0)

    def set_device(self, device):
        self._call("set_device", device)

    def synchronize(self, device):
        self._call("synchronize", device)

    def stream_synchronize(self, device):
        self._call("stream_synchronize", device)

    def event(self, device):
        self._call("event", device)
        return _Event(self, device)

    def reset_peak(self, device):
        self._call("reset_peak", device)

    def allocated(self, device):
        return self._call("allocated", device, 0)

    def peak_allocated(self, device):
        return self._call("peak_allocated", device, 0)

    def peak_reserved(self, device):
        return self._call("peak_reserved", device, 0)

    def alloc_retries(self, device):
        return self._call("alloc_retries", device, 0)

    def name(self, device):
        return self._call("name", device, "Recording GPU")

    def l2_bytes(self, device):
        return self._call("l2_bytes", device, 32 << 20)


class _Event:
    def __init__(self, accel: RecordingAccelerator, device):
        self.accel, self.device = accel, device

    def record(self):
        self.accel._call("event.record", self.device)
        self.t = time.perf_counter()

    def synchronize(self):
        self.accel._call("event.synchronize", self.device)

    def seconds_until(self, end) -> float:
        return end.t - self.t


def recorded(fn, *args):
    """`fn(*args)` on this rank with a recording accelerator of one device per local rank installed:
    (what fn returned, LOCAL_RANK, the calls). A module-level function: RankPool runs it by name."""
    accel = RecordingAccelerator(count=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    with bench_device.installed(accel):
        value = fn(*args)
    return value, int(os.environ.get("LOCAL_RANK", 0)), accel.calls
