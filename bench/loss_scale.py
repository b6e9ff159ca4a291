"""Dynamic loss scaling for `fp16-mixed`, the one scaler of the native, ddp and fsdp backends (DeepSpeed
uses its own fp16 section).

fp16 has 5 exponent bits: gradients below 2⁻²⁴ flush to zero. The loss is multiplied by `scale` before
backward, so every gradient is `scale` times larger; before the optimizer step the gradients it will
apply are divided by `scale` again and checked for inf/NaN. A step with a non-finite gradient is skipped
(no update) and the scale is halved; after `growth_interval` good steps in a row it is doubled
(Micikevicius et al. 2018, "Mixed Precision Training"; torch.amp.GradScaler's policy and defaults).

Why not torch.amp.GradScaler: it checks only the gradients this rank holds and never asks the others.
Under tensor or pipeline parallel, FSDP and ZeRO-1 each rank holds different gradients (other layers,
other shards), so one rank could skip a step that the others take and the replicas would diverge. Here
the verdict is all-reduced (max) over the world whenever the ranks' gradients differ: one 4-byte
all-reduce per step. Deciding whether to step reads that verdict on the host: one host sync per step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaler:
    def __init__(self, group=None, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, device: torch.device | str = "cpu"):
        self.group = group
        """Ranks that must agree on skipping (None: this rank's gradients are every rank's)."""
        self.device = torch.device(device)
        """The rank's device, where the verdict lives."""
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0
        """Optimizer steps skipped so far (the row's `skipped_steps`)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss * self.scale

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients `optimizer` will apply, then step it unless one (on any rank of the group)
        is inf/NaN; update the scale. True when the optimizer stepped."""
        grads = optimizer_grads(optimizer)
        found_inf = unscale_(grads, 1.0 / self.scale, self.device)
        if self.group is not None:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        ok = not bool(found_inf.item())  # the one host sync: whether to step is a host decision
        if ok:
            optimizer.step()
        self.update(ok)
        return ok

    def update(self, ok: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` good steps in a row."""
        if not ok:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def optimizer_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The local gradients the optimizer applies (a DTensor's local shard; ZeRO-1's flat shard)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = p.grad
                out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def unscale_(grads: list[torch.Tensor], inv_scale: float, device: torch.device) -> torch.Tensor:
    """Multiply every gradient by `inv_scale` in place; a 1-element float tensor on `device` (the rank's:
    the vote's all-reduce needs it there, even on a rank without gradients), 1 when any is inf/NaN."""
    found_inf = torch.zeros(1, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    inv = torch.full((1,), inv_scale, device=device)
    for same in by_dtype.values():  # one fused kernel per dtype: check for inf/NaN, then scale
        torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv)
    return found_inf


def loss_scaler(ctx, ranks_differ: bool) -> LossScaler | None:
    """The run's scaler: one for fp16-mixed (None otherwise). `ranks_differ`: the ranks' gradients are not
    replicas of each other (tp or pp > 1, or sharded over dp), so they vote on skipping over the world."""
    from bench.capabilities import NEEDS_LOSS_SCALER
    if ctx.cfg.dtype not in NEEDS_LOSS_SCALER:
        return None
    return LossScaler(group=dist.group.WORLD if ranks_differ and ctx.groups.layout.world_size > 1 else None,
                      device=ctx.device)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: LossScaler | None) -> None:
    """The trainers' optimizer step: plain, or through the loss scaler."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
