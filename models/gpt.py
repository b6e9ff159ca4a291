"""The shared GPT decoder. Plain PyTorch: no distributed code; backends parallelize it from outside.

Tensor layouts are chosen so that a contiguous slice along dim 0 of a weight is a valid
tensor-parallel shard (what Megatron and DTensor's Colwise/Rowwise plans expect):
- `attn.qkv` output is laid out (kv_heads, group + 2, head_dim), group = heads / kv_heads: per K/V
  head its `group` query heads, then its k, then its v. A slice holds whole query groups with the
  K/V head they read (multi-head attention, group = 1: (heads, 3, head_dim), whole heads);
- `mlp.fc1` output for swiglu is laid out (ffn, 2): a slice holds gate and up of the same units.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import GPTConfig


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else nn.RMSNorm(cfg.hidden)


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, T, nh, hd)."""
    T, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)  # (T, hd/2)
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class AttentionCore(nn.Module):
    """softmax(QKᵀ/√d + causal mask)·V: the part of attention that selective activation recomputation
    recomputes in backward (Korthikanti et al. 2022). No parameters: a module only so that engines can
    wrap it from outside (bench.surgery) without changing any parameter name."""

    def __init__(self, group: int):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hd), k and v (B, nkv, T, hd) → (B, nh, T, hd)."""
        # enable_gqa: query head i reads K/V head i // group (the order of Attention's flatten) without
        # materialising repeated K/V, so backward saves K and V at their grouped size.
        gqa = {"enable_gqa": True} if self.group > 1 else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.head_dim, self.group, self.rope = cfg.head_dim, cfg.group, cfg.position == "rope"
        self.qkv = nn.Linear(cfg.hidden, cfg.qkv_out, bias=cfg.bias, device=device)
        self.core = AttentionCore(cfg.group)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 = local K/V heads: under tensor parallel this rank holds a slice of whole query groups.
        qkv = self.qkv(x).view(B, T, -1, self.group + 2, self.head_dim)
        q, k, v = qkv.split((self.group, 1, 1), dim=3)
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)  # (B, T, nh, hd), (B, T, nkv, hd) × 2
        if self.group > 1:  # flatten copied q (its heads are strided); copying K and V as well frees the
            k, v = k.contiguous(), v.contiguous()  # fused output, so backward keeps K and V at kv_heads' size
        if self.rope:
            q, k = rope(q), rope(k)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = nn.Linear(cfg.hidden, cfg.fc1_out, bias=cfg.bias, device=device)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.view(*h.shape[:-1], -1, 2).unbind(-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h, approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.ln1, self.attn = _norm(cfg).to(device), Attention(cfg, device)
        self.ln2, self.mlp = _norm(cfg).to(device), MLP(cfg, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden, device=device)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden, device=device) if cfg.position == "learned" else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) → (B, T, h)
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return x


class GPT(nn.Module):
    """embed → blocks → norm → head. `forward` returns logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg, device)
        self.blocks = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
        self.norm = _norm(cfg).to(device)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, device=device)
        self.tie_weights()

    def tie_weights(self):
        """Share the token table with the head; call again after `to_empty`, which unties them."""
        if self.cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def init_value(name: str, shape: torch.Size | tuple, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """The full initial value of parameter `name`: a pure function of (seed, name, shape).

    Each parameter draws from its own generator, so any layout can build exactly its shards
    without building the rest of the model (GPT-2 init: N(0, 0.02), residual projections scaled
    by 1/√(2·layers), biases 0, norm weights 1).
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if ".ln" in name or name.startswith("norm."):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std


def init_weights(model: GPT, seed: int) -> GPT:
    """Fill every parameter of a materialized model from `init_value` (bit-identical for a seed)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(name, p.shape, model.cfg, seed))
    return model


def build_model(cfg: GPTConfig, seed: int, device: str | torch.device = "cpu") -> GPT:
    """The full model with its deterministic initial weights (single-process reference)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    return init_weights(model, seed)
