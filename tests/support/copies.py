"""Bytes a backend's step moves in data-movement kernels, counted under TorchDispatchMode on rank 0 (the
test of `bench.analysis.time_model.backend_copy_bytes`).

A kernel's bytes are those it reads plus those it writes: copy_ reads its source and writes itself,
fill_/zero_ write, other in-place ops read and write themselves and read their other tensors, the
norm reads, and an out-of-place op reads its inputs and writes its outputs (an `out=` argument once).
Views and collectives move nothing here (the wire is the communication counter's)."""
from __future__ import annotations

import torch

from support.parity import each_config

MOVES = {"copy_", "cat", "chunk_cat", "all_gather_copy_in", "split_with_sizes_copy", "_to_copy", "div_", "mul_",
         "mul", "add_", "fill_", "zero_", "linalg_vector_norm"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def kernel_bytes(name: str, args: tuple, kwargs: dict, out) -> int:
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if name == "copy_":
        return 2 * _nbytes(args[1])
    if name in ("fill_", "zero_"):
        return _nbytes(args[0])
    if name in ("all_gather_copy_in", "split_with_sizes_copy"):  # each input element read once, written once
        return 2 * _nbytes(args[0])
    if name == "linalg_vector_norm":
        return _nbytes(args[0])
    if name.endswith("_"):
        return 2 * _nbytes(args[0]) + _nbytes(list(args[1:]))
    inputs = [x for x in (*args, *kwargs.values()) if not any(x is o for o in outs)]
    return _nbytes(inputs) + _nbytes(outs)


def step_copy_bytes(pool, cfgs: list) -> list[int]:
    """Bytes of MOVES kernels in one step (after two warm-up steps) of each config, rank 0."""
    return pool.call(_count_on_rank, [c.to_dict() for c in cfgs], timeout_s=600)[0]


def _count_on_rank(cfg_dicts: list[dict]) -> list[int] | None:
    return each_config(cfg_dicts, _count_step)


def _count_step(cfg, trainer, groups) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in MOVES:
                Count.total += kernel_bytes(name, args, kwargs or {}, out)
            return out
    for step in range(2):
        trainer.train(trainer.batch(step))
    with Count():
        trainer.train(trainer.batch(2))
    return Count.total
