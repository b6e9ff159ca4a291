"""Model surgery shared by every engine: cut the GPT into pipeline stages, recompute activations (whole
blocks or the attention core), compile each block, and materialise a module built on the meta device
from `models.init_value`, one local part at a time.

Every engine builds the plain GPT on meta (shapes, no memory), changes its structure there (tensor-parallel
layers, a pipeline cut, DTensor sharding, ZeRO-3 partitions) and only then allocates. Each rank then
fills exactly its own part of each parameter from that parameter's full initial value, so every layout
starts from the single-process reference weights and no rank ever holds the whole model. Parameter
names stay the full GPT's (`blocks.5.mlp.fc1.weight`) through every step: the name is the key of the
initial value and of its tensor-parallel split.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn as nn

from models import Block, GPTConfig, init_fill_, init_range, init_value
from models.config import split_dim  # noqa: F401 (re-exported: the engines read the split here)


# --- pipeline stages ---------------------------------------------------------------------------------
class Stage(nn.Module):
    """One contiguous slice of the GPT: layers `layer_ids`, plus the embedding on the first stage and
    the final norm and head on the last. It holds the model's own modules (built on meta, tensor
    parallel already applied or not), so parameter names are the full model's."""

    def __init__(self, model: nn.Module, layer_ids: Iterable[int], first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) or hidden (b, s[/tp], h) → hidden, or logits (b, s, V[/tp]) on the last stage."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def cut_stages(model: nn.Module, parts: list[list[int]], stage_ids: Iterable[int]) -> list[Stage]:
    """This rank's stages of a pipeline whose stage s holds layers parts[s] (s = 0 … len(parts) − 1)."""
    last = len(parts) - 1
    return [Stage(model, parts[s], s == 0, s == last) for s in stage_ids]


# --- activation recomputation -------------------------------------------------------------------------
def recompute_blocks(module: nn.Module) -> nn.Module:
    """recompute=full: every block's activations are recomputed in backward instead of kept.

    torch's composable `checkpoint` hooks the block in place, so parameter names, FSDP's and ZeRO-3's
    hooks and tensor-parallel regions inside the block are unchanged. Apply before data parallelism
    wraps the module (FSDP2 must see the checkpointed blocks)."""
    from torch.distributed._composable.checkpoint_activation import checkpoint
    for block in [m for m in module.modules() if isinstance(m, Block)]:
        checkpoint(block)
    return module


def recompute_attention_cores(module: nn.Module) -> nn.Module:
    """recompute=selective (Korthikanti et al. 2022, §4.2): only the attention core — softmax(QKᵀ)·V,
    with its mask and dropout — is recomputed in backward; the outputs of every linear layer are kept.

    The core's inputs Q, K, V and its output (the projection's input) stay saved, so what it drops is
    what the core saves inside: the a·s² scores of an unfused attention, or, with a fused kernel (what
    scaled_dot_product_attention runs here), only its log-sum-exp (bench.analysis.memory). The function
    form of checkpoint, unlike the composable one, is traced by torch.compile as one region."""
    from models.gpt import Attention
    for attn in [m for m in module.modules() if isinstance(m, Attention)]:
        if not isinstance(attn.core, _Recomputed):
            attn.core = _Recomputed(attn.core)
    return module


class _Recomputed(nn.Module):
    """A parameterless module whose activations are recomputed in backward (names below it unchanged:
    it has no parameters)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, *args, use_reentrant=False)


def apply_recompute(module: nn.Module, mode: str) -> nn.Module:
    """RunConfig.recompute on `module` (a GPT or a pipeline stage): none, selective or full. Apply after
    tensor parallel and before data parallelism wraps the module (FSDP2 must see the recomputing blocks)."""
    if mode == "full":
        return recompute_blocks(module)
    if mode == "selective":
        return recompute_attention_cores(module)
    return module


def transform_blocks(module: nn.Module, cfg) -> nn.Module:
    """What a RunConfig asks of every block of `module`: recomputation (`cfg.recompute`), then compilation
    (`cfg.compile`). Every engine calls it once per model chunk, after tensor parallel and before data
    parallelism wraps the chunk."""
    apply_recompute(module, cfg.recompute)
    if getattr(cfg, "compile", False):
        compile_blocks(module)
    return module


# --- compilation ----------------------------------------------------------------------------------------
def compile_blocks(module: nn.Module) -> nn.Module:
    """compile=True: torch.compile each block in place, as torchtitan does (one graph per block, reused by
    every block of the same shape; the loop, pipeline and collectives between blocks stay eager).

    `Module.compile` keeps parameter names (torch.compile(module) would prefix `_orig_mod.`). Apply
    after recomputation (the checkpoint is compiled with the block) and before data parallelism wraps
    the module. Compilation happens at the first call: in the worker's warm-up, never in a timed step."""
    import torch._dynamo
    # A warm rank process runs many configs: forget the previous runs' graphs and guards, so they neither
    # pile up to dynamo's recompile limit nor keep the old modules alive (inductor's on-disk cache stays).
    torch._dynamo.reset()
    for block in [m for m in module.modules() if isinstance(m, Block)]:
        block.compile()
    return module


# --- materialisation ------------------------------------------------------------------------------------
def meta_module(build: Callable[[], nn.Module]) -> nn.Module:
    """Construct a module on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return build()


def materialize(module: nn.Module, cfg: GPTConfig, seed: int, device, *, prefix: str = "",
                tp_rank: int = 0, tp: int = 1) -> nn.Module:
    """Allocate `module` (built on meta) on `device` and fill it from `init_value` (see `fill_from_init`).

    `to_empty` unties shared weights (a tied head gets its own tensor): re-tie after, as `GPT.tie_weights`."""
    module.to_empty(device=device)
    fill_from_init(module, cfg, seed, prefix=prefix, tp_rank=tp_rank, tp=tp)
    return module


@torch.no_grad()
def fill_from_init(module: nn.Module, cfg: GPTConfig, seed: int, *, prefix: str = "",
                   tp_rank: int = 0, tp: int = 1) -> None:
    """Write this rank's part of every parameter's initial value, whatever holds it:

        ZeRO-3 parameter    its flat partition (`ds_tensor`) of the full value
        DTensor             its local shard, as torch lays it out (no communication)
        native tp layer     its slice along `split_dim(name)`: rank `tp_rank` of `tp` (of each expert)
        plain tensor        the whole value

    Initial values are drawn in flat blocks (`models.init_fill_`), so a part that is one flat range of
    the full value (a dim-0 slice, a ZeRO-3 partition) draws only its own blocks; a dim-1 slice draws its
    rows and narrows. Names are the full GPT's: `prefix` + the name inside `module` (a pipeline piece
    holding block 3 as "3" passes prefix "blocks.")."""
    from torch.distributed.tensor import DTensor
    first_experts = {id(p): getattr(m, "first_expert", 0) for m in module.modules() for p in m.parameters(recurse=False)}
    for local_name, p in module.named_parameters():
        name = prefix + local_name
        if hasattr(p, "ds_tensor"):
            _fill_zero3_partition(p, name, cfg, seed)
        elif isinstance(p, DTensor):
            _fill_dtensor(p, name, cfg, seed)
        else:
            _fill_tp_slice(p, name, cfg, seed, tp_rank, tp, first_experts[id(p)])


def _fill_tp_slice(p: torch.Tensor, name: str, cfg: GPTConfig, seed: int, rank: int, tp: int,
                   first_expert: int = 0) -> None:
    """`first_expert`: under expert parallel, a stack (E/ep, out, in) holds experts [first, first + E/ep)."""
    dim = split_dim(name) if tp > 1 else None
    shape = list(p.shape)
    if p.dim() == 3:
        shape[0] = cfg.experts  # the full stack, whatever share of it this rank holds
    if dim is None:  # whole experts are one flat range of the full value
        init_fill_(p, name, shape, cfg, seed, start=first_expert * math.prod(shape[1:]))
        return
    shape[dim] *= tp  # the full parameter's shape
    if p.dim() == 3:  # experts (E, out, in): expert e's matrix is values [e·m, (e + 1)·m) of the full value
        m = math.prod(shape[1:])
        for e in range(p.shape[0]):
            _fill_matrix_slice(p[e], name, shape, cfg, seed, rank, dim - 1, (first_expert + e) * m)
    else:
        _fill_matrix_slice(p, name, shape, cfg, seed, rank, dim, 0)


def _fill_matrix_slice(out: torch.Tensor, name: str, shape: list, cfg: GPTConfig, seed: int, rank: int,
                       dim: int, start: int) -> None:
    """`out`: rank `rank`'s slice along `dim` of the matrix (or bias) whose values begin at flat value
    `start` of the full value of `name` (of `shape`)."""
    if dim == 0:  # rows [rank·r, (rank + 1)·r): one flat range
        init_fill_(out, name, shape, cfg, seed, start=start + rank * out.numel())
        return
    rows, cols = out.shape
    tp = shape[-1] // cols
    whole = init_range(name, shape, cfg, seed, start, start + rows * cols * tp).view(rows, cols * tp)
    out.copy_(whole.narrow(1, rank * cols, cols))


def _fill_dtensor(p, name: str, cfg: GPTConfig, seed: int) -> None:
    """The local shard of DTensor `p`: its rows of the full value, narrowed along the other dims."""
    local, box = p.to_local(), _dtensor_box(p)
    if box is None or tuple(local.shape) != box[0]:
        _fill_dtensor_from_full(p, local, init_value(name, p.shape, cfg, seed))  # p.shape: the global shape
        return
    (shape, offset), full = box, tuple(p.shape)
    row = math.prod(full[1:])
    if shape[1:] == full[1:]:  # whole rows: one flat range
        init_fill_(local, name, full, cfg, seed, start=offset[0] * row)
        return
    rows = init_range(name, full, cfg, seed, offset[0] * row, (offset[0] + shape[0]) * row).view(shape[0], *full[1:])
    for dim in range(1, len(full)):
        rows = rows.narrow(dim, offset[dim], shape[dim])
    local.copy_(rows)


def _dtensor_box(p) -> tuple[tuple, tuple] | None:
    """(local shape, global offset) of `p`'s shard when it is one box of the global tensor: every placement
    a plain Shard or Replicate. Shards are cut left to right over the mesh dims, each as torch.chunk cuts
    (uneven: short or empty last shards), by torch's own `Shard.local_shard_size_and_offset`. None for
    anything else (FSDP2 + TP's _StridedShard interleaves rows) or a rank outside the mesh.
    (Not `compute_local_shape_and_global_offset`: it makes host tensors without naming their device.)"""
    from torch.distributed.tensor import Replicate, Shard
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None or not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    shape, offset = list(p.shape), [0] * p.dim()
    for mesh_dim, placement in enumerate(p.placements):
        if type(placement) is Shard:
            d = placement.dim
            size, start = Shard.local_shard_size_and_offset(shape[d], p.device_mesh.size(mesh_dim),
                                                            coordinate[mesh_dim])
            shape[d], offset[d] = int(size), offset[d] + int(start)
    return tuple(shape), tuple(offset)


def _fill_dtensor_from_full(p, local: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import distribute_tensor
    # src_data_rank=None: every rank cuts its own shard from its own copy of the full value.
    shard = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
    local.copy_(shard)


def _fill_zero3_partition(p: torch.Tensor, name: str, cfg: GPTConfig, seed: int) -> None:
    """DeepSpeed ZeRO-3: this rank's flat slice [rank·n, (rank+1)·n) of the full value, zero-padded."""
    import torch.distributed as dist
    part, numel = p.ds_tensor.view(-1), math.prod(p.ds_shape)
    start = min(dist.get_rank(group=p.ds_process_group) * part.numel(), numel)
    valid = min(part.numel(), numel - start)
    init_fill_(part[:valid], name, p.ds_shape, cfg, seed, start=start)
    part[valid:].zero_()
    if p.numel():  # a parameter DeepSpeed keeps whole (persistence threshold) also holds the full value
        init_fill_(p.data, name, p.ds_shape, cfg, seed)
