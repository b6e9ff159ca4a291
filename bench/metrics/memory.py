"""Memory probes: the step peak per rank and the persistent model-state bytes.

CUDA: `max_memory_allocated` after a reset, minus what was allocated before the steps; beside it
the caching allocator's reserved peak (absolute: what the process held from the device, the figure
to compare with its memory) and how often an allocation had to free cached blocks and retry
(`num_alloc_retries`: non-zero means fragmentation near the limit, and slow steps).
CPU: there is no allocator statistic, so the kernel's RSS high-water mark (VmHWM) is reset through
/proc/self/clear_refs before the timed steps and read after them; the peak is VmHWM minus the RSS
before. It is repeatable only with glibc's heap returned to the OS (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set before Python starts: `MALLOC_ENV`, set by the launchers).
"""
from __future__ import annotations

import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Context manager: `.peak_bytes` is the memory added at the peak of the enclosed steps; on CUDA
    also `.reserved_peak_bytes` and `.alloc_retries` (None on CPU, which has no such allocator)."""

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = device, 0
        self.reserved_peak_bytes = self.alloc_retries = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self._retries = _alloc_retries(self.device)
        else:
            self._base = _status_bytes("VmRSS:")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.reserved_peak_bytes = torch.cuda.max_memory_reserved(self.device)
            self.alloc_retries = _alloc_retries(self.device) - self._retries
        else:
            self.peak_bytes = max(_status_bytes("VmHWM:") - self._base, 0)
        return False


def _alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


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
