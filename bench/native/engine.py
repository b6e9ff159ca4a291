"""Native engine (data parallel only for now): full model per rank, gradients averaged over dp."""
from __future__ import annotations

import torch
import torch.distributed as dist

from bench.backends.base import RunContext, Trainer, make_optimizer
from bench.data import micro_batches
from models import build_model, loss_fn


class NativeTrainer(Trainer):
    def __init__(self, ctx: RunContext):
        if ctx.cfg.tp > 1 or ctx.cfg.pp > 1:
            raise NotImplementedError("native tensor/pipeline parallel is not built yet")
        self.ctx = ctx
        self.model = build_model(ctx.cfg.model_config, ctx.cfg.seed, ctx.device)
        self.optimizer = make_optimizer(self.model.parameters())

    def train_step(self, step: int) -> float:
        cfg, ctx = self.ctx.cfg, self.ctx
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in micro_batches(cfg, step, ctx.groups.coord.dp):
            x, y = x.to(ctx.device), y.to(ctx.device)
            with torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype, enabled=ctx.autocast_dtype is not None):
                loss = loss_fn(self.model(x), y) / cfg.micro_batches
            loss.backward()
            total += loss.item()
        if cfg.dp > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=ctx.groups.dp)
                p.grad /= cfg.dp
        self.optimizer.step()
        return total


def build(cfg, ctx: RunContext) -> Trainer:
    return NativeTrainer(ctx)
