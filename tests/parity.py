"""Parity harness: the native engine on any layout against the single-process reference.

`reference(cfg)` trains the whole model in this process on the whole global batch.
`run_layouts(pool, cfgs)` runs, on a warm `RankPool` of the configs' world size, each config in turn:
it builds the engine, runs `steps` optimizer steps and returns the global mean loss of every step plus
the step-1 gradient of every parameter, reassembled from its tp shards and pipeline stages on rank 0,
and the communication of one more step counted as the worker counts it (averaged over ranks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bench.data import global_batch
from bench.metrics.comm import CommCounter
from bench.surgery import split_dim
from bench.training import make_optimizer
from models import build_model, loss_fn


def reference(cfg, steps: int = 3) -> dict:
    """Single process, full model, full global batch: losses per step and step-1 gradients."""
    m = cfg.model_config
    model = build_model(m, cfg.seed)
    opt = make_optimizer(model.parameters())
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(cfg.seed, step, cfg.global_batch, cfg.seq, m.vocab)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads}


def run_layouts(pool, cfgs: list, steps: int = 3, timeout_s: float = 600) -> list[dict]:
    """Run every config (all of the pool's world size) on `pool`, one call for all of them."""
    results = pool.call(_layouts_on_rank, [c.to_dict() for c in cfgs], steps, timeout_s=timeout_s)[0]
    for result in results:  # numpy on the way (see bench.spawn), tensors again here
        if result["grads"] is not None:
            result["grads"] = {k: torch.from_numpy(v) for k, v in result["grads"].items()}
    return results


def _layouts_on_rank(cfg_dicts: list[dict], steps: int) -> list[dict] | None:
    """Body of every rank: each config on its own process groups; rank 0 returns the results."""
    from bench.config import RunConfig
    from bench.distributed import init_from_env, shutdown
    rank, _ = init_from_env(torch.device("cpu"))
    try:
        results = [_one_layout(RunConfig.from_dict(c), steps) for c in cfg_dicts]
    finally:
        shutdown()
    if rank != 0:
        return None
    for result in results:
        grads = result["grads"]
        result["grads"] = grads and {k: v.numpy() for k, v in grads.items()}
    return results


def _one_layout(cfg, steps: int) -> dict:
    from bench.distributed import ProcessGroups
    from bench.layout import Layout
    from bench.native.engine import NativeTrainer
    from bench.training import RunContext
    groups = ProcessGroups.build(Layout(cfg.tp, cfg.pp, cfg.dp, cfg.order))
    trainer = NativeTrainer(RunContext(cfg, groups, torch.device("cpu")))
    losses, grads = [], None
    for step in range(steps):
        loss = trainer.train(trainer.batch(step))
        losses.append(_global_loss(None if loss is None else loss.item()))
        if step == 0 and not cfg.zero:
            grads = full_gradients(trainer, groups)
    with CommCounter(dim_of=groups.dim_of) as counter:  # as the worker counts: one extra step
        trainer.train(trainer.batch(steps))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counter.totals())
    keys = {k for c in every for k in c}
    comm = {k: sum(c.get(k, 0) for c in every) / len(every) for k in keys}  # averaged over ranks
    return {"losses": losses, "grads": grads, "comm": comm}


def full_gradients(trainer, groups) -> dict | None:
    """Every parameter's gradient, tp shards concatenated, all stages merged: on rank 0 only."""
    tp = groups.size("tp")
    local = {}
    for chunk in trainer.par.chunks:
        for name, p in chunk.named_parameters():
            g, dim = p.grad.detach().contiguous(), split_dim(name)
            if dim is not None and tp > 1:
                parts = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(parts, g, group=groups.tp)  # tp × shard → full along `dim`
                g = torch.cat(parts, dim=dim)
            local[name] = g
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local if groups.coord.dp == 0 and groups.coord.tp == 0 else {})
    if groups.rank != 0:
        return None
    return {k: v for part in everyone for k, v in part.items()}


def _global_loss(loss: float | None) -> float:
    """Mean of the per-replica losses (each replica's last-stage ranks report the same value)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, loss)
    seen = [v for v in values if v is not None]
    return sum(seen) / len(seen)
