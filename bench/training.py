"""The backend contract: what every engine builds (a Trainer over the shared model, with the same
optimizer and data) and what the worker calls on it.

It lives outside `bench/backends/` so that the native engine, a library, does not import the plugin
layer; the backends (and the native engine's `build`) implement it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.config import RunConfig
from bench.data import micro_batches
from bench.distributed import ProcessGroups
from bench.metrics.memory import optimizer_tensors
from bench.surgery import split_dim
from models.config import role_spec

# One optimizer for every backend, so losses are comparable (torch AdamW; DeepSpeed takes it as client).
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# The fused implementation (one kernel over all parameters, CPU and CUDA) is what the frameworks ship
# as their default Adam (DeepSpeed's FusedAdam, Megatron's apex/TE FusedAdam); torch's default for-loop
# AdamW costs ~80 ms per step for the 5 M-parameter `small` model on one CPU core, fused ~13 ms.

Batch = list[tuple[torch.Tensor, torch.Tensor]]
"""One step's inputs on this rank: micro_batches × (inputs, targets), each (micro_batch, seq) int64."""


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW, fused=True)


@dataclass
class RunContext:
    cfg: RunConfig
    groups: ProcessGroups
    device: torch.device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.cfg.dtype)


class Trainer(ABC):
    """One backend's training loop on this rank. The worker owns the measurement around it:

    - `batch(step)` returns this rank's share of the global batch of `step`, already on the device.
      It is never timed, so generating the synthetic tokens costs no step time.
    - `train(batch)` runs one optimizer step and returns the mean loss this rank computed over its
      data-parallel shard as a 0-dim device tensor, or None if it computed none (a non-last
      pipeline stage). It must not synchronise the host with the device per micro-batch (no
      `.item()`): the worker reads the loss once per step, after the timed window.
    Gradients are zeroed at the start of a step, so after it they are still there to be counted.
    """

    ctx: RunContext

    def batch(self, step: int) -> Batch:
        cfg, device, coord = self.ctx.cfg, self.ctx.device, self.ctx.groups.coord
        return [(x.to(device), y.to(device)) for x, y in micro_batches(cfg, step, coord.dp, coord.cp)]

    @abstractmethod
    def train(self, batch: Batch) -> torch.Tensor | None: ...

    def meter(self) -> AbstractContextManager | None:
        """Instruments that would slow a timed step (the pipeline's busy/idle meter synchronises the
        device around every compute section): the worker runs one extra, untimed `train` inside this
        context, and `extras()` reports what it measured. None: nothing to meter, no extra step."""
        return None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this rank keeps from one step to the next for training, local shards only:
        the model's parameters, their gradients, and everything the optimizer owns (its state, and
        any copies it steps on instead of the parameters: master weights, flat shards and their
        gradients). Counted by `bench.metrics.memory.state_bytes` (each storage once, first in
        params, then grads, then optimizer), the same rule for every backend."""
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": optimizer_tensors(self.optimizer)}

    def extras(self) -> dict:
        """Backend-specific row columns (numbers are averaged over ranks, the rest taken from rank 0)."""
        return {}

    def named_full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every parameter whole and named as in the single-process GPT (tp shards concatenated, ZeRO and
        FSDP partitions gathered, pipeline stages merged), on rank 0; None on the other ranks. A
        collective: call it on every rank. The parity tests compare these across layouts and backends."""
        return on_rank0({name: t.detach().clone() for name, t in self.whole_stage_parameters()}, self.ctx.groups)

    def whole_stage_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(GPT name, tensor) for each parameter of this rank's stages, whole across tp and data-parallel
        partitions (collective where the backend must gather them). By default: the model's own."""
        return iter(self.model.named_parameters())

    def close(self) -> None:
        pass


def whole_over_tp(name: str, t: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """A native tensor-parallel shard of parameter `name` (or of its gradient) concatenated over the tp
    group along the dimension the model splits it on; a replicated tensor as it is. Collective over tp."""
    tp = groups.size("tp")
    dim = split_dim(name) if tp > 1 else None
    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=dim)


def whole_over_ep(name: str, t: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """An expert stack (this ep rank's whole experts, bench.expert_parallel) concatenated over the ep group
    into all E experts; anything else as it is. Collective over ep."""
    if groups.ep is None or role_spec(name).ep != "expert":
        return t
    parts = [torch.empty_like(t) for _ in range(groups.size("ep"))]
    dist.all_gather(parts, t.contiguous(), group=groups.ep)
    return torch.cat(parts)


def whole(name: str, t: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """A native shard of parameter `name` (or of its gradient) whole over tp and ep. Collective."""
    return whole_over_ep(name, whole_over_tp(name, t, groups), groups)


def on_rank0(local: dict, groups: ProcessGroups) -> dict | None:
    """The union, on rank 0, of the dicts of the ranks holding a whole copy of their stage (dp 0, tp 0);
    None elsewhere. Collective over every rank."""
    everyone = [None] * dist.get_world_size() if groups.rank == 0 else None
    dist.gather_object(local if groups.coord.dp == 0 and groups.coord.tp == 0 else {}, everyone, dst=0)
    if groups.rank != 0:
        return None
    return {k: v for part in everyone for k, v in part.items()}
