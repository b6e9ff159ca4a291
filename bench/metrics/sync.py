"""Host-synchronisation counter: ops that make the host wait for the device, seen at the dispatcher.

A `.item()`, `bool(tensor)`, `torch.equal`, a data-dependent shape (`nonzero`, `masked_select`) or
a device → host copy blocks the host until the device has caught up: on a GPU, one per micro-batch
serialises the launch queue with the kernels. The worker counts them on the same untimed step as
communication (`host_syncs`), and tests/test_timed_window.py asserts the backends do none per
micro-batch.

The count is by op, not by device, so it means the same on CPU (where nothing waits) as on CUDA.
On CUDA, `cuda_syncs` also counts what torch's CUDA sync-debug mode reports (it warns at each
blocking copy, scalar read and stream synchronisation torch performs, whichever layer asked): a
cross-check from below the dispatcher.

One exception to the op count: torch's optimizers read their step counter with `.item()`, a tensor they keep on the
host whatever the device (unless capturable or fused), so reads of host tensors inside a torch
optimizer step are no synchronisation and are not counted.
"""
from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Composite ops (item, is_nonzero) reach a dispatch mode as _local_scalar_dense; listed for clarity.
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select"})


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _device_to_host(name: str, args, kwargs) -> bool:
    """A copy from an accelerator into host memory (it waits for the copy, and so for the queue)."""
    if name == "_to_copy":
        target = kwargs.get("device")
        return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class HostSyncCounter(TorchDispatchMode):
    """Context manager: `.total` host synchronisations in the enclosed code, `.by_op` per op name."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.cuda_syncs: int | None = None  # None: CUDA is not in use in this process
        self._in_optimizer = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self):
        self._hooks = (register_optimizer_step_pre_hook(self._optimizer_enter),
                       register_optimizer_step_post_hook(self._optimizer_exit))
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            self._caught_warnings = warnings.catch_warnings(record=True)
            self._caught = self._caught_warnings.__enter__()
            warnings.simplefilter("always")  # every occurrence, not once per source line
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._sync_warning = self._probe_sync_warning()
        return super().__enter__()

    def _probe_sync_warning(self) -> tuple | None:
        """The (category, message) torch warns with at a sync, read off one known sync (a scalar read)
        rather than matched against its wording, which a torch release may change; None if it warned
        nothing (then the count is unknown, not 0)."""
        torch.zeros((), device=torch.cuda.current_device()).item()
        probe = [(w.category, str(w.message)) for w in self._caught]
        self._caught.clear()
        return probe[0] if probe else None

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self._caught_warnings.__exit__(*exc)
            if self._sync_warning is not None:
                self.cuda_syncs = sum((w.category, str(w.message)) == self._sync_warning for w in self._caught)
        return super().__exit__(*exc)

    def _optimizer_enter(self, *args) -> None:
        self._in_optimizer += 1

    def _optimizer_exit(self, *args) -> None:
        self._in_optimizer -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in SYNC_OPS and not self._host_counter_read(args, kwargs):
            self.by_op[name] += 1
        elif name in ("_to_copy", "copy_") and _device_to_host(name, args, kwargs):
            self.by_op["device_to_host_copy"] += 1
        return func(*args, **kwargs)

    def _host_counter_read(self, args, kwargs) -> bool:
        return self._in_optimizer > 0 and all(t.device.type == "cpu" for t in _tensors(args, kwargs))
