"""`ddp`: torch DistributedDataParallel over the dp group, the plain data-parallel baseline.

Every rank holds the whole model (built from the shared init, so no broadcast is needed for
parity, though DDP still broadcasts once at construction). Gradients are all-reduced once per step
in buckets of `bucket_mb` MiB; micro-batches before the last accumulate locally under `no_sync`.
recompute and compile: `bench.surgery.transform_blocks`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from bench.loss_scale import loss_scaler, optimizer_step
from bench.surgery import transform_blocks
from bench.training import Batch, RunContext, Trainer, make_optimizer
from models import build_model, loss_fn


class DDPTrainer(Trainer):
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        cfg = ctx.cfg
        self.model = build_model(cfg.model_config, cfg.seed, ctx.device)
        transform_blocks(self.model, cfg)  # recompute, compile
        self.ddp = DistributedDataParallel(self.model, process_group=ctx.groups.dp, bucket_cap_mb=cfg.bucket_mb,
                                           device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        self.optimizer = make_optimizer(self.model.parameters())
        self.scaler = loss_scaler(ctx, ranks_differ=False)  # fp16-mixed; DDP's gradients are replicas

    def train(self, batch: Batch) -> torch.Tensor:
        ctx = self.ctx
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for i, (x, y) in enumerate(batch):  # (micro_batch, seq)
            last = i == len(batch) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():  # all-reduce on the last only
                with torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype,
                                    enabled=ctx.autocast_dtype is not None):
                    loss = loss_fn(self.ddp(x), y) / len(batch)
                (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
            losses.append(loss.detach())
        optimizer_step(self.optimizer, self.scaler)
        return torch.stack(losses).sum()  # on the device: the worker reads it after the timed window

    def extras(self) -> dict:
        return {"dp_impl": "torch DDP", **({"skipped_steps": self.scaler.skipped} if self.scaler else {})}


def build(ctx: RunContext) -> Trainer:
    return DDPTrainer(ctx)
