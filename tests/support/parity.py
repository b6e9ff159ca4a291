"""Parity harness: any backend on any layout against the single-process reference.

`reference(cfg)` trains the whole model in this process on the whole global batch.
`run_layouts(pool, cfgs)` runs, on a warm `RankPool` of the configs' world size, each config in turn
(any backend): it builds the engine, runs `steps` optimizer steps and returns the global mean loss of
every step, the native engine's step-1 gradient of every parameter reassembled from its tp shards and
pipeline stages on rank 0 (None under ZeRO, whose reduced gradients live in the optimizer's shards, and
on the other backends), the gradient the optimizer applied (below) and the communication of one more
step counted as the worker counts it.
`applied_gradients(pool, cfgs)` does, for any backend, what every layout can expose: one step of plain
SGD (the test-only fault `sgd:LR`, bench.worker.optimizer_faults) from the reference weights, after
which (θ₀ − θ₁)/LR is exactly the gradient the optimizer received — after tp, pp and dp reduction and
ZeRO/FSDP partitioning — reassembled whole from every rank's parameters (`Trainer.named_full_parameters`). Unlike a loss after Adam
steps (Adam is invariant to a constant gradient scale) it sees a gradient off by any factor.
`deepspeed_gradients(pool, cfgs)`: DeepSpeed's own reduced gradient (`safe_get_full_grad`) at its
optimizer boundary, reassembled the same way; `deepspeed_runs` adds the losses of a few steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bench.data import global_batch
from bench.distributed import rank_session
from bench.metrics.comm import CommCounter
from bench.training import make_optimizer, on_rank0, whole_over_tp
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


def each_config(cfg_dicts: list[dict], body, *args) -> list | None:
    """Rank body of a pool call: `body(cfg, trainer, groups, *args)` for each config on its own trainer,
    in one rank session; the values on rank 0, None on the others."""
    from bench.config import RunConfig
    with rank_session("cpu"):
        results = [_with_trainer(RunConfig.from_dict(c), body, *args) for c in cfg_dicts]
    return results if results[0] is not None else None


def _applied_on_rank(cfg_dicts: list[dict], lr: float) -> list[dict] | None:
    return each_config(cfg_dicts, _sgd_step, lr)


def _sgd_step(cfg, trainer, groups, lr: float) -> dict | None:
    from bench.worker import optimizer_faults
    with optimizer_faults(f"sgd:{lr}" if cfg.fault == "none" else f"{cfg.fault},sgd:{lr}"):
        trainer.train(trainer.batch(0))
    theta = trainer.named_full_parameters()
    return theta and {k: v.numpy() for k, v in theta.items()}


def _with_trainer(cfg, body, *args):
    """`body(cfg, trainer, groups, *args)` on the trainer every run gets (bench.worker.trainer_on_rank);
    its value on rank 0."""
    from bench.worker import trainer_on_rank
    with trainer_on_rank(cfg, torch.device("cpu")) as (trainer, groups):
        return body(cfg, trainer, groups, *args)


# --- DeepSpeed: its own view of the reduced gradient ---------------------------------------------------
def deepspeed_gradients(pool, cfgs: list, timeout_s: float = 600) -> list[dict]:
    """DeepSpeed configs: every parameter's gradient as DeepSpeed hands it to its optimizer step — read
    with `deepspeed.utils.safe_get_full_grad` (ZeRO 0-3, its pipeline: after the reduction, partitions
    gathered) when its ZeRO optimizer's step begins — reassembled whole on rank 0."""
    return [run["grads"] for run in deepspeed_runs(pool, cfgs, steps=1, timeout_s=timeout_s)]


def deepspeed_runs(pool, cfgs: list, steps: int = 3, timeout_s: float = 600) -> list[dict]:
    """DeepSpeed configs trained `steps` steps from the reference weights: {"losses": the global mean loss
    of every step, "grads": DeepSpeed's reduced step-1 gradients (as `deepspeed_gradients`)}."""
    runs = pool.call(_ds_runs_on_rank, [c.to_dict() for c in cfgs], steps, timeout_s=timeout_s)[0]
    return [{**run, "grads": {k: torch.from_numpy(v) for k, v in run["grads"].items()}} for run in runs]


def _ds_runs_on_rank(cfg_dicts: list[dict], steps: int) -> list[dict] | None:
    return each_config(cfg_dicts, _ds_train, steps)


def _ds_train(cfg, trainer, groups, steps: int) -> dict | None:
    """DeepSpeed's own view, so this one reads its engine: the gradient `safe_get_full_grad` returns at the
    first optimizer boundary (reduced, partitions gathered, not yet applied), and every step's loss."""
    from deepspeed.utils import safe_get_full_grad
    from bench.backends.deepspeed import gpt_name
    named, opt = list(trainer.engine.module.named_parameters()), trainer.engine.optimizer
    seen: dict = {}
    step = opt.step

    def read_then_step(*args, **kwargs):
        if not seen:
            seen.update((gpt_name(n, cfg.pp), safe_get_full_grad(p).detach().clone()) for n, p in named)
        return step(*args, **kwargs)
    opt.step = read_then_step
    losses = []
    for i in range(steps):
        loss = trainer.train(trainer.batch(i))
        losses.append(_global_loss(None if loss is None else loss.item()))
    grads = on_rank0({name: whole_over_tp(name, g, groups).clone() for name, g in seen.items()}, groups)
    return grads and {"losses": losses, "grads": {k: v.numpy() for k, v in grads.items()}}


# --- any backend: losses, gradients and communication ----------------------------------------------
def run_layouts(pool, cfgs: list, steps: int = 3, timeout_s: float = 600) -> list[dict]:
    """Run every config (all of the pool's world size) on `pool`, one call for all of them."""
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
    with rank_session("cpu"):
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
        if step == 0 and cfg.backend == "native" and not cfg.zero:  # under ZeRO they are the optimizer's shards
            grads = trainer.named_full_gradients()
    with CommCounter.for_groups(groups) as counter:  # as the worker counts: one extra step
        trainer.train(trainer.batch(steps))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counter.totals())
    keys = {k for c in every for k in c}
    comm = {k: sum(c.get(k, 0) for c in every) / len(every) for k in keys}  # averaged over ranks
    if groups.rank != 0:
        return None
    return {"losses": losses, "grads": grads and {k: v.numpy() for k, v in grads.items()}, "comm": comm}


def _global_loss(loss: float | None) -> float:
    """Mean of the per-replica losses (each replica's last-stage ranks report the same value)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, loss)
    seen = [v for v in values if v is not None]
    return sum(seen) / len(seen)
