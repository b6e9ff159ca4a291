"""The native engine: `parallelize` applies TP → PP → CP → DP to the shared GPT; the Trainer runs it.

Nothing is materialized before it is sharded: the GPT is built on the meta device, tensor parallel
swaps in local-shaped layers (still meta), the pipeline keeps only this rank's stages, and only
those are allocated and filled from `models.init_value`, sliced to this rank's shard (`bench.surgery`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from bench.context_parallel import set_positions, use_ring_attention
from bench.data import sequence_share
from bench.expert_parallel import apply_expert_parallel
from bench.loss_scale import loss_scaler, optimizer_step
from bench.native.data import DataParallel
from bench.native.pipeline import Pipeline, stage_layers_json
from bench.native.tensor import apply_tensor_parallel
from bench.schedule import partition, rank_chunks
from bench.surgery import Stage, cut_stages, materialize, transform_blocks
from bench.training import Batch, RunContext, Trainer, make_optimizer, on_rank0, whole
from models import GPT


@dataclass
class Parallel:
    chunks: list[Stage]
    """This rank's model chunks (one per virtual stage), each holding only local shards."""
    parts: list[list[int]]
    """Layers of every pipeline stage, in pipeline order (stage k runs on pp rank k mod pp)."""
    pipeline: Pipeline
    data: DataParallel


def parallelize(model: GPT, groups, cfg, device: torch.device, autocast_dtype=None) -> Parallel:
    """Tensor → expert → pipeline → data parallel on `model` (built on meta); materializes this rank's shards."""
    tp, tp_rank = groups.size("tp"), groups.coord.tp
    apply_tensor_parallel(model, cfg, groups.tp, tp_rank, tp)
    apply_expert_parallel(model, groups)
    p, v = groups.size("pp"), cfg.virtual_stages
    parts = partition(model.cfg.layers, p * v)
    chunks = cut_stages(model, parts, rank_chunks(groups.coord.pp, p, v))
    for chunk in chunks:
        if cfg.cp > 1:  # the rank's share of each sequence, at its global positions; attention over the ring
            use_ring_attention(chunk, groups.cp)
            set_positions(chunk, sequence_share(cfg, groups.coord.cp, device))
        transform_blocks(chunk, cfg)  # recompute, compile
        materialize(chunk, model.cfg, cfg.seed, device, tp_rank=tp_rank, tp=tp)
        if model.cfg.tie_embeddings and chunk.embed is not None and chunk.head is not None:
            chunk.head.weight = chunk.embed.tok.weight  # to_empty unties them
    pipeline = Pipeline(chunks, cfg, groups, device, autocast_dtype)
    return Parallel(chunks, parts, pipeline, DataParallel(chunks, cfg, groups))


class NativeTrainer(Trainer):
    def __init__(self, ctx: RunContext):
        cfg = ctx.cfg
        self.ctx = ctx
        with torch.device("meta"):
            meta = GPT(cfg.model_config)
        self.par = parallelize(meta, ctx.groups, cfg, ctx.device, ctx.autocast_dtype)
        self.model = nn.ModuleList(self.par.chunks)
        params = self.par.data.shard_params() if cfg.zero else self.model.parameters()
        self.optimizer = make_optimizer(params)
        # fp16-mixed: tp/pp ranks hold other layers' gradients, ZeRO-1 ranks other shards, ep ranks other experts
        self.scaler = loss_scaler(ctx, ranks_differ=cfg.tp > 1 or cfg.pp > 1 or cfg.zero > 0 or cfg.ep > 1)

    def train(self, batch: Batch) -> torch.Tensor | None:
        self.par.data.start_step()
        if self.scaler:
            self.par.pipeline.loss_scale = self.scaler.scale  # this step's (backed off or grown by the last)
        losses = self.par.pipeline.run(batch)
        self.par.data.finish()
        optimizer_step(self.optimizer, self.scaler)
        self.par.data.after_step()
        return torch.stack(losses).sum() if losses else None  # on the device: summed, never read here

    def meter(self):
        return self.par.pipeline.meter.metering()  # busy/idle around every compute section

    def whole_stage_parameters(self):
        for chunk in self.par.chunks:
            yield from ((name, whole(name, p.detach(), self.ctx.groups)) for name, p in chunk.named_parameters())

    def named_full_gradients(self) -> dict[str, torch.Tensor] | None:
        """Every parameter's reduced gradient whole, as `named_full_parameters` (outside ZeRO-1, whose
        reduced gradients are the optimizer's shards). A collective."""
        grads = {name: whole(name, p.grad.detach(), self.ctx.groups).clone()
                 for chunk in self.par.chunks for name, p in chunk.named_parameters()}
        return on_rank0(grads, self.ctx.groups)

    def extras(self) -> dict:
        return {"bubble_fraction": self.par.pipeline.meter.fraction,
                "stage_layers": stage_layers_json(self.par.parts),
                "dp_buckets": len(self.par.data.all_buckets),
                "tp_impl": "native", "cp_impl": "ring (bench.context_parallel)" if self.ctx.cfg.cp > 1 else None,
                **({"skipped_steps": self.scaler.skipped} if self.scaler else {})}


def build(ctx: RunContext) -> Trainer:
    return NativeTrainer(ctx)
