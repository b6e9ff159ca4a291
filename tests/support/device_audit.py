"""An implicit-device audit: a torch function mode that records every tensor factory call the suite's
own code makes without naming a device. On a CPU such a tensor lands where every other tensor is, so
no CPU run can show the bug; on a GPU it lands on the host, and the first op that mixes it with a GPU
tensor fails, or a collective is handed a host tensor (NCCL refuses it).

Allowed: the layout-independent initial values and the synthetic batches, which are made on the host
by design and copied to the device (`models.gpt.init_value`, `bench.training.micro_batches`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
                       torch.randint, torch.randperm, torch.tensor, torch.linspace, torch.eye,
                       torch.empty_strided, torch.scalar_tensor})
ALLOWED = frozenset({"init_value", "init_block", "micro_batches", "global_batch"})
REPO = Path(__file__).resolve().parents[2]
AUDITED = (REPO / "bench", REPO / "models")


class ImplicitDeviceAudit(TorchFunctionMode):
    """`.found`: (file:line, function, factory) of each factory call without a device, from the suite's code."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self._check(func)
        return func(*args, **kwargs)

    def _check(self, func) -> None:
        frame, caller = sys._getframe(2), None
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if frame.f_code.co_name in ALLOWED:
                return
            if caller is None and "torch" not in path.parts and path != Path(__file__).resolve():
                caller = frame
            frame = frame.f_back
        if caller is not None and any(Path(caller.f_code.co_filename).is_relative_to(d) for d in AUDITED):
            where = f"{Path(caller.f_code.co_filename).relative_to(REPO)}:{caller.f_lineno}"
            self.found.append((where, caller.f_code.co_name, func.__name__))
