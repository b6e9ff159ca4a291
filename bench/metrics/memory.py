"""Memory probes: the step peak per rank and the persistent model-state bytes.

The step peak is what the step's live tensors add at their largest, as the allocator counts them
(the same quantity on every device, and the one the memory model predicts):
- CUDA: `max_memory_allocated` after a reset, minus what was allocated before; beside it the caching
  allocator's reserved peak (absolute: what the process held from the device, the figure to compare
  with its memory) and how often an allocation had to free cached blocks and retry
  (`num_alloc_retries`: non-zero means fragmentation near the limit, and slow steps). Reading them
  costs nothing, so the probe wraps the timed steps.
- CPU: torch's allocator keeps no statistics, so torch.profiler records every allocation and free
  (`profile_memory`) and the peak is the running sum's maximum. Recording slows the step it watches,
  so the worker gives it an extra, untimed step (after a lead-in step: a free is recorded only for
  a block allocated while recording). (The process RSS is no substitute: it counts what
  glibc keeps cached, and forcing glibc to return every block to make it repeatable page-faults
  every allocation, which slowed CPU steps by about a third.)
"""
from __future__ import annotations

import contextlib

import torch

from bench import device as bench_device


class PeakMemory:
    """Context manager: `.peak_bytes` is the memory the steps it watches add at their peak; on CUDA also
    `.reserved_peak_bytes` and `.alloc_retries` (None on CPU, which has no such allocator). `free`:
    whether the probe costs the steps it watches nothing (CUDA: it wraps the timed steps).

    On CPU it watches the step inside `measured()`, recording from `__enter__` on: a free is recorded
    only for a block allocated while recording, so the caller runs one lead-in step first (what the
    measured step frees, such as the previous step's gradients, was allocated there)."""

    MARK = "parabench.measured_step"

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = device, 0
        self.reserved_peak_bytes = self.alloc_retries = None
        self._accel = bench_device.for_device(device)
        self.free = self._accel.tracks_memory

    def __enter__(self):
        if self.free:
            self._accel.synchronize(self.device)
            self._accel.reset_peak(self.device)
            self._base = self._accel.allocated(self.device)
            self._retries = self._accel.alloc_retries(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile
            self._recorder = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._recorder.__enter__()
        return self

    def measured(self):
        """The step whose peak is read (CPU); on CUDA every step inside the probe is."""
        return torch.profiler.record_function(self.MARK) if not self.free else contextlib.nullcontext()

    def __exit__(self, *exc):
        if self.free:
            self._accel.synchronize(self.device)
            self.peak_bytes = self._accel.peak_allocated(self.device) - self._base
            self.reserved_peak_bytes = self._accel.peak_reserved(self.device)
            self.alloc_retries = self._accel.alloc_retries(self.device) - self._retries
        else:
            self._recorder.__exit__(None, None, None)
            self.peak_bytes = _peak_of_records(self._recorder.profiler.kineto_results.events(), self.MARK)
        return False


def _peak_of_records(events, mark: str) -> int:
    """Over the `mark`ed span: the largest running sum of the recorded allocations (+) and frees (−)
    above the sum at its start."""
    span = next(e for e in events if e.name() == mark)
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live, start, peak = 0, None, 0
    for e in memory:
        if start is None and e.start_ns() >= span.start_ns():
            start = peak = live
        if start is not None and e.start_ns() > span.end_ns():
            break
        live += e.nbytes()
        if start is not None:
            peak = max(peak, live)
    return 0 if start is None else peak - start


def state_bytes(state: dict[str, list]) -> dict[str, int]:
    """The one accounting rule for model state (every backend's `Trainer.state_tensors`): bytes of
    distinct storages, each counted once, in the first category that holds it, in the order
    params, grads, optimizer. So a parameter view of a flat buffer counts the buffer (padding
    included), and an optimizer that steps on the model's own tensors adds only its state, while
    one that keeps its own copies (master weights, flat shards and their gradients) adds those."""
    seen: set = set()
    out = {}
    for kind in ("params", "grads", "optimizer"):
        out[kind] = _bytes_once(state.get(kind, []), seen)
    return out


def _bytes_once(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)  # DTensor: its local shard
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_tensors(optimizer) -> list:
    """Everything a torch optimizer reaches: the tensors it steps on, their gradients, its state
    (0-dim step counters aside). `state_bytes` drops those that are the model's own."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return params + [p.grad for p in params] + state
