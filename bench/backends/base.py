"""What every backend builds: a Trainer over the shared model, with the same optimizer and data."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from bench.config import RunConfig
from bench.distributed import ProcessGroups
from bench.metrics.memory import optimizer_tensors

# One optimizer for every backend, so losses are comparable (torch AdamW; DeepSpeed takes it as client).
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW)


@dataclass
class RunContext:
    cfg: RunConfig
    groups: ProcessGroups
    device: torch.device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.cfg.dtype)


class Trainer(ABC):
    """One backend's training loop on this rank.

    Contract: `train_step(step)` runs one optimizer step on the global batch of `step` (the rank
    takes its share through `bench.data.micro_batches`) and returns the mean loss this rank computed
    over its data-parallel shard, or None if it computed none (e.g. a non-last pipeline stage).
    Gradients are zeroed at the start of a step, so after it they are still there to be counted.
    """

    @abstractmethod
    def train_step(self, step: int) -> float | None: ...

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Local tensors of the model state: params, grads and optimizer state (shards, not full)."""
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": optimizer_tensors(self.optimizer)}

    def extras(self) -> dict:
        """Backend-specific row columns (numbers are averaged over ranks, the rest taken from rank 0)."""
        return {}

    def close(self) -> None:
        pass
