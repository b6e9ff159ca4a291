"""The shared GPT decoder. Plain PyTorch: no distributed code; backends parallelize it from outside.

Tensor layouts are chosen so that a contiguous slice along dim 0 of a weight is a valid
tensor-parallel shard (what Megatron and DTensor's Colwise/Rowwise plans expect):
- `attn.qkv` output is laid out (kv_heads, group + 2, head_dim), group = heads / kv_heads: per K/V
  head its `group` query heads, then its k, then its v. A slice holds whole query groups with the
  K/V head they read (multi-head attention, group = 1: (heads, 3, head_dim), whole heads);
- `mlp.fc1` output for swiglu is laid out (ffn, 2): a slice holds gate and up of the same units.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import GPTConfig


def _positions(positions: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """The global ids of the T tokens a module holds: set from outside when the sequence is split
    (context parallel), else 0 … T − 1."""
    return torch.arange(T, device=device) if positions is None else positions.to(device)


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else nn.RMSNorm(cfg.hidden)


def rope(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (B, T, nh, hd) at token positions (T,); None = 0 … T − 1."""
    T, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    pos = _positions(positions, T, x.device).to(torch.float32)
    ang = torch.outer(pos, inv)  # (T, hd/2)
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class AttentionCore(nn.Module):
    """softmax(QKᵀ/√d + causal mask)·V: the part of attention that selective activation recomputation
    recomputes in backward (Korthikanti et al. 2022). No parameters: a module only so that engines can
    wrap it (bench.surgery) or swap it for ring attention (bench.context_parallel) from outside without
    changing any parameter name."""

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
        self.positions: torch.Tensor | None = None  # global token ids for rope (not a buffer: no state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 = local K/V heads: under tensor parallel this rank holds a slice of whole query groups.
        qkv = self.qkv(x).view(B, T, -1, self.group + 2, self.head_dim)
        q, k, v = qkv.split((self.group, 1, 1), dim=3)
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)  # (B, T, nh, hd), (B, T, nkv, hd) × 2
        if self.group > 1:  # flatten copied q (its heads are strided); copying K and V as well frees the
            k, v = k.contiguous(), v.contiguous()  # fused output, so backward keeps K and V at kv_heads' size
        if self.rope:
            q, k = rope(q, self.positions), rope(k, self.positions)
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
        self.positions: torch.Tensor | None = None  # global token ids (not a buffer: no state)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) → (B, T, h)
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(_positions(self.positions, idx.shape[1], idx.device))
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


# --- initial values -----------------------------------------------------------------------------------
# Value i of a parameter is a function of (seed, name, i) alone: the flat index space is cut into fixed
# blocks of INIT_BLOCK values, each drawn from its own generator seeded from (seed, name, block index).
# A rank therefore draws only the blocks its shard covers, and every layout builds exactly its part of
# the same full value. 2^16 float32 (256 KiB) keeps a block's two passes (uniforms, then Box-Muller) in
# L2: measured 186 M values/s at one thread into touched memory, while the per-block manual_seed
# (~1.7 µs) costs < 1 % of the block's ~350 µs. Changing it changes every initial value.
INIT_BLOCK = 1 << 16
# Destinations that are not host float32 (a GPU, bf16) are drawn chunk by chunk through one host buffer
# of this many values (16 MiB), kept for the process: no full-size temporary, and its pages are faulted
# in once, not per parameter (first touch costs ~1.5 ns/value: 186 → 140 M values/s).
HOST_CHUNK = 64 * INIT_BLOCK
_host_buffer: torch.Tensor | None = None
_U32 = 0xFFFFFFFF


def init_std(name: str, cfg: GPTConfig) -> float | None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/√(2·layers); None for a constant
    (biases 0, norm weights 1: `init_constant`)."""
    if init_constant(name) is not None:
        return None
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return 0.02 / math.sqrt(2 * cfg.layers)
    return 0.02


def init_constant(name: str) -> float | None:
    """The constant initial value of a bias (0) or a norm weight (1); None for a random weight."""
    if name.rsplit(".", 1)[-1] == "bias":
        return 0.0
    if ".ln" in name or name.startswith("norm."):
        return 1.0
    return None


def init_value(name: str, shape: torch.Size | tuple, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """The full initial value of parameter `name` (host float32): a pure function of (seed, name, shape)."""
    return init_fill_(torch.empty(shape, dtype=torch.float32, device="cpu"), name, shape, cfg, seed)


def init_range(name: str, shape: torch.Size | tuple, cfg: GPTConfig, seed: int,
               start: int, stop: int) -> torch.Tensor:
    """Flat values [start, stop) of `init_value(name, shape, …)`, drawing only the blocks they touch."""
    out = torch.empty(stop - start, dtype=torch.float32, device="cpu")
    return init_fill_(out, name, shape, cfg, seed, start=start)


@torch.no_grad()
def init_fill_(out: torch.Tensor, name: str, shape: torch.Size | tuple, cfg: GPTConfig, seed: int,
               start: int = 0) -> torch.Tensor:
    """Write flat values [start, start + out.numel()) of the full value of `name` (of `shape`) into `out`,
    whatever its shape, dtype or device, and return it. A contiguous host float32 `out` is drawn into in
    place; anything else through a bounded host buffer (`HOST_CHUNK`)."""
    numel = math.prod(shape)
    if not 0 <= start <= start + out.numel() <= numel:
        raise ValueError(f"{name}: values [{start}, {start + out.numel()}) outside its {numel} values")
    if init_constant(name) is not None:
        return out.fill_(init_constant(name))
    draw = _BlockDraw(_param_key(seed, name), init_std(name, cfg), numel)
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
        draw.into(out.view(-1), start)
    else:
        _fill_through_host(out, draw, start)
    return out


def _fill_through_host(out: torch.Tensor, draw: "_BlockDraw", start: int) -> None:
    if not out.is_contiguous():  # no flat view to write chunks into (no caller has one today)
        tmp = torch.empty(out.numel(), dtype=torch.float32, device="cpu")
        draw.into(tmp, start)
        out.copy_(tmp.view(out.shape))
        return
    flat, stop, buffer = out.view(-1), start + out.numel(), _host_chunk_buffer()
    lo = start
    while lo < stop:  # chunk ends on multiples of HOST_CHUNK: no block is drawn twice
        hi = min(stop, (lo // HOST_CHUNK + 1) * HOST_CHUNK)
        draw.into(buffer[:hi - lo], lo)
        flat[lo - start:hi - start].copy_(buffer[:hi - lo])
        lo = hi


def _host_chunk_buffer() -> torch.Tensor:
    global _host_buffer
    if _host_buffer is None or _host_buffer.numel() < HOST_CHUNK:
        _host_buffer = torch.empty(HOST_CHUNK, dtype=torch.float32, device="cpu")
    return _host_buffer


def _param_key(seed: int, name: str) -> int:
    """32 bits of a hash of (seed, name). 32: torch's CPU generator (mt19937) keeps only a seed's low 32 bits."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest(), "little")


def _block_seed(key: int, index: int) -> int:
    """Block `index`'s seed: murmur3's 32-bit finaliser of key + index, a bijection of that sum, so the
    blocks of one parameter never share a seed (and a collision across two parameters needs their
    key ranges to overlap: under 1 % chance over all of a 7B model's blocks)."""
    h = (key + index) & _U32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _U32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


class _BlockDraw:
    """N(0, std) values of one parameter (`numel` values, blocks keyed by `key`), drawn block by block."""

    def __init__(self, key: int, std: float, numel: int):
        self.key, self.std, self.numel = key, std, numel
        self.gen = torch.Generator(device="cpu")
        self.scratch: torch.Tensor | None = None

    def into(self, dst: torch.Tensor, start: int) -> None:
        """Fill the flat host float32 `dst` with values [start, start + dst.numel())."""
        stop = start + dst.numel()
        for index in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
            lo, hi = index * INIT_BLOCK, min((index + 1) * INIT_BLOCK, self.numel)
            if start <= lo and hi <= stop:
                self._block(index, dst[lo - start:hi - start])
            else:  # a partial first or last block: draw it whole (a block's values depend on its length)
                block = self._block(index, self._scratch()[:hi - lo])
                a, b = max(lo, start), min(hi, stop)
                dst[a - start:b - start].copy_(block[a - lo:b - lo])

    def _block(self, index: int, out: torch.Tensor) -> torch.Tensor:
        self.gen.manual_seed(_block_seed(self.key, index))
        return out.normal_(0.0, self.std, generator=self.gen)

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(INIT_BLOCK, dtype=torch.float32, device="cpu")
        return self.scratch


def init_weights(model: GPT, seed: int) -> GPT:
    """Fill every parameter of a materialized model from `init_value` (bit-identical for a seed)."""
    for name, p in model.named_parameters():
        init_fill_(p, name, p.shape, model.cfg, seed)
    return model


def build_model(cfg: GPTConfig, seed: int, device: str | torch.device = "cpu") -> GPT:
    """The full model with its deterministic initial weights (single-process reference)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    return init_weights(model, seed)
