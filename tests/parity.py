"""Parity harness: any backend on any layout against the single-process reference.

`reference(cfg)` trains the whole model in this process on the whole global batch.
`run_layouts(pool, cfgs)` runs, on a warm `RankPool` of the configs' world size, each native config in
turn: it builds the engine, runs `steps` optimizer steps and returns the global mean loss of every step,
the step-1 gradient of every parameter reassembled from its tp shards and pipeline stages on rank 0
(None under ZeRO, whose reduced gradients live in the optimizer's shards), the gradient the optimizer
applied (below) and the communication of one more step counted as the worker counts it.
`applied_gradients(pool, cfgs)` does, for any backend, what every layout can expose: one step of plain
SGD (the test-only fault `sgd:LR`, bench.worker.optimizer_faults) from the reference weights, after
which (θ₀ − θ₁)/LR is exactly the gradient the optimizer received — after tp, pp and dp reduction and
ZeRO/FSDP partitioning — reassembled whole from every rank's parameters. Unlike a loss after Adam
steps (Adam is invariant to a constant gradient scale) it sees a gradient off by any factor.
`deepspeed_gradients(pool, cfgs)`: DeepSpeed's own reduced gradient (`safe_get_full_grad`) at its
optimizer boundary, reassembled the same way.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from bench.data import global_batch
from bench.metrics.comm import CommCounter
from bench.surgery import split_dim
from bench.training import make_optimizer
from models import build_model, loss_fn

SGD_LR = 1.0  # θ₀ − θ₁ = grad itself: fp32 rounding of θ (|θ| ~ 0.02) stays far below atol
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)  # the native tests' gradient tolerance (fp32)


def reference(cfg, steps: int = 3) -> dict:
    """Single process, full model, full global batch: losses per step, step-1 gradients, initial weights."""
    m = cfg.model_config
    model = build_model(m, cfg.seed)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
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
    return {"losses": losses, "grads": grads, "initial": initial}


def gradient_mismatches(name: str, got: dict | None, ref: dict) -> list[str]:
    """One line per parameter whose gradient is not the reference's (or a line if none were returned)."""
    if got is None:
        return [f"{name}: no gradients returned"]
    if set(got) != set(ref):
        return [f"{name}: parameters {sorted(set(got) ^ set(ref))} on one side only"]
    out = []
    for pname, g in ref.items():
        try:
            torch.testing.assert_close(got[pname], g, **GRAD_TOL)
        except AssertionError as e:
            out.append(f"{name}: grad {pname}: " + "; ".join(str(e).splitlines()[2:4]))
    return out


# --- any backend: the gradient one plain-SGD step applied -------------------------------------------
def applied_gradients(pool, cfgs: list, lr: float = SGD_LR, timeout_s: float = 600) -> list[dict]:
    """(θ₀ − θ₁)/lr per parameter after one SGD step of each config (same world size as `pool`);
    θ₀ = the reference initial weights, shared by every layout."""
    thetas = pool.call(_applied_on_rank, [c.to_dict() for c in cfgs], lr, timeout_s=timeout_s)[0]
    out = []
    for cfg, theta in zip(cfgs, thetas):
        initial = {n: p.detach() for n, p in build_model(cfg.model_config, cfg.seed).named_parameters()}
        out.append({k: (initial[k] - torch.from_numpy(v)) / lr for k, v in theta.items()})
    return out


def _applied_on_rank(cfg_dicts: list[dict], lr: float) -> list[dict] | None:
    from bench.config import RunConfig
    with _default_group():
        results = [_with_trainer(RunConfig.from_dict(c), _sgd_step, lr) for c in cfg_dicts]
    return results if results[0] is not None else None


def _sgd_step(cfg, trainer, groups, lr: float) -> dict | None:
    from bench.worker import optimizer_faults
    with optimizer_faults(f"sgd:{lr}" if cfg.fault == "none" else f"{cfg.fault},sgd:{lr}"):
        trainer.train(trainer.batch(0))
    theta = full_parameters(trainer, groups)
    return theta and {k: v.numpy() for k, v in theta.items()}


@contextmanager
def _default_group():
    """The default group for one pool call (its port is the call's): every config builds its groups on it."""
    from bench.distributed import setup_rank, shutdown
    setup_rank("cpu")
    try:
        yield
    finally:
        shutdown()


def _with_trainer(cfg, body, *args):
    """`body(cfg, trainer, groups, *args)` on this config's own process groups and backend trainer, built
    as the worker builds them (seeded); its value on rank 0."""
    from bench.backends.registry import get_backend
    from bench.distributed import ProcessGroups
    from bench.layout import Layout
    from bench.training import RunContext
    torch.manual_seed(cfg.seed)
    groups = ProcessGroups.build(Layout(cfg.tp, cfg.pp, cfg.dp, cfg.order))
    trainer = get_backend(cfg.backend).build(cfg, RunContext(cfg, groups, torch.device("cpu")))
    try:
        return body(cfg, trainer, groups, *args)
    finally:
        trainer.close()


def full_parameters(trainer, groups) -> dict | None:
    """Every parameter whole (tp shards concatenated, ZeRO/FSDP partitions gathered, stages merged),
    named as in the single-process GPT: on rank 0 only."""
    return _whole(_local_parameters(trainer), groups)


def _whole(named, groups) -> dict | None:
    """(GPT name, local tensor, is a native tp shard) of every rank → every tensor whole, on rank 0."""
    local = {}
    for name, p, tp_sharded in named:
        t = p.detach().contiguous()
        dim = split_dim(name)
        if tp_sharded and dim is not None and groups.size("tp") > 1:
            parts = [torch.empty_like(t) for _ in range(groups.size("tp"))]
            dist.all_gather(parts, t, group=groups.tp)  # tp × shard → full along `dim`
            t = torch.cat(parts, dim=dim)
        local[name] = t.clone()
    return _merge_on_rank0(local, groups)


def _local_parameters(trainer):
    """(GPT name, this rank's tensor, whether it is a native tp shard) for every local parameter.
    Collective where the backend keeps partitions (FSDP's DTensors, ZeRO-3): call on every rank."""
    backend = trainer.ctx.cfg.backend
    if backend == "native":
        for chunk in trainer.par.chunks:
            yield from ((n, p, True) for n, p in chunk.named_parameters())
    elif backend == "ddp":
        yield from ((n, p, False) for n, p in trainer.model.named_parameters())
    elif backend == "fsdp":  # DTensors over the dp (and tp) mesh: full_tensor gathers both
        for chunk in trainer.chunks:
            yield from ((n, p.full_tensor() if hasattr(p, "full_tensor") else p, False)
                        for n, p in chunk.named_parameters())
    elif backend == "deepspeed":
        yield from _deepspeed_parameters(trainer)
    else:
        raise ValueError(f"no parameter reassembly for backend {backend}")


def _deepspeed_parameters(trainer):
    """DeepSpeed: ZeRO ≤ 2 keeps whole parameters in the module; ZeRO-3's partitions are gathered.
    PipelineModule names are `<layer index>.<piece name>...`; the piece names are the GPT's (blocks
    under their index)."""
    import deepspeed
    module, cfg = trainer.engine.module, trainer.ctx.cfg
    named = list(module.named_parameters())
    if cfg.zero == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            named = [(n, p.detach().clone()) for n, p in named]
    for name, p in named:
        yield _gpt_name(name, cfg), p, True


def _gpt_name(name: str, cfg) -> str:
    if cfg.pp == 1:
        return name
    rest = name.split(".", 1)[1]
    return f"blocks.{rest}" if rest[0].isdigit() else rest


# --- DeepSpeed: its own view of the reduced gradient ---------------------------------------------------
def deepspeed_gradients(pool, cfgs: list, timeout_s: float = 600) -> list[dict]:
    """DeepSpeed configs: every parameter's gradient as DeepSpeed hands it to its optimizer step — read
    with `deepspeed.utils.safe_get_full_grad` (ZeRO 0-3, its pipeline: after the reduction, partitions
    gathered) when its ZeRO optimizer's step begins — reassembled whole on rank 0."""
    grads = pool.call(_ds_grads_on_rank, [c.to_dict() for c in cfgs], timeout_s=timeout_s)[0]
    return [{k: torch.from_numpy(v) for k, v in g.items()} for g in grads]


def _ds_grads_on_rank(cfg_dicts: list[dict]) -> list[dict] | None:
    from bench.config import RunConfig
    with _default_group():
        results = [_with_trainer(RunConfig.from_dict(c), _ds_grads_at_step) for c in cfg_dicts]
    return results if results[0] is not None else None


def _ds_grads_at_step(cfg, trainer, groups) -> dict | None:
    from deepspeed.utils import safe_get_full_grad
    named, opt = list(trainer.engine.module.named_parameters()), trainer.engine.optimizer
    seen: list = []
    step = opt.step

    def read_then_step(*args, **kwargs):  # the optimizer boundary: gradients reduced, not yet applied
        seen.extend((_gpt_name(n, cfg), safe_get_full_grad(p).detach().clone(), True) for n, p in named)
        return step(*args, **kwargs)
    opt.step = read_then_step
    trainer.train(trainer.batch(0))
    grads = _whole(seen, groups)
    return grads and {k: v.numpy() for k, v in grads.items()}


def _merge_on_rank0(local: dict, groups) -> dict | None:
    """Merge the dicts of the ranks that hold a whole copy of their stage (dp 0, tp 0) on rank 0."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local if groups.coord.dp == 0 and groups.coord.tp == 0 else {})
    if groups.rank != 0:
        return None
    return {k: v for part in everyone for k, v in part.items()}


# --- the native engine: losses, gradients and communication ------------------------------------------
def run_layouts(pool, cfgs: list, steps: int = 3, timeout_s: float = 600) -> list[dict]:
    """Run every native config (all of the pool's world size) on `pool`, one call for all of them."""
    results = pool.call(_layouts_on_rank, [c.to_dict() for c in cfgs], steps, timeout_s=timeout_s)[0]
    for cfg, result in zip(cfgs, results):  # numpy on the way (see bench.spawn), tensors again here
        for key in ("grads", "applied"):
            if result[key] is not None:
                result[key] = {k: torch.from_numpy(v) for k, v in result[key].items()}
        initial = {n: p.detach() for n, p in build_model(cfg.model_config, cfg.seed).named_parameters()}
        result["applied"] = {k: (initial[k] - v) / SGD_LR for k, v in result["applied"].items()}
    return results


def _layouts_on_rank(cfg_dicts: list[dict], steps: int) -> list[dict] | None:
    """Body of every rank: each config on its own process groups; rank 0 returns the results."""
    from bench.config import RunConfig
    results = []
    with _default_group():
        for c in cfg_dicts:
            cfg = RunConfig.from_dict(c)
            result = _with_trainer(cfg, _train_and_count, steps)
            applied = _with_trainer(cfg, _sgd_step, SGD_LR)
            results.append(result and {**result, "applied": applied})
    return results if results[0] is not None else None


def _train_and_count(cfg, trainer, groups, steps: int) -> dict | None:
    losses, grads = [], None
    for step in range(steps):
        loss = trainer.train(trainer.batch(step))
        losses.append(_global_loss(None if loss is None else loss.item()))
        if step == 0 and not cfg.zero:  # under ZeRO the reduced gradients are the optimizer's shards
            grads = full_gradients(trainer, groups)
    with CommCounter(dim_of=groups.dim_of) as counter:  # as the worker counts: one extra step
        trainer.train(trainer.batch(steps))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counter.totals())
    keys = {k for c in every for k in c}
    comm = {k: sum(c.get(k, 0) for c in every) / len(every) for k in keys}  # averaged over ranks
    if groups.rank != 0:
        return None
    return {"losses": losses, "grads": grads and {k: v.numpy() for k, v in grads.items()}, "comm": comm}


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
    return _merge_on_rank0(local, groups)


def _global_loss(loss: float | None) -> float:
    """Mean of the per-replica losses (each replica's last-stage ranks report the same value)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, loss)
    seen = [v for v in values if v is not None]
    return sum(seen) / len(seen)
