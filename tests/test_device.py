"""The device facade (bench/device.py) and the profiler's split of a GPU step, on CPU."""
from __future__ import annotations

import time

import pytest
import torch

from bench import device as bench_device
from bench.metrics.profile import kernel_split
from support.accelerator import RecordingAccelerator


def test_host_devices_route_to_the_host_and_time_by_the_wall_clock():
    host = bench_device.for_device(torch.device("cpu"))
    assert host is bench_device.HOST and host.backend == "gloo" and not host.tracks_memory
    start, end = bench_device.event("cpu"), bench_device.event("cpu")
    start.record()
    time.sleep(0.01)
    end.record()
    assert 0.009 < start.seconds_until(end) < 0.5


def test_an_installed_accelerator_handles_its_devices_only_while_installed():
    fake = RecordingAccelerator(count=2, type="cuda")
    with bench_device.installed(fake):
        assert bench_device.accelerator() is fake and bench_device.comm_backend(torch.device("cuda", 1)) == "nccl"
        bench_device.stream_synchronize(torch.device("cuda", 1))
        assert bench_device.for_device("cpu") is bench_device.HOST
    assert fake.calls == [("stream_synchronize", 1)]
    assert bench_device.for_device(torch.device("cuda", 1)) is not fake


def test_a_gpu_step_splits_into_compute_exposed_communication_and_idle():
    """Kernels (µs): compute 0-40 and 60-80, an all-reduce 30-70 on its own stream. Compute runs 60 µs,
    the all-reduce is exposed 40-60 only (20 µs), and nothing runs for the last 20 µs of a 100 µs step."""
    kernels = [("sm90_xmma_gemm_bf16", 0, 40), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 30, 70),
               ("vectorized_elementwise_kernel", 60, 80)]
    split = kernel_split(kernels, wall_s=100e-6)
    assert split == pytest.approx({"compute": 60e-6, "communication": 20e-6, "idle": 20e-6}, abs=1e-12)
