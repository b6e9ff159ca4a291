"""Step timer: seconds per step, and their median and p10/p90.

CUDA: a pair of events around each step, recorded on the current stream. They time the device's
queue from the first to the last work of the step without stopping the host at either end, so the
host may run ahead (build the next batch) as it would in training; the elapsed times are read once,
when `times` is first asked for. CPU: the wall clock (nothing runs asynchronously there).
"""
from __future__ import annotations

import statistics
import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.device, self._times, self._events = device, [], []

    @property
    def times(self) -> list[float]:
        if self._events:
            self._events[-1][1].synchronize()  # the last end event: every earlier one has completed too
            self._times += [start.elapsed_time(end) / 1e3 for start, end in self._events]  # ms → s
            self._events = []
        return self._times

    @times.setter
    def times(self, values: list[float]) -> None:
        self._times, self._events = list(values), []

    def __enter__(self):
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._times.append(time.perf_counter() - self._t0)
        return False

    def summary(self) -> dict[str, float]:
        times = self.times
        if not times:
            return {}
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        return {"step_time_s": statistics.median(times), "step_time_p10_s": q[0], "step_time_p90_s": q[-1]}
