"""Parity harness: the native engine on any layout against the single-process reference.

`reference(cfg)` trains the whole model in this process on the whole global batch.
`run_layouts(world, cfgs)` starts `world` gloo processes once and, for each config in turn, builds
the engine, runs `steps` optimizer steps and returns the global mean loss of every step plus the
step-1 gradient of every parameter, reassembled from its tp shards and pipeline stages on rank 0,
and the communication of one more step counted as the worker counts it (averaged over ranks).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

import torch
import torch.distributed as dist

from bench.data import global_batch
from bench.metrics.comm import CommCounter
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


def full_gradients(trainer, groups) -> dict | None:
    """Every parameter's gradient, tp shards concatenated, all stages merged: on rank 0 only."""
    from bench.native.tensor import split_dim
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


def _rank_main(rank: int, world: int, port: int, cfgs: list[dict], steps: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from bench.config import RunConfig
    try:
        dist.init_process_group("gloo")
        for i, cfg in enumerate(cfgs):
            result = _one_layout(RunConfig.from_dict(cfg), steps)
            if rank == 0:  # numpy: torch tensors would travel as shared memory that dies with this process
                grads = result["grads"]
                result["grads"] = grads and {k: v.numpy() for k, v in grads.items()}
                out.put((i, result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((-1, f"rank {rank}: {traceback.format_exc()}"))


def run_layouts(world: int, cfgs: list, steps: int = 3, timeout_s: float = 600) -> list[dict]:
    """Run every config (all of world size `world`) in one set of `world` processes."""
    from bench.sweep.local import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, [c.to_dict() for c in cfgs], steps, out),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(cfgs):
            try:
                i, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"parity job failed: exit codes {dead} (or timeout {timeout_s} s)")
                continue
            if i < 0:
                raise RuntimeError(payload)
            if payload["grads"] is not None:
                payload["grads"] = {k: torch.from_numpy(v) for k, v in payload["grads"].items()}
            results[i] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[i] for i in range(len(cfgs))]
