"""Step timer: the seconds of each step (their median and p10/p90 are the row's: bench.results.rows.step_time_summary).

An accelerator: a pair of events around each step, recorded on the device's current stream. They time the device's
queue from the first to the last work of the step without stopping the host at either end, so the
host may run ahead (build the next batch) as it would in training; the elapsed times are read once,
when `times` is first asked for. CPU: the same events read the wall clock (nothing runs behind the host).
"""
from __future__ import annotations

import torch

from bench import device as bench_device


class StepTimer:
    def __init__(self, device: torch.device):
        self.device, self._times, self._events = device, [], []

    @property
    def times(self) -> list[float]:
        if self._events:
            self._events[-1][1].synchronize()  # the last end event: every earlier one has completed too
            self._times += [start.seconds_until(end) for start, end in self._events]
            self._events = []
        return self._times

    @times.setter
    def times(self, values: list[float]) -> None:
        self._times, self._events = list(values), []

    def __enter__(self):
        self._start = bench_device.event(self.device)
        self._start.record()
        return self

    def __exit__(self, *exc):
        end = bench_device.event(self.device)
        end.record()
        self._events.append((self._start, end))
        return False
