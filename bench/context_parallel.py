"""Context parallelism: the zig-zag sequence layout and the one ring attention every backend uses.

Layout (bench.data.zigzag_positions; Megatron's DualChunkSwap, Llama 3 §3.3.2): the sequence is cut into
2·cp equal chunks and cp rank r holds chunks r and 2·cp − 1 − r, so every rank does the same causal work.
Positions are global: `set_positions` gives the model's Embedding and Attention (rotary) the rank's token ids.

Ring attention (`ring_attention`, `RingAttention`): causal softmax attention over the cp group's whole
sequence. Each step attends the rank's queries to one rank's K/V, in half blocks of (query chunk, key
chunk): a pair whose keys all lie after its queries is skipped (no compute), a diagonal pair is masked
causally from the global positions, the rest is full. Blocks are merged by their log-sum-exp, in fp32
(fp64 for fp64 inputs); the output is in the input dtype. The backward recomputes each block's scores
from the saved log-sum-exp (no s² tensor saved) and sends dK/dV round the ring with K/V.

The send pattern (the analytic model predicts exactly this; keep them together). Every ring pass is ONE
`dist.batch_isend_irecv` to the next rank / from the previous rank of the group, with one send and one
recv per flat buffer. With KV_r = 2·B·(T/cp)·nkv·hd elements (this rank's K and V) and β the bytes of
the K/V dtype, per layer and micro-batch:
- forward: cp − 1 passes of one buffer [K, V] (K/V dtype): cp − 1 sends, (cp − 1)·KV_r·β bytes;
- backward: cp − 1 passes of two buffers, [K, V] (K/V dtype) and [dK, dV] (fp32, the partial sums of
  the K/V in hand; fp64 for fp64 inputs), then one pass of [dK, dV] home to its owner: 2·cp − 1
  sends, (cp − 1)·KV_r·β + cp·KV_r·4 bytes.
GQA sends K/V at their kv-head size. cp = 1 is plain causal SDPA (no communication).

Overlap: the forward posts each pass before computing the block in hand and waits after it (a prefetch:
same bytes and ops). The backward's dK/dV of a block is only ready after the block, so its pass waits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench.data import zigzag_positions
from bench.layout import seq_split_reason
from models.gpt import AttentionCore


# --- the ring ------------------------------------------------------------------------------------------
def _ring_pass(buffers: list[torch.Tensor], group) -> tuple[list, list[torch.Tensor]]:
    """Post one pass: each flat buffer sent to the next rank of `group`, one of its size received from
    the previous, in one batch_isend_irecv. Returns (requests, received buffers): wait before reading."""
    rank, size, ranks = dist.get_rank(group), dist.get_world_size(group), dist.get_process_group_ranks(group)
    nxt, prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    received = [torch.empty_like(b) for b in buffers]
    ops = [op for tag, (out, into) in enumerate(zip(buffers, received))
           for op in (dist.P2POp(dist.isend, out, nxt, group, tag), dist.P2POp(dist.irecv, into, prev, group, tag))]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(buffer: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[a, b] flat → a, b, each shaped like `like`."""
    return tuple(part.view_as(like) for part in buffer.split(like.numel()))


def _half_blocks(rank: int, source: int, cp: int, chunk: int, device):
    """(query chunk, key chunk, mask on `device`) of every half block of cp rank `rank`'s queries against
    cp rank `source`'s keys that has a visible key; mask None = all visible. Decided on the host: no sync."""
    seq = 2 * chunk * cp
    for a, pq in enumerate(zigzag_positions(rank, cp, seq).split(chunk)):
        for b, pk in enumerate(zigzag_positions(source, cp, seq).split(chunk)):
            visible = pq[:, None] >= pk[None, :]  # causal, from the global positions
            if visible.any():
                yield a, b, None if visible.all() else visible.to(device)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag share over the cp group `group` (module docstring).

    Inside, heads are laid out (B, nkv, group·c, hd) per chunk of c tokens: query head i reads K/V head
    i // group (the model's order) with no K/V repeated, and a plain matmul sums dK/dV over the group."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, cp, chunk, acc = _ring_shape(q, group)
        if reason := seq_split_reason(q.shape[2] * cp, cp):  # two equal chunks per rank
            raise ValueError(reason)
        qs, scale = _query_chunks(q, k.shape[1], acc), q.shape[-1] ** -0.5
        out, lse = [None, None], [None, None]
        kv = _flat(k, v)  # [K, V] flat (2·B·nkv·T/cp·hd,), K/V dtype: to the next cp rank, from the previous
        for step in range(cp):
            requests, received = _ring_pass([kv], group) if step < cp - 1 else ([], None)  # prefetch
            kk, vv = (x.to(acc) for x in _unflat(kv, k))
            for a, b, mask in _half_blocks(rank, (rank - step) % cp, cp, chunk, q.device):
                s = _scores(qs[a], _chunk(kk, b, chunk), scale, mask)
                block_lse = torch.logsumexp(s, -1, keepdim=True)
                block_out = torch.exp(s - block_lse) @ _chunk(vv, b, chunk)
                if out[a] is None:
                    out[a], lse[a] = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse[a], block_lse)
                    out[a] = out[a] * torch.exp(lse[a] - merged) + block_out * torch.exp(block_lse - merged)
                    lse[a] = merged
            _wait(requests)
            if received is not None:
                kv = received[0]
        y = _heads_out(out, q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, torch.cat(lse, dim=2))
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp, chunk, acc = _ring_shape(q, group)
        nkv, scale = k.shape[1], q.shape[-1] ** -0.5
        qs, dys = _query_chunks(q, nkv, acc), _query_chunks(dy, nkv, acc)
        # rowsum(dO ∘ O) per query row: the softmax's backward without the probabilities' s² tensor
        delta = [(d * o).sum(-1, keepdim=True) for d, o in zip(dys, _query_chunks(y, nkv, acc))]
        lses = lse.split(lse.shape[2] // 2, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        kv, dkv = _flat(k, v), torch.zeros(2 * k.numel(), dtype=acc, device=k.device)
        for step in range(cp):
            kk, vv = (x.to(acc) for x in _unflat(kv, k))
            dk, dv = _unflat(dkv, k)
            for a, b, mask in _half_blocks(rank, (rank - step) % cp, cp, chunk, q.device):
                kb, vb = _chunk(kk, b, chunk), _chunk(vv, b, chunk)
                p = torch.exp(_scores(qs[a], kb, scale, mask) - lses[a])  # masked scores are −inf: p = 0
                ds = p * (dys[a] @ vb.transpose(-2, -1) - delta[a])
                dq[a] += (ds @ kb) * scale
                _chunk(dk, b, chunk).add_((ds.transpose(-2, -1) @ qs[a]) * scale)
                _chunk(dv, b, chunk).add_(p.transpose(-2, -1) @ dys[a])
            # [K, V] (2·B·nkv·T/cp·hd,) in their dtype and [dK, dV] of the same size in fp32, over the cp ring
            if step < cp - 1:  # K/V on to the next rank, with the dK/dV summed so far for them
                requests, (kv, dkv) = _ring_pass([kv, dkv], group)
            else:  # the last dK/dV home: the K/V in hand belong to the next rank
                requests, (dkv,) = _ring_pass([dkv], group)
            _wait(requests)
        dk, dv = (x.to(k.dtype) for x in _unflat(dkv, k))
        return _heads_out(dq, q.shape).to(q.dtype), dk, dv, None


def _ring_shape(q: torch.Tensor, group) -> tuple[int, int, int, torch.dtype]:
    """(cp rank, cp, tokens per chunk, the dtype blocks are computed and merged in: fp32 or fp64)."""
    return dist.get_rank(group), dist.get_world_size(group), q.shape[2] // 2, torch.promote_types(q.dtype, torch.float32)


def _query_chunks(x: torch.Tensor, nkv: int, dtype) -> list[torch.Tensor]:
    """(B, nh, 2c, hd) → its two chunks, each (B, nkv, group·c, hd) in `dtype`."""
    B, nh, T, hd = x.shape
    grouped = x.to(dtype).reshape(B, nkv, nh // nkv, T, hd)
    return [part.reshape(B, nkv, -1, hd) for part in grouped.split(T // 2, dim=3)]


def _heads_out(chunks: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The inverse of `_query_chunks`: two (B, nkv, group·c, hd) chunks → (B, nh, 2c, hd)."""
    B, nh, T, hd = shape
    nkv = chunks[0].shape[1]
    return torch.cat([c.view(B, nkv, nh // nkv, T // 2, hd) for c in chunks], dim=3).view(shape)


def _chunk(x: torch.Tensor, index: int, chunk: int) -> torch.Tensor:
    return x.narrow(2, index * chunk, chunk)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q (B, nkv, group·c, hd) · k (B, nkv, c, hd)ᵀ → (B, nkv, group·c, c), masked positions −inf."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is None:
        return s
    B, nkv, rows, c = s.shape
    return s.view(B, nkv, rows // c, c, c).masked_fill(~mask, float("-inf")).view(s.shape)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention over the cp `group`'s sequence: q (B, nh, T/cp, hd), k and v (B, nkv, T/cp, hd),
    each this rank's zig-zag share → (B, nh, T/cp, hd). cp = 1: plain causal SDPA."""
    if dist.get_world_size(group) == 1:
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return RingAttention.apply(q, k, v, group)


# --- applying it to a model from outside ----------------------------------------------------------------
class RingAttentionCore(AttentionCore):
    """An AttentionCore that runs `ring_attention` over its cp group (no parameters: names unchanged)."""

    def __init__(self, group_size: int, cp_group):
        super().__init__(group_size)
        self.cp_group = cp_group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.cp_group)


def use_ring_attention(module: nn.Module, group) -> nn.Module:
    """Make every AttentionCore of `module` (a GPT or a pipeline Stage) run ring attention over the cp
    `group`, wherever it sits: in an Attention, or inside selective recompute's wrapper (either order)."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, AttentionCore) and not isinstance(child, RingAttentionCore):
                setattr(parent, name, RingAttentionCore(child.group, group))
    return module


def set_positions(module: nn.Module, positions: torch.Tensor | None) -> nn.Module:
    """Give every module of `module` that takes global positions (a `positions` attribute: the GPT's
    Embedding and Attention, the native engine's vocab-parallel embedding) the global token ids of the
    tokens it holds (`bench.data.sequence_share`); None = 0 … T − 1, the single-process model. Give them
    on the module's device: host positions would be copied to an accelerator in every layer's forward."""
    for m in module.modules():
        if hasattr(m, "positions"):
            m.positions = positions
    return module
