"""The peak FLOP/s that MFU is measured against: the device table on GPU, a measured matmul on CPU."""
from __future__ import annotations

import time

import torch

from bench import device as bench_device
from bench.conventions import device_peak, dtype_key


def cpu_peak_flops(n: int = 256, seconds: float = 0.3) -> float:
    """FLOP/s of this process's threads on a square fp32 matmul (what one rank can reach)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from)."""
    if bench_device.for_device(device).is_accelerator:
        name = bench_device.device_name(device)
        peak = device_peak(name)
        if peak:
            return peak.flops[dtype_key(dtype)], f"table:{peak.name}"
        return float("nan"), f"unknown device {name}"
    return cpu_peak_flops(), "measured:cpu-matmul-fp32"
