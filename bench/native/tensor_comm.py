"""Tensor-parallel communication: the conjugate autograd pairs (Megatron's f/g operators).

Every tensor-parallel byte of the native engine goes through this module. Each pair is a
forward op and its conjugate in backward, so a column-parallel linear followed by a row-parallel
one costs one collective in forward and one in backward:

    copy_to_region          forward identity     backward all-reduce      (enters  Y = X [A_1 … A_p])
    reduce_from_region      forward all-reduce   backward identity        (leaves  Y = Σ_i X_i B_i)
    gather_from_sequence    forward all-gather   backward reduce-scatter  (enters a region from SP)
    reduce_scatter_sequence forward reduce-scatter backward all-gather    (leaves a region into SP)

Activations are (B, T, h); sequence parallel shards T: rank i holds tokens [i·T/p, (i+1)·T/p).
Under autocast the engine casts activations to the autocast dtype before they are communicated,
so activation traffic is 2 bytes per element in bf16/fp16-mixed and 4 in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over `group` (skipped for a group of one)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/p, h) → (B, T, h): every rank's sequence chunk, in rank order."""
    p = group_size(group)
    if p == 1:
        return x
    B = x.shape[0]
    out = x.new_empty((p * B, *x.shape[1:]))  # (p·B, T/p, h): rank-major, as gloo wants dim 0
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(p, B, *x.shape[1:]).transpose(0, 1).reshape(B, p * x.shape[1], *x.shape[2:])


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, h) partial sums → (B, T/p, h): this rank's chunk of the sum over the group."""
    p = group_size(group)
    if p == 1:
        return x
    B, T = x.shape[:2]
    chunks = x.reshape(B, p, T // p, *x.shape[2:]).transpose(0, 1).reshape(p * B, T // p, *x.shape[2:])
    out = x.new_empty((B, T // p, *x.shape[2:]))  # chunks: (p·B, T/p, h), rank-major
    dist.reduce_scatter_single(out, chunks, group=group)
    return out


def _owned(x: torch.Tensor) -> bool:
    """True when `x` may be reduced in place: contiguous and no view of another tensor. The tensors
    reduced here are fresh matmul outputs (forward) and fresh input gradients (backward) that nothing
    else reads, so reducing them in place, as Megatron does, saves an activation-sized copy each."""
    return x.is_contiguous() and x._base is None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # The region's input feeds only column-parallel linears: its gradient is a fresh matmul output,
        # reshaped to (B, T, h) (a view of a buffer of the same size that nothing else reads).
        fresh = grad.is_contiguous() and (grad._base is None or grad._base.numel() == grad.numel())
        grad = grad if fresh else grad.clone(memory_format=torch.contiguous_format)
        return all_reduce(grad, ctx.group), None  # (B, T, h) over tp, in place


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _owned(x):
            ctx.mark_dirty(x)  # autograd checks that no saved tensor was this one (version counter)
            return all_reduce(x, group)  # (B, T, h) over tp, in place
        return all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)  # (B, T/p, h) → (B, T, h) over tp

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None  # (B, T, h) → (B, T/p, h)


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)  # (B, T, h) → (B, T/p, h) over tp

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None  # (B, T/p, h) → (B, T, h)


def _act(x: torch.Tensor) -> torch.Tensor:
    """Cast to the autocast dtype when autocast is on, so activation traffic is half-width."""
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def copy_to_region(x, group):
    """Identity forward, all-reduce backward: the input of a column-parallel region."""
    return _CopyToRegion.apply(_act(x), group) if group_size(group) > 1 else x


def reduce_from_region(x, group):
    """All-reduce forward, identity backward: the output of a row-parallel region."""
    return _ReduceFromRegion.apply(_act(x), group) if group_size(group) > 1 else x


def gather_from_sequence(x, group):
    """All-gather along the sequence forward, reduce-scatter backward (SP → column-parallel)."""
    return _GatherFromSequence.apply(_act(x), group) if group_size(group) > 1 else x


def reduce_scatter_sequence(x, group):
    """Reduce-scatter along the sequence forward, all-gather backward (row-parallel → SP)."""
    return _ReduceScatterSequence.apply(_act(x), group) if group_size(group) > 1 else x
