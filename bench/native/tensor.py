"""Tensor parallelism (Megatron style) applied in place to the shared GPT.

Per block, attention and MLP are each one tensor-parallel *region*: it is entered by a
column-parallel linear and left by a row-parallel one, so each region costs one collective in
forward and its conjugate in backward (tensor_comm). With p = tp ranks:

    column-parallel  Y = X [A_1 … A_p]         rank i holds A_i (out/p rows of the weight):
                                               attn.qkv (whole query groups with their K/V
                                               head: tp must divide kv_heads, K/V are never
                                               replicated), mlp.fc1, head (vocab rows)
    row-parallel     Y = Σ_i X_i B_i           rank i holds B_i (in/p columns): attn.proj, mlp.fc2;
                                               the (replicated) bias is added once, after the sum
    vocab-parallel   embedding rows [i·V/p, (i+1)·V/p); tokens outside give zeros, the sum over
                     ranks is the lookup; cross-entropy on vocab-sharded logits (3 all-reduces
                     of (B·T,) fp32 values: max, sum of exp, target logit) — no rank ever holds
                     full-vocab logits.

Sequence parallel replaces region entry/exit by all-gather/reduce-scatter along the sequence, so
norms (and the residual stream) hold T/p tokens. Replicated parameters that act on the sharded
sequence (norm weights and biases, the position table, row-parallel biases) then get partial
gradients, summed over tp once per step (`sequence_parallel_params`, reduced in data.py).

The regions are installed with forward hooks on the model's own modules, so the model's forward
code (and every parameter name) is unchanged: `init_value(name, full_shape)` sliced along
`split_dim(name)` is exactly this rank's shard (`bench.surgery` fills it). Which parameter is column,
row or vocab-parallel is the model's parameter table's (`models.config.param_table`), read here too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench.native import tensor_comm as comm
from bench.surgery import materialize, split_dim
from models.config import param_table

class ColumnParallelLinear(nn.Linear):
    """Y_i = X A_iᵀ (+ b_i): this rank's out_features/p output columns. No communication itself."""


class RowParallelLinear(nn.Module):
    """Y_i = X_i B_iᵀ: a partial sum over this rank's in_features/p inputs.

    The bias is replicated and NOT added here: the region adds it once, after the reduction."""

    def __init__(self, in_local: int, out_features: int, bias: bool, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Token rows [lo, lo + V/p) of the table; the position table is replicated.

    (B, T) tokens → (B, T, h), or (B, T/p, h) this rank's sequence chunk under sequence parallel."""

    def __init__(self, cfg, group, rank: int, tp: int, sequence_parallel: bool, device=None):
        super().__init__()
        self.group, self.rank, self.sp = group, rank, sequence_parallel
        self.tok = nn.Embedding(cfg.vocab // tp, cfg.hidden, device=device)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden, device=device) if cfg.position == "learned" else None
        self.vocab_start = rank * (cfg.vocab // tp)
        self.positions: torch.Tensor | None = None  # global token ids under cp (bench.context_parallel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.tok.num_embeddings)
        x = self.tok(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0.0)  # (B, T, h) partial
        if self.sp:
            x = comm.reduce_scatter_sequence(x, self.group)  # (B, T/p, h)
            start = self.rank * x.shape[1]
        else:
            x = comm.reduce_from_region(x, self.group)  # (B, T, h)
            start = 0
        if self.pos is not None:
            held = self.positions if self.positions is not None else torch.arange(idx.shape[1], device=idx.device)
            x = x + self.pos(held[start:start + x.shape[1]])
        return x


def _install_region(module: nn.Module, group, sp: bool, row: RowParallelLinear | None) -> None:
    """Enter `module` through copy/gather and (when `row` is given) leave it through reduce/scatter."""
    enter = comm.gather_from_sequence if sp else comm.copy_to_region
    leave = comm.reduce_scatter_sequence if sp else comm.reduce_from_region
    module.register_forward_pre_hook(lambda m, args: (enter(args[0], group), *args[1:]))
    if row is not None:
        def leave_hook(m, args, out):
            out = leave(out, group)
            return out if row.bias is None else out + row.bias
        module.register_forward_hook(leave_hook)


def apply_tensor_parallel(model: nn.Module, run_cfg, group, rank: int, tp: int) -> nn.Module:
    """Swap the GPT's linears and embedding for the tp layers its parameter table names (column, row,
    vocab), then install the regions (no values: call on meta).

    A module holding a row-parallel linear (attn, mlp) is a region, left through that linear; a split
    linear whose module holds none (the head) is a region of its own, entered only."""
    cfg, sp = run_cfg.model_config, run_cfg.sequence_parallel
    device = next(model.parameters()).device
    table = param_table(cfg, with_tied=True)
    names = {s.name for s in table}
    rows: dict[str, RowParallelLinear] = {}
    columns: list[str] = []
    for spec in (s for s in table if s.tp != "replicated" and s.name.endswith(".weight")):
        module = spec.name.removesuffix(".weight")  # blocks.3.attn.qkv, embed.tok, head
        parent = _parent(module)
        if spec.owner == "embed":  # the token table's module: the whole embedding, position table included
            _replace(model, parent, VocabParallelEmbedding(cfg, group, rank, tp, sp, device))
            continue
        layer = _parallel_linear(spec, f"{module}.bias" in names, tp, device)
        _replace(model, module, layer)
        if spec.tp == "row":
            rows[parent] = layer
        else:
            columns.append(module)
    for parent, row in rows.items():
        _install_region(model.get_submodule(parent), group, sp, row)
    for module in columns:
        if _parent(module) not in rows:
            _install_region(model.get_submodule(module), group, sp, None)
    return model


def _parallel_linear(spec, bias: bool, tp: int, device) -> nn.Module:
    """Column- (column or vocab rows) or row-parallel linear for the weight `spec`, full shape (out, in)."""
    out_f, in_f = spec.shape
    if spec.tp == "row":
        return RowParallelLinear(in_f // tp, out_f, bias, device)
    return ColumnParallelLinear(in_f, out_f // tp, bias=bias, device=device)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` (its registration slot, so parameter order is kept)."""
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def shard_model(model_on_meta: nn.Module, cfg, groups, device, seed: int) -> nn.Module:
    """Apply tensor parallel in place to a whole GPT built on meta and materialize this rank's shards.

    `cfg` is the RunConfig (model, tp, sequence_parallel). The model's forward then returns
    vocab-sharded logits (B, T, V/tp): use `vocab_parallel_cross_entropy` on them."""
    tp, rank = groups.size("tp"), groups.coord.tp
    apply_tensor_parallel(model_on_meta, cfg, groups.tp, rank, tp)
    materialize(model_on_meta, cfg.model_config, seed, device, tp_rank=rank, tp=tp)
    if cfg.model_config.tie_embeddings:
        model_on_meta.tie_weights()
    return model_on_meta


def sequence_parallel_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Replicated parameters whose gradients are partial per sequence chunk under SP (summed over tp)."""
    return [(n, p) for n, p in module.named_parameters() if split_dim(n) is None]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):  # logits (N, V/p) fp32, targets (N,)
        n_local = logits.shape[-1]
        m = logits.max(dim=-1).values
        comm.all_reduce(m, group, dist.ReduceOp.MAX)  # (N,) fp32 over tp
        shifted = logits - m[:, None]
        local = targets - vocab_start
        inside = (local >= 0) & (local < n_local)
        local = local.masked_fill(~inside, 0)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)  # (N,) fp32 over tp
        target_logit = comm.all_reduce(shifted.gather(1, local[:, None]).squeeze(1) * inside, group)  # (N,)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):  # d loss_n / d logit_nj = softmax_nj − [j = target_n]
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, local[:, None], -inside.to(g.dtype)[:, None])
        return g * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """Mean next-token cross-entropy from vocab-sharded logits (..., V/p); targets (...) hold global ids."""
    p = comm.group_size(group)
    n_local = local_logits.shape[-1]
    if p == 1:  # the whole vocabulary is here: the reference loss exactly
        return F.cross_entropy(local_logits.reshape(-1, n_local).float(), targets.reshape(-1))
    vocab_start = dist.get_rank(group) * n_local
    flat = local_logits.reshape(-1, n_local).float()
    return _VocabParallelCE.apply(flat, targets.reshape(-1), vocab_start, group).mean()
