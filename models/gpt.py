"""The shared GPT decoder. Plain PyTorch: no distributed code; backends parallelize it from outside.

Tensor layouts are chosen so that a contiguous slice along dim 0 of a weight is a valid
tensor-parallel shard (what Megatron and DTensor's Colwise/Rowwise plans expect):
- `attn.qkv` output is laid out (kv_heads, group + 2, head_dim), group = heads / kv_heads: per K/V
  head its `group` query heads, then its k, then its v. A slice holds whole query groups with the
  K/V head they read (multi-head attention, group = 1: (heads, 3, head_dim), whole heads);
- `mlp.fc1` output for swiglu is laid out (ffn, 2): a slice holds gate and up of the same units;
  so are each expert's rows of `mlp.experts.fc1` (E, fc1_out, h) and `mlp.shared.fc1`.

An MoE block's `mlp` is an `MoE` (router, `Experts`, optional shared MLP) in the dense MLP's slot, so
every name outside it is unchanged.
"""
from __future__ import annotations

import contextlib
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


def _activate(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output: SwiGLU on its interleaved (ffn, 2) gate and up, or GELU."""
    if swiglu:
        gate, up = h.view(*h.shape[:-1], -1, 2).unbind(-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


class MLP(nn.Module):
    """fc1 → activation → fc2, of inner width `ffn` (default: the config's; the shared experts': theirs)."""

    def __init__(self, cfg: GPTConfig, device=None, ffn: int | None = None, bias: bool | None = None):
        super().__init__()
        ffn, bias = cfg.ffn_hidden if ffn is None else ffn, cfg.bias if bias is None else bias
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = nn.Linear(cfg.hidden, 2 * ffn if self.swiglu else ffn, bias=bias, device=device)
        self.fc2 = nn.Linear(ffn, cfg.hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_activate(self.fc1(x), self.swiglu))


# --- mixture of experts ---------------------------------------------------------------------------------
# The aux loss's gradient is injected where the MoE output is backpropagated (Megatron's mechanism), with
# this scale: 1.0 is right for loss.backward() of a single-process mean loss; an engine that scales the
# loss it backpropagates (1/micro-batches, a loss scale) sets the same factor here.
_aux_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """The factor the aux losses' gradient is given in backward (the engine's loss scaling)."""
    global _aux_scale
    _aux_scale = float(scale)


def aux_loss_scale() -> float:
    return _aux_scale


@contextlib.contextmanager
def aux_loss_scaled(scale: float):
    """`set_aux_loss_scale(scale)` inside, the previous scale after: a warm rank runs other engines next."""
    previous = aux_loss_scale()
    set_aux_loss_scale(scale)
    try:
        yield
    finally:
        set_aux_loss_scale(previous)


class _AttachAux(torch.autograd.Function):
    """Identity on `out`; in backward the aux loss receives gradient `aux_loss_scale()`, so the aux term
    joins the training loss without the engines' loss code knowing about it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), aux_loss_scale(), dtype=torch.float32, device=grad.device)


class Experts(nn.Module):
    """E expert MLPs (fc1 → activation → fc2, no biases) as two stacked parameters: `fc1` (E, fc1_out, h)
    and `fc2` (E, h, ffn). Expert e's matrices are fc1[e], fc2[e], laid out as `mlp.fc1` / `mlp.fc2`.

    Contract (what an expert-parallel replacement must keep): `forward(rows, counts)` gets the routed
    rows (N, h) sorted by expert — rows [Σ counts[:e], Σ counts[:e+1]) go to expert e, in (token, slot)
    order within an expert — and `counts`, the host int64 (E,) rows per expert over *all* E experts;
    it returns (N, h): row i through its expert, unweighted, in the same order. Under tensor parallel
    each rank computes its slice of every expert (fc1's rows, fc2's columns) and returns partial sums,
    reduced after the combine like the dense MLP. An EP replacement holds whole experts
    [j·E/ep, (j+1)·E/ep) as `fc1`/`fc2` (same names), sends each rank its experts' rows (design: a count
    all-to-all, then the rows), runs `compute` on what it received and sends the results back in order."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = nn.Parameter(torch.empty(cfg.experts, cfg.experts_fc1_out, cfg.hidden, device=device))
        self.fc2 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.expert_ffn, device=device))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(rows, counts)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts this module holds (len(counts) of them) on their rows, one expert after another."""
        segments = rows.split(counts.tolist())
        outs = [_activate(x @ self.fc1[e].t(), self.swiglu) @ self.fc2[e].t() for e, x in enumerate(segments)]
        return torch.cat(outs) if outs else rows.new_zeros(0, self.fc2.shape[1])


class MoE(nn.Module):
    """A mixture-of-experts MLP: a top-k router, `Experts`, and an always-on shared MLP when
    cfg.shared_experts > 0. Routing is a pure function of the router weight and the token: fp32 logits
    → softmax over the experts (or a sigmoid per expert) → top-k → weights renormalised to sum 1.

    With cfg.moe_capacity_factor each expert keeps at most `cfg.expert_capacity(seq)` assignments per
    sequence, in (position, slot) order; the rest are dropped (the residual carries them). The per-
    sequence load-balancing loss coeff · E · Σ_e f_e · P_e (f_e: share of the sequence's assignments
    routed to e, before dropping; P_e: mean router probability of e), averaged over sequences, rides
    on the output (`_AttachAux`); its detached value is `last_aux_loss`. `last_tokens_per_expert`
    (host int64 (E,), rows each expert computed) and `last_dropped` (assignments dropped) describe the
    last forward. An engine that splits a sequence over ranks overrides `sequence_sums` and
    `capacity_keep` (the sums and positions are the whole sequence's)."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False, device=device)
        self.experts = Experts(cfg, device)
        self.shared = MLP(cfg, device, ffn=cfg.shared_ffn, bias=False) if cfg.shared_experts else None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_dropped = 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, h) → probs (B, T, E), top-k experts (B, T, k) and their weights (B, T, k), in fp32 at
        least (float64 stays float64: the reference's gradient checks)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        probs = logits.sigmoid() if self.cfg.moe_router == "sigmoid" else logits.softmax(-1)
        top_p, top_e = probs.topk(self.cfg.moe_top_k, dim=-1)
        return probs, top_e, top_p / top_p.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        k, E = self.cfg.moe_top_k, self.cfg.experts
        probs, top_e, weights = self.route(x)
        flat_e = top_e.reshape(-1)  # assignments in (token, slot) order
        keep = self.capacity_keep(top_e)
        kept = torch.arange(flat_e.numel(), device=x.device) if keep is None else keep.reshape(-1).nonzero().squeeze(1)
        order = kept[torch.argsort(flat_e[kept], stable=True)]  # kept assignments sorted by expert
        counts = torch.bincount(flat_e[order], minlength=E).cpu()
        y = self.experts(x.reshape(B * T, h).index_select(0, order // k), counts)
        slots = torch.zeros(B * T * k, y.shape[1], dtype=y.dtype, device=y.device).index_copy(0, order, y)
        out = (slots.view(B, T, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(2)  # dropped slots are 0
        if self.shared is not None:
            out = out + self.shared(x)
        self.last_tokens_per_expert, self.last_dropped = counts, flat_e.numel() - order.numel()
        aux = self.aux_loss(probs, top_e)
        self.last_aux_loss = aux.detach()
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AttachAux.apply(out, aux)
        return out

    def capacity_keep(self, top_e: torch.Tensor) -> torch.Tensor | None:
        """Which assignments (B, T, k) are within their expert's capacity in this sequence, counted in
        (position, slot) order; None when dropless."""
        if self.cfg.moe_capacity_factor is None:
            return None
        B, T, k = top_e.shape
        onehot = F.one_hot(top_e.reshape(B, T * k), self.cfg.experts)  # (B, T·k, E)
        before = (onehot.cumsum(1) * onehot).sum(-1) - 1  # earlier assignments of the same expert
        return (before < self.cfg.expert_capacity(T)).view(B, T, k)

    def sequence_sums(self, counts: torch.Tensor, prob_sums: torch.Tensor,
                      tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per-sequence sums over this module's tokens → the whole sequence's, and its length. Identity
        here; an engine that splits sequences all-reduces them over that group."""
        return counts, prob_sums, tokens

    def aux_loss(self, probs: torch.Tensor, top_e: torch.Tensor) -> torch.Tensor:
        """coeff · mean over sequences of E · Σ_e f_e · P_e; the gradient flows through P only."""
        coeff, E, k = self.cfg.moe_aux_loss_coeff, self.cfg.experts, self.cfg.moe_top_k
        B, T, _ = probs.shape
        assignments = top_e.reshape(B, T * k)
        counts = probs.new_zeros(B, E).scatter_add_(1, assignments, probs.new_ones(B, T * k))
        counts, prob_sums, S = self.sequence_sums(counts, probs.sum(1), T)
        return coeff * E * ((counts / (S * k)) * (prob_sums / S)).sum(-1).mean()


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None, layer: int = 0):
        super().__init__()
        self.ln1, self.attn = _norm(cfg).to(device), Attention(cfg, device)
        self.ln2 = _norm(cfg).to(device)
        self.mlp = MoE(cfg, device) if cfg.moe_layer(layer) else MLP(cfg, device)

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
        self.blocks = nn.ModuleList(Block(cfg, device, i) for i in range(cfg.layers))
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
    """Mean next-token cross-entropy over every token of the batch, in fp32 at least (float64 logits
    keep float64: the reference's gradient checks)."""
    logits = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.reshape(-1))


def moe_modules(model: nn.Module) -> list["MoE"]:
    """The MoE blocks' `mlp` modules of `model` (a GPT, a pipeline stage, a wrapper), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss_total(model: nn.Module) -> torch.Tensor | float:
    """Σ of the detached load-balancing losses of `model`'s MoE blocks in their last forward (0.0: none)."""
    return sum((m.last_aux_loss for m in moe_modules(model) if m.last_aux_loss is not None), 0.0)


def loss_with_aux(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference's training loss after `logits = model(idx)`: cross-entropy + Σ of the MoE blocks'
    aux losses. The aux terms are added detached: their gradient already rides on the MoE outputs
    (`_AttachAux`), so `loss_with_aux(…).backward()` differentiates exactly this value (aux scale 1)."""
    return loss_fn(logits, targets) + aux_loss_total(model)


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
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight", "mlp.experts.fc2", "mlp.shared.fc2.weight")):
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
