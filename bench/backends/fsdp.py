"""`fsdp`: PyTorch FSDP2 (`fully_shard`) on the shared GPT, with DTensor TP and torch pipelining.

Applied in the fixed order TP → PP → (recompute, compile) → DP (torchtitan-style), on one DeviceMesh built
from our Layout:
- TP: `parallelize_module` on the mesh's tp dim: qkv and fc1 Colwise, proj and fc2 Rowwise, as the model's
  parameter table declares them column / row (`block_tp_plan`). The fused qkv is laid out (kv_heads,
  group + 2, head_dim), so a contiguous Colwise shard is whole query groups with their K/V head; tp
  divides kv_heads, checked by RunConfig. Embedding, norms and LM head stay replicated over tp (their
  grads are identical on every tp rank).
- PP: `torch.distributed.pipelining` stages cut from the GPT (embed on the first stage, norm + head on
  the last); gpipe → ScheduleGPipe, 1f1b → Schedule1F1B, interleaved → ScheduleInterleaved1F1B with
  `virtual_stages` chunks per rank (chunk j of pp rank r is stage r + j·pp).
- CP: every chunk's attention core becomes the ring over our cp group (`bench.context_parallel`), and its
  embedding and rotary take the global positions of the rank's zig-zag share (`sequence_share`), as in the
  native engine; the batch is already that share (`Trainer.batch`).
- DP: `fully_shard` per block, then on each model chunk (the root), over dp × cp (torchtitan's
  `dp_shard_cp`: the mesh's dp and cp dims flattened; just dp at cp = 1). Each cp rank's loss is the mean
  of its equal share of the tokens, so the reduce-scatter's average over dp·cp ranks is the whole batch's
  mean gradient:
    full     reshard_after_forward=True: all-gather in forward and again in backward (ZeRO-3)
    grad-op  reshard_after_forward=False: one all-gather per step, params kept until backward (ZeRO-2)
    hybrid   HSDP on a (replicate, shard) split of the dp ranks; shard = the dp ranks of one node,
             capped so at least 2 replicas remain (`hybrid_shape`), times cp
    none     FSDP2's `replicate` (DDP semantics on FSDP2's machinery): no sharding, one gradient
             all-reduce per block group, the DDP-equivalent baseline inside this backend
  recompute (selective: the attention core; full: every block) and compile (each block) come from
  `bench.surgery.transform_blocks`, which keeps parameter names.
  bf16-mixed = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute and all-gathers,
  fp32 gradient reduction and fp32 master shards.

Nothing is allocated before it is sharded: the GPT is built on meta, cut, parallelized, then each rank
fills its local DTensor shards from `init_value` (`bench.surgery.materialize`).

The DeviceMesh is built from our `Layout`, never from torch's default rank order, so every group torch
creates from it has exactly the ranks of one of our tp/pp/dp/dp_cp groups (or, for HSDP, a sub-group of
one), and the communication counter names it correctly. The ring uses our own cp group.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from bench.context_parallel import set_positions, use_ring_attention
from bench.data import sequence_share
from bench.layout import Layout
from bench.loss_scale import loss_scaler, optimizer_step
from bench.metrics.memory import optimizer_tensors
from bench.schedule import partition, rank_chunks
from bench.surgery import cut_stages, materialize, meta_module, transform_blocks
from bench.training import Batch, RunContext, Trainer, make_optimizer
from models import GPT, loss_fn
from models.config import block_table

RESHARD = {"full": True, "grad-op": False, "hybrid": True}


def blocks_of(chunk: nn.Module) -> list[nn.Module]:
    return list(chunk.blocks.values()) if isinstance(chunk.blocks, nn.ModuleDict) else list(chunk.blocks)


def apply_tp(chunk: nn.Module, tp_mesh, model_cfg) -> None:
    """Megatron's column → row split per block on the tp mesh: 2 all-reduces forward, 2 backward."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = block_tp_plan(model_cfg)
    for block in blocks_of(chunk):
        parallelize_module(block, tp_mesh, plan)


def block_tp_plan(model_cfg) -> dict:
    """The DTensor plan of a block, from the parameter table: Colwise for its column-parallel linears,
    Rowwise for its row-parallel ones. Embedding and head stay replicated (this backend's choice)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    style = {"column": ColwiseParallel, "row": RowwiseParallel}
    prefix = "blocks.0."
    return {s.name.removeprefix(prefix).removesuffix(".weight"): style[s.tp]()
            for s in block_table(model_cfg, 0) if s.name.endswith(".weight") and s.tp in style}


def apply_dp(chunk: nn.Module, strategy: str, dp_mesh, mp_policy) -> None:
    """Shard (or replicate) each block as its own communication group, then the rest at the root."""
    if strategy == "none":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in blocks_of(chunk):
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
        replicate(chunk, mesh=dp_mesh, mp_policy=mp_policy)
        return
    from torch.distributed.fsdp import fully_shard
    for block in blocks_of(chunk):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=RESHARD[strategy], mp_policy=mp_policy)
    # None = FSDP2's default for a root: keep its params after forward, backward needs them first.
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=None, mp_policy=mp_policy)


# --- the device mesh ---------------------------------------------------------------------------
def hybrid_shape(dp: int, dp_ranks_per_node: int) -> tuple[int, int]:
    """(replicate, shard) sizes of HSDP over `dp` ranks.

    Shard within a node (cheap all-gathers and reduce-scatters), replicate across nodes: the shard
    size is the largest divisor of dp that fits the dp ranks of one node and still leaves at least
    two replicas (a single replica would just be full sharding). dp = 2 → (2, 1); dp = 4 on one
    node → (2, 2); dp = 16 with 8 dp ranks per node → (2, 8).
    """
    if dp < 2:
        raise ValueError(f"hybrid sharding needs dp ≥ 2, got dp={dp}")
    shard = max(d for d in range(1, dp) if dp % d == 0 and d <= max(dp_ranks_per_node, 1))
    return dp // shard, shard


def dp_ranks_per_node(layout: Layout, rank: int) -> int:
    """How many ranks of this rank's dp group share its node (node size: LOCAL_WORLD_SIZE if set)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.gpus_per_node))
    node = rank // per_node
    return sum(1 for r in layout.group_of(rank, "dp") if r // per_node == node)


def device_mesh(layout: Layout, device: torch.device, hybrid: tuple[int, int] | None = None):
    """A DeviceMesh over the world, dims ("pp", "dp", "cp", "tp"), or ("pp", "dp_rep", "dp_shard", "cp", "tp").

    mesh[p, d, c, t] = layout.rank(dp=d, pp=p, tp=t, cp=c), so slicing a dim yields our own groups
    whatever the rank order. For HSDP the dp index splits as d = rep · shard + s (shard ranks contiguous).
    """
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor([[[[layout.rank(dp=d, pp=p, tp=t, cp=c) for t in range(layout.tp)]
                            for c in range(layout.cp)] for d in range(layout.dp)] for p in range(layout.pp)],
                         dtype=torch.int, device="cpu")  # the mesh's rank table is host data, whatever the device
    names = ("pp", "dp", "cp", "tp")
    if hybrid is not None:
        rep, shard = hybrid
        ranks = ranks.view(layout.pp, rep, shard, layout.cp, layout.tp)  # (pp, dp, cp, tp) → (pp, rep, shard, cp, tp)
        names = ("pp", "dp_rep", "dp_shard", "cp", "tp")
    return DeviceMesh(device.type, ranks, mesh_dim_names=names)


def data_mesh(mesh, hybrid: bool):
    """The mesh FSDP2 shards (or replicates) over: dp × cp flattened (at cp = 1 the dp dim itself), or for
    HSDP (dp_rep, dp_shard × cp): replicate across nodes, shard within a node and over the cp ring."""
    shard = ("dp_shard", "cp") if hybrid else ("dp", "cp")
    inner = mesh[shard]._flatten("_".join(shard)) if mesh["cp"].size() > 1 else mesh[shard[0]]
    return mesh["dp_rep", inner.mesh_dim_names[0]] if hybrid else inner


def reset_dtensor_caches() -> None:
    """Forget DTensor's process-wide caches of sharding and redistribution plans.

    They are keyed by meshes that compare equal across runs (same ranks, same dim names), so in a
    warm rank process a later run would reuse a plan bound to the previous run's destroyed groups
    ("Could not resolve the process group registered under the name …"). Call between runs."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


class FSDPTrainer(Trainer):
    def __init__(self, ctx: RunContext):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        reset_dtensor_caches()
        self.ctx = ctx
        cfg, layout, rank = ctx.cfg, ctx.groups.layout, ctx.groups.rank
        self.hybrid = (hybrid_shape(cfg.dp, dp_ranks_per_node(layout, rank)) if cfg.fsdp == "hybrid" else None)
        self.mesh = device_mesh(layout, ctx.device, self.hybrid)
        dp_mesh = data_mesh(self.mesh, hybrid=self.hybrid is not None)
        low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.dtype)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        # fp16-mixed: the ranks hold different shards (or layers), so they vote on skipping a step
        self.scaler = loss_scaler(ctx, ranks_differ=cfg.fsdp != "none" or cfg.tp > 1 or cfg.pp > 1)
        self.stage_ids = self._stage_ids()
        self.chunks = self._cut_chunks()
        for chunk in self.chunks:
            if cfg.tp > 1:
                apply_tp(chunk, self.mesh["tp"], cfg.model_config)
            if cfg.cp > 1:  # the rank's share of each sequence, at its global positions; attention over the ring
                use_ring_attention(chunk, ctx.groups.cp)
                set_positions(chunk, sequence_share(cfg, ctx.groups.coord.cp, ctx.device))
            transform_blocks(chunk, cfg)  # recompute, compile
            apply_dp(chunk, cfg.fsdp, dp_mesh, mp)
            materialize(chunk, cfg.model_config, cfg.seed, ctx.device)
        self.model = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.schedule = self._schedule() if cfg.pp > 1 else None
        self.optimizer = make_optimizer([p for c in self.chunks for p in c.parameters()])

    # --- construction ------------------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        cfg = self.ctx.cfg
        return cfg.pp * (cfg.virtual_stages if cfg.schedule == "interleaved" else 1)

    def _stage_ids(self) -> list[int]:
        cfg = self.ctx.cfg
        return rank_chunks(self.ctx.groups.coord.pp, cfg.pp, self.n_stages // cfg.pp)  # looped, as native

    def _cut_chunks(self) -> list[nn.Module]:
        """This rank's model chunks on meta: the whole GPT, or its pipeline stages (full-model names)."""
        m = self.ctx.cfg.model_config
        gpt = meta_module(lambda: GPT(m))
        if self.n_stages == 1:
            return [gpt]
        return cut_stages(gpt, partition(m.layers, self.n_stages), self.stage_ids)

    def _schedule(self):
        from torch.distributed import pipelining as tpp

        cfg, group = self.ctx.cfg, self.mesh["pp"].get_group()
        stages = [tpp.PipelineStage(c, i, self.n_stages, self.ctx.device, group=group)
                  for c, i in zip(self.chunks, self.stage_ids)]
        if cfg.schedule == "interleaved":
            return tpp.ScheduleInterleaved1F1B(stages, n_microbatches=cfg.micro_batches, loss_fn=self._loss)
        kind = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B}[cfg.schedule]
        return kind(stages[0], n_microbatches=cfg.micro_batches, loss_fn=self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss, whose backward it runs: scaled under fp16-mixed (`_pipeline_step` unscales
        the value it reports)."""
        loss = loss_fn(logits, targets)
        return self.scaler.scale_loss(loss) if self.scaler else loss

    # --- training ----------------------------------------------------------------------------
    def train(self, batch: Batch) -> torch.Tensor | None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._pipeline_step(batch) if self.schedule else self._local_step(batch)
        optimizer_step(self.optimizer, self.scaler)
        return loss

    def _local_step(self, batch: Batch) -> torch.Tensor:
        losses = []
        for i, (x, y) in enumerate(batch):
            if len(batch) > 1:  # reduce gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(batch) - 1)
            loss = loss_fn(self.model(x), y) / len(batch)
            (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
            losses.append(loss.detach())
        return torch.stack(losses).sum()  # on the device: the worker reads it after the timed window

    def _pipeline_step(self, batch: Batch) -> torch.Tensor | None:
        x = torch.cat([b[0] for b in batch])  # (micro_batches · micro_batch, seq)
        y = torch.cat([b[1] for b in batch])
        pp_rank, pp = self.ctx.groups.coord.pp, self.ctx.cfg.pp
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            self.schedule.step(x)  # first stage feeds tokens; the schedule splits them into micro-batches
        elif pp_rank == pp - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        if not losses:
            return None
        mean = torch.stack([l.detach().float() for l in losses]).mean()
        return mean / self.scaler.scale if self.scaler else mean  # the scale of this step's backward

    # --- measurement -------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = [p for c in self.chunks for p in c.parameters()]  # DTensors: counted by local shard
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": optimizer_tensors(self.optimizer)}

    def extras(self) -> dict:
        cfg = self.ctx.cfg
        ranks = cfg.dp * cfg.cp  # what FSDP shards (or replicates) over
        rep, shard = ((self.hybrid[0], ranks // self.hybrid[0]) if self.hybrid
                      else (ranks, 1) if cfg.fsdp == "none" else (1, ranks))
        return {"fsdp_replicate": rep, "fsdp_shard": shard, "dp_impl": f"FSDP2 {cfg.fsdp}",
                "tp_impl": "DTensor parallelize_module" if cfg.tp > 1 else None,
                "cp_impl": "ring (bench.context_parallel)" if cfg.cp > 1 else None,
                "pp_impl": f"torch.distributed.pipelining {cfg.schedule}" if cfg.pp > 1 else None,
                **({"skipped_steps": self.scaler.skipped} if self.scaler else {})}

    def whole_stage_parameters(self):
        for chunk in self.chunks:  # DTensors over the dp (and tp) mesh: full_tensor gathers both
            yield from ((n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in chunk.named_parameters())

    def close(self) -> None:
        reset_dtensor_caches()  # the next run in this process gets new groups


def build(ctx: RunContext) -> Trainer:
    return FSDPTrainer(ctx)
