"""The one place the suite talks to an accelerator: choosing and setting a rank's device, synchronising,
timing events, allocator statistics and the communication backend.

Everything device-specific goes through the `Accelerator` that handles a tensor's device
(`for_device`): `Host` for the CPU (gloo, the wall clock, nothing to wait for, no allocator statistics),
`Cuda` for a GPU (torch.accelerator: NCCL, events on the current stream, the caching allocator's
statistics). Every call names its device explicitly, so no call falls back on "the current device",
which is GPU 0 until a rank sets its own. Tests install a recording accelerator (`installed`) whose
devices are `cpu:k`: a CPU tensor on it is an ordinary one, and every call it records names the index
the caller passed, so a call on the wrong GPU shows up on a machine without one.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class WallEvent:
    """A timing event read from the host's clock (what a CPU step's end is: nothing runs behind it)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def seconds_until(self, end: "WallEvent") -> float:
        return end.t - self.t


class Host:
    """No accelerator: tensors on the CPU, gloo between ranks."""

    type, backend, is_accelerator, tracks_memory = "cpu", "gloo", False, False

    def device_count(self) -> int:
        return 0

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        pass

    def synchronize(self, device: torch.device) -> None:
        pass

    def stream_synchronize(self, device: torch.device) -> None:
        pass

    def event(self, device: torch.device) -> WallEvent:
        return WallEvent()

    def name(self, device: torch.device) -> str:
        return "cpu"


class _CudaEvent:
    """A timing event on the device's current stream: it times the device's queue, not the host."""

    def __init__(self, device: torch.device):
        self.device, self._event = device, torch.Event(device=device, enable_timing=True)

    def record(self) -> None:
        self._event.record(torch.accelerator.current_stream(self.device))

    def synchronize(self) -> None:
        self._event.synchronize()

    def seconds_until(self, end: "_CudaEvent") -> float:
        return self._event.elapsed_time(end._event) / 1e3  # ms → s


class Cuda:
    """A CUDA GPU through torch.accelerator (NCCL between ranks)."""

    type, backend, is_accelerator, tracks_memory = "cuda", "nccl", True, True

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", index or 0)

    def set_device(self, device: torch.device) -> None:
        torch.accelerator.set_device_index(device.index)

    def synchronize(self, device: torch.device) -> None:
        """Wait for every stream of the device: NCCL's too (so a pending send blocks it)."""
        torch.accelerator.synchronize(device)

    def stream_synchronize(self, device: torch.device) -> None:
        """Wait for the current stream only: the compute queued so far, not communication in flight."""
        torch.accelerator.current_stream(device).synchronize()

    def event(self, device: torch.device) -> _CudaEvent:
        return _CudaEvent(device)

    def reset_peak(self, device: torch.device) -> None:
        torch.accelerator.reset_peak_memory_stats(device)

    def allocated(self, device: torch.device) -> int:
        return torch.accelerator.memory_allocated(device)

    def peak_allocated(self, device: torch.device) -> int:
        return torch.accelerator.max_memory_allocated(device)

    def peak_reserved(self, device: torch.device) -> int:
        return torch.accelerator.max_memory_reserved(device)

    def alloc_retries(self, device: torch.device) -> int:
        return torch.accelerator.memory_stats(device).get("num_alloc_retries", 0)

    def name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def l2_bytes(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).L2_cache_size


HOST, CUDA = Host(), Cuda()
_installed: list = []  # a test's accelerator, while installed


def accelerator():
    """This process's accelerator: a test's while one is installed, else CUDA when a GPU is visible,
    else None."""
    if _installed:
        return _installed[-1]
    return CUDA if torch.cuda.is_available() else None


def for_device(device: torch.device | str):
    """The Accelerator that handles tensors on `device`."""
    device = torch.device(device)
    if _installed and device.type == _installed[-1].type:
        return _installed[-1]
    return CUDA if device.type == "cuda" else HOST


@contextmanager
def installed(fake):
    """Make `fake` this process's accelerator while inside (tests)."""
    _installed.append(fake)
    try:
        yield fake
    finally:
        _installed.remove(fake)


def synchronize(device: torch.device) -> None:
    for_device(device).synchronize(device)


def stream_synchronize(device: torch.device) -> None:
    for_device(device).stream_synchronize(device)


def event(device: torch.device):
    return for_device(device).event(device)


def comm_backend(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for CPU tensors: decided here once."""
    return for_device(device).backend


def device_name(device: torch.device) -> str:
    return for_device(device).name(device)
