"""Step timer: wall time per step with the device synchronised; median and p10/p90."""
from __future__ import annotations

import statistics
import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)
        return False

    def summary(self) -> dict[str, float]:
        if not self.times:
            return {}
        q = statistics.quantiles(self.times, n=10, method="inclusive") if len(self.times) > 1 else self.times * 9
        return {"step_time_s": statistics.median(self.times), "step_time_p10_s": q[0], "step_time_p90_s": q[-1]}
