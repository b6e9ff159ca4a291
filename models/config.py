"""GPT model configuration, named presets, exact parameter and FLOP counts, and the parameter table
(`param_table`: every parameter's name, full shape and placement along each parallel dimension).

FLOP convention (the one place it is written; `bench` and docs/row-schema.md quote it):
model FLOPs per token for one training step (forward + backward = 3 × forward) are
    6 · (weights of every matmul a token passes through: QKV, attention output, MLP, LM head;
         in an MoE block the router, its top-k experts and the shared experts: *active* weights)
  + 12 · layers · hidden · seq          (attention scores QKᵀ and the weighted sum of V, per query
                                         head: grouped-query attention shrinks QKV, not this term)
Attention is counted non-causal (the full s×s product, as Megatron and PaLM count it);
embedding lookups, norms, biases, softmax and activations are not counted, nor are MoE's top-k,
dispatch and combine, or capacity dropping (a dropped token is counted as computed); recomputation
is not counted (model FLOPs, not hardware FLOPs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Literal

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-style decoder. Every backend trains exactly this definition."""

    name: str = "custom"
    vocab: int = 256
    """Vocabulary size (tokens)."""
    seq_len: int = 32
    """Maximum sequence length (learned position table size)."""
    layers: int = 4
    """Number of transformer blocks."""
    hidden: int = 64
    """Model width h."""
    heads: int = 4
    """Attention heads; hidden must be divisible by heads."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention: each serves heads/kv_heads query heads); None = heads."""
    ffn_hidden: int = 256
    """MLP inner width (per branch for swiglu)."""
    norm: str = "layernorm"
    activation: str = "gelu"
    position: str = "learned"
    bias: bool = False
    """Biases in the linear layers (GPT-2 has them, Llama does not)."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head."""
    experts: int = 0
    """Routed experts per MoE block; 0 = a dense model (every block has the MLP)."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden: int | None = None
    """Inner width of one expert (per branch for swiglu); None = ffn_hidden."""
    shared_experts: int = 0
    """Always-on shared experts (DeepSeek, Qwen): one MLP of width shared_experts × the expert width."""
    moe_router: str = "softmax"
    """Router scores: softmax over the experts (Mixtral) or a sigmoid per expert (DeepSeek-V3); the
    top-k weights are renormalised to sum to 1 in both."""
    moe_aux_loss_coeff: float = 0.01
    """Coefficient of the per-sequence load-balancing loss added to the training loss (0: none)."""
    moe_capacity_factor: float | None = None
    """Tokens per expert per sequence are capped at ceil(k·seq/experts·factor), the rest dropped;
    None = dropless."""
    dense_layers: int = 0
    """The first N blocks keep the dense MLP (DeepSeek-V3's first_k_dense_replace)."""

    def __post_init__(self):
        for name in ("vocab", "seq_len", "layers", "hidden", "heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"model.kv_heads ({self.kv_heads}) must be ≥ 1 and divide model.heads ({self.heads}); "
                             f"pick kv_heads from the divisors of {self.heads}")
        for name, allowed in (("norm", NORMS), ("activation", ACTIVATIONS), ("position", POSITIONS),
                              ("moe_router", ROUTERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name} is {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        self._check_moe()
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def _check_moe(self) -> None:
        for name in ("experts", "shared_experts", "dense_layers", "moe_aux_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be ≥ 0, got {getattr(self, name)}")
        if self.dense_layers > self.layers:
            raise ValueError(f"model.dense_layers ({self.dense_layers}) must be ≤ model.layers ({self.layers})")
        if self.moe_ffn_hidden is not None and self.moe_ffn_hidden < 1:
            raise ValueError(f"model.moe_ffn_hidden must be ≥ 1 or none, got {self.moe_ffn_hidden}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"model.moe_capacity_factor must be > 0 (or none: dropless), "
                             f"got {self.moe_capacity_factor}")
        if self.experts and not 1 <= self.moe_top_k <= self.experts:
            raise ValueError(f"model.moe_top_k ({self.moe_top_k}) must be between 1 and model.experts "
                             f"({self.experts}); lower moe_top_k or add experts")

    def __hash__(self) -> int:
        """The fields' hash, worked out once: the cost model's caches key on the config (a plan hashes
        it some 100,000 times)."""
        return self._hash

    def __getstate__(self) -> dict:
        """Without the hash: strings hash differently in another process (a spawned rank)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def group(self) -> int:
        """Query heads per K/V head (1: multi-head attention)."""
        return self.heads // self.num_kv_heads

    @property
    def fc1_out(self) -> int:
        """Output width of the MLP's first linear: SwiGLU's gate and up side by side, else the FFN width."""
        return 2 * self.ffn_hidden if self.activation == "swiglu" else self.ffn_hidden

    @property
    def qkv_out(self) -> int:
        """Output width of the fused qkv projection: all query heads plus one K and one V per KV head."""
        return (self.heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether block `layer` is an MoE block (else the dense MLP)."""
        return self.is_moe and layer >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        """Number of MoE blocks."""
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def expert_ffn(self) -> int:
        """Inner width of one expert (per branch for swiglu)."""
        return self.ffn_hidden if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    @property
    def experts_fc1_out(self) -> int:
        """Output width of an expert's first matmul (SwiGLU's gate and up interleaved, as mlp.fc1's)."""
        return 2 * self.expert_ffn if self.activation == "swiglu" else self.expert_ffn

    @property
    def shared_ffn(self) -> int:
        """Inner width of the shared-expert MLP (0: none)."""
        return self.shared_experts * self.expert_ffn

    def expert_capacity(self, seq: int) -> int:
        """Assignments one expert keeps per sequence of `seq` tokens: ceil(k·seq/experts·factor)."""
        return math.ceil(self.moe_top_k * seq / self.experts * self.moe_capacity_factor)

    def with_overrides(self, **overrides) -> "GPTConfig":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known - {'name'})}")
        return replace(self, **overrides)


def _gpt2(name, layers, hidden, heads):
    return GPTConfig(name=name, vocab=50304, seq_len=1024, layers=layers, hidden=hidden, heads=heads,
                     ffn_hidden=4 * hidden, bias=True, tie_embeddings=True)


def _megatron_gpt(name, layers, hidden, heads):
    """The GPT models of the Megatron papers: seq 2048, vocab 51,200 (GPT-2's BPE padded to a multiple
    of 1024), 4h MLP, biases, learned positions, head tied to the token table (Megatron's default)."""
    return GPTConfig(name=name, vocab=51200, seq_len=2048, layers=layers, hidden=hidden, heads=heads,
                     ffn_hidden=4 * hidden, bias=True, tie_embeddings=True)


def _llama(name, layers, hidden, heads, ffn, kv_heads=None, vocab=32000, seq_len=4096, **moe):
    """Llama: RMSNorm, SwiGLU, rotary positions, no biases, untied LM head (Mixtral: the same with
    `moe` fields)."""
    return GPTConfig(name=name, vocab=vocab, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv_heads, ffn_hidden=ffn, norm="rmsnorm", activation="swiglu", position="rope", **moe)


PRESETS: dict[str, GPTConfig] = {
    # CPU tests: small enough for 8 ranks on 2 cores.
    "tiny": GPTConfig(name="tiny", vocab=256, seq_len=32, layers=4, hidden=64, heads=4, ffn_hidden=256),
    # tiny with grouped-query attention (2 query heads per K/V head), and as a Llama.
    "tiny-gqa": GPTConfig(name="tiny-gqa", vocab=256, seq_len=32, layers=4, hidden=64, heads=4, kv_heads=2,
                          ffn_hidden=256),
    "tiny-llama": _llama("tiny-llama", 4, 64, 4, 128, kv_heads=2, vocab=256, seq_len=32),
    # tiny-llama with 4 experts (top-2, expert width 64) in blocks 1-3; block 0 keeps the dense MLP.
    "tiny-moe": _llama("tiny-moe", 4, 64, 4, 128, kv_heads=2, vocab=256, seq_len=32, experts=4, moe_ffn_hidden=64,
                       dense_layers=1),
    # CPU benchmarks: big enough that compute dominates start-up.
    "small": GPTConfig(name="small", vocab=4096, seq_len=128, layers=4, hidden=256, heads=8, ffn_hidden=1024),
    # small with 8 experts of half its MLP width, top-2: small's FLOPs per token, 4× its MLP weights.
    "small-moe": GPTConfig(name="small-moe", vocab=4096, seq_len=128, layers=4, hidden=256, heads=8, ffn_hidden=1024,
                           experts=8, moe_ffn_hidden=512),
    # Radford et al. 2019 (vocab padded from 50,257 to 50,304).
    "gpt2-124m": _gpt2("gpt2-124m", 12, 768, 12),
    "gpt2-1.5b": _gpt2("gpt2-1.5b", 48, 1600, 25),
    # Touvron et al. 2023, "Llama 2", Table 1 and the released configs: 70B uses 8 KV heads.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 28672, kv_heads=8),
    # Llama Team 2024, "The Llama 3 Herd of Models", Table 3 (vocab 128,256, 8 KV heads); seq_len is
    # the 8,192-token pre-training context (3.1's 128K extension is a later stage).
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3.1-405b": _llama("llama3.1-405b", 126, 16384, 128, 53248, kv_heads=8, vocab=128256, seq_len=8192),
    # Jiang et al. 2024, "Mixtral of Experts", Table 1 (Mistral 7B's block with 8 SwiGLU experts, top-2,
    # 32k context): 46.7B total, 12.9B active (Mistral's release note; the paper rounds to 47B / 13B).
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 14336, kv_heads=8, vocab=32000, seq_len=32768, experts=8),
    # Mistral AI 2024, "Cheaper, Better, Faster, Stronger" (Mixtral 8x22B release) and its released config:
    # 56 layers, hidden 6144, 48 heads / 8 KV, experts of 16384, vocab 32768, 64k context: 141B / 39B active.
    "mixtral-8x22b": _llama("mixtral-8x22b", 56, 6144, 48, 16384, kv_heads=8, vocab=32768, seq_len=65536, experts=8),
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 3
    # (the models its analysis is validated on; 175B is GPT-3, Brown et al. 2020, Table 2.1).
    "gpt-22b": _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt3-175b": _megatron_gpt("gpt3-175b", 96, 12288, 96),
    "gpt-530b": _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _megatron_gpt("gpt-1t", 128, 25600, 160),
    # Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    # Megatron-LM" (arXiv:2104.04473), Table 1: the weak-scaling GPTs between 1.7B and 310B (its 530B
    # and 1T rows are gpt-530b and gpt-1t above); named by the table's parameter counts.
    "gpt-1.7b": _megatron_gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _megatron_gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _megatron_gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18b": _megatron_gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _megatron_gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _megatron_gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _megatron_gpt("gpt-145b", 80, 12288, 96),
    "gpt-310b": _megatron_gpt("gpt-310b", 96, 16384, 128),
}


def get_preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def block_params(cfg: GPTConfig, layer: int | None = None) -> int:
    """Parameters of block `layer`; None: the last block (an MoE block in an MoE model). An MoE block's
    router, experts and shared experts have no biases (Mixtral, DeepSeek and Qwen have none)."""
    layer = cfg.layers - 1 if layer is None else layer
    attn_biases = (cfg.qkv_out + cfg.hidden) if cfg.bias else 0
    attn = cfg.hidden * cfg.qkv_out + cfg.hidden * cfg.hidden + attn_biases
    if cfg.moe_layer(layer):
        mlp = _router_params(cfg) + cfg.experts * expert_params(cfg) + _shared_params(cfg)
    else:
        mlp = cfg.hidden * cfg.fc1_out + cfg.ffn_hidden * cfg.hidden + ((cfg.fc1_out + cfg.hidden) if cfg.bias else 0)
    return attn + mlp + 2 * _norm_params(cfg)


def block_matmul_weights(cfg: GPTConfig, layer: int | None = None) -> int:
    """Elements of the matmul weights one token passes through in block `layer` (None: the last): qkv,
    attention output, and fc1 (with SwiGLU's gate) and fc2 of the MLP, or, in an MoE block, the router,
    `moe_top_k` experts and the shared experts (the active weights)."""
    layer = cfg.layers - 1 if layer is None else layer
    h = cfg.hidden
    attn = h * cfg.qkv_out + h * h
    if cfg.moe_layer(layer):
        return attn + _router_params(cfg) + cfg.moe_top_k * expert_params(cfg) + _shared_params(cfg)
    return attn + h * cfg.fc1_out + cfg.ffn_hidden * h


def expert_params(cfg: GPTConfig) -> int:
    """Parameters of one routed expert (its fc1 and fc2, no biases)."""
    return cfg.hidden * (cfg.experts_fc1_out + cfg.expert_ffn)


def _router_params(cfg: GPTConfig) -> int:
    return cfg.experts * cfg.hidden


def _shared_params(cfg: GPTConfig) -> int:
    fc1_out = 2 * cfg.shared_ffn if cfg.activation == "swiglu" else cfg.shared_ffn
    return cfg.hidden * (fc1_out + cfg.shared_ffn)


def _norm_params(cfg: GPTConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" else 1)


def embedding_params(cfg: GPTConfig) -> int:
    """Token table plus the learned position table."""
    return cfg.vocab * cfg.hidden + (cfg.seq_len * cfg.hidden if cfg.position == "learned" else 0)


def head_params(cfg: GPTConfig) -> int:
    """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
    return _norm_params(cfg) + (0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden)


def count_params(cfg: GPTConfig) -> int:
    """Exact number of trainable parameters of `models.GPT(cfg)` (every expert counted)."""
    blocks = sum(block_params(cfg, i) for i in range(cfg.layers)) if cfg.is_moe else cfg.layers * block_params(cfg)
    return embedding_params(cfg) + blocks + head_params(cfg)


def count_active_params(cfg: GPTConfig) -> int:
    """Parameters one token uses, the convention Mistral (Mixtral's 12.9B) and DeepSeek (V3's 37B)
    publish: every parameter (embedding, head, norms, attention, dense MLPs, routers, shared experts)
    except the routed experts it is not sent to, i.e. count_params less (experts − top_k) experts per
    MoE block. Equals count_params for a dense model."""
    return count_params(cfg) - cfg.moe_layers * (cfg.experts - cfg.moe_top_k) * expert_params(cfg)


def matmul_params(cfg: GPTConfig) -> int:
    """Weights that take part in a matmul per token: block linears (MoE blocks: router, top-k experts,
    shared experts) plus the LM head."""
    blocks = (sum(block_matmul_weights(cfg, i) for i in range(cfg.layers)) if cfg.is_moe
              else cfg.layers * block_matmul_weights(cfg))
    return blocks + cfg.vocab * cfg.hidden


def flops_per_token(cfg: GPTConfig, seq: int | None = None) -> int:
    """Training FLOPs per token (forward + backward), by the convention in this module's docstring."""
    seq = cfg.seq_len if seq is None else seq
    return 6 * matmul_params(cfg) + 12 * cfg.layers * cfg.hidden * seq


# --- the parameter table ------------------------------------------------------------------------------
# Every parameter of `models.GPT`, in `named_parameters()` order, with how each parallel dimension
# treats it. The engines (bench.surgery's tp slices, bench.native.tensor's layers, the fsdp backend's
# DTensor plan) and the cost model (bench.analysis.params) read it; tests/test_param_table.py checks it
# against the module. A new parallel dimension is a new ParamSpec field.
TpKind = Literal["column", "row", "vocab", "replicated"]
Owner = Literal["embed", "block", "final", "head"]
EpKind = Literal["dense", "expert"]


def tp_split_dim(kind: TpKind, ndim: int = 2) -> int | None:
    """Dimension a tp shard of this kind is cut along in a parameter of `ndim` dims, counted from the
    matrix's end (a 3-D expert weight is a stack of matrices): column, the output rows (dim 0 of a
    matrix and of its bias, dim 1 of a stack); row, the input columns (dim 1, or 2); vocab, dim 0;
    None for replicated."""
    if kind == "column":
        return max(ndim - 2, 0)
    return {"vocab": 0, "row": ndim - 1}.get(kind)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the GPT and its placement along each parallel dimension."""

    name: str
    """The full model's name (`blocks.3.mlp.fc1.weight`): the key of its initial value and of its shard."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    tp: TpKind
    """Tensor parallel (Megatron): column = output rows split (dim 0, the bias with them); row = input
    columns split (dim 1; its bias is replicated, added once after the sum); vocab = vocabulary rows
    split (dim 0); replicated = whole on every tp rank (under sequence parallel its gradient is partial
    per sequence chunk and is summed over tp)."""
    owner: Owner
    """The part of the model that holds it: the pipeline stage that owns it follows (embed: the first
    stage, block: the stage holding `layer`, final and head: the last)."""
    layer: int | None = None
    """The block index (owner "block"), else None."""
    dp: Literal["sharded"] = "sharded"
    """ZeRO-3 / FSDP: every parameter is partitioned over dp (DeepSpeed keeping small ones whole is a
    size threshold of that engine, not a property of the parameter)."""
    tied_to: str | None = None
    """The parameter whose tensor this one shares (the head when tie_embeddings); `named_parameters()`
    lists the shared tensor once, under the other name."""
    ep: EpKind = "dense"
    """Expert parallel: an expert weight (E, …) is split over ep along dim 0 (whole experts) and its
    gradient reduced over the expert-data-parallel group; a dense one is whole on every ep rank and
    reduced over dp × cp."""

    @property
    def split_dim(self) -> int | None:
        """Dimension its tp shard is cut along; None when replicated over tp."""
        return tp_split_dim(self.tp, len(self.shape))

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """This parameter's shape on one of `tp` tensor-parallel ranks."""
        dim = self.split_dim
        if dim is None or tp == 1:
            return self.shape
        return self.shape[:dim] + (self.shape[dim] // tp,) + self.shape[dim + 1:]


def _norm_specs(cfg: GPTConfig, name: str, owner: Owner, layer: int | None = None) -> tuple[ParamSpec, ...]:
    weight = ParamSpec(f"{name}.weight", (cfg.hidden,), "replicated", owner, layer)
    if cfg.norm == "rmsnorm":
        return (weight,)
    return weight, ParamSpec(f"{name}.bias", (cfg.hidden,), "replicated", owner, layer)


def _linear_specs(cfg: GPTConfig, name: str, out_f: int, in_f: int, tp: TpKind,
                  layer: int) -> tuple[ParamSpec, ...]:
    """A block's linear (weight (out, in)); a column split cuts its bias too, a row split replicates it."""
    weight = ParamSpec(f"{name}.weight", (out_f, in_f), tp, "block", layer)
    if not cfg.bias:
        return (weight,)
    return weight, ParamSpec(f"{name}.bias", (out_f,), "column" if tp == "column" else "replicated", "block", layer)


@lru_cache(maxsize=1024)
def embed_table(cfg: GPTConfig) -> tuple[ParamSpec, ...]:
    """The token table (vocab-parallel) and the learned position table (replicated)."""
    tok = ParamSpec("embed.tok.weight", (cfg.vocab, cfg.hidden), "vocab", "embed")
    if cfg.position != "learned":
        return (tok,)
    return tok, ParamSpec("embed.pos.weight", (cfg.seq_len, cfg.hidden), "replicated", "embed")


@lru_cache(maxsize=65536)
def block_table(cfg: GPTConfig, layer: int) -> tuple[ParamSpec, ...]:
    """Block `layer`: each of attention and MLP is a column-parallel linear then a row-parallel one;
    an MoE block's MLP is its router, experts and shared experts (`_moe_specs`)."""
    h, p = cfg.hidden, f"blocks.{layer}"
    mlp = (_moe_specs(cfg, f"{p}.mlp", layer) if cfg.moe_layer(layer) else
           (*_linear_specs(cfg, f"{p}.mlp.fc1", cfg.fc1_out, h, "column", layer),
            *_linear_specs(cfg, f"{p}.mlp.fc2", h, cfg.ffn_hidden, "row", layer)))
    return (*_norm_specs(cfg, f"{p}.ln1", "block", layer),
            *_linear_specs(cfg, f"{p}.attn.qkv", cfg.qkv_out, h, "column", layer),
            *_linear_specs(cfg, f"{p}.attn.proj", h, h, "row", layer),
            *_norm_specs(cfg, f"{p}.ln2", "block", layer),
            *mlp)


def _moe_specs(cfg: GPTConfig, p: str, layer: int) -> tuple[ParamSpec, ...]:
    """The router (replicated, dense), the experts' stacked fc1 (E, fc1_out, h) and fc2 (E, h, ffn)
    (tp-split like mlp.fc1 / mlp.fc2 inside each expert, ep-split over experts), the shared MLP. No biases."""
    h, e = cfg.hidden, cfg.experts
    shared_fc1 = 2 * cfg.shared_ffn if cfg.activation == "swiglu" else cfg.shared_ffn
    shared = (ParamSpec(f"{p}.shared.fc1.weight", (shared_fc1, h), "column", "block", layer),
              ParamSpec(f"{p}.shared.fc2.weight", (h, cfg.shared_ffn), "row", "block", layer))
    return (ParamSpec(f"{p}.router.weight", (e, h), "replicated", "block", layer),
            ParamSpec(f"{p}.experts.fc1", (e, cfg.experts_fc1_out, h), "column", "block", layer, ep="expert"),
            ParamSpec(f"{p}.experts.fc2", (e, h, cfg.expert_ffn), "row", "block", layer, ep="expert"),
            *(shared if cfg.shared_experts else ()))


@lru_cache(maxsize=1024)
def final_table(cfg: GPTConfig) -> tuple[ParamSpec, ...]:
    """The final norm."""
    return _norm_specs(cfg, "norm", "final")


@lru_cache(maxsize=1024)
def head_spec(cfg: GPTConfig) -> ParamSpec:
    """The LM head (vocab-parallel, no bias), tied or not: a pipeline's last stage holds its own copy
    of a tied head whenever the embedding lives on another stage."""
    return ParamSpec("head.weight", (cfg.vocab, cfg.hidden), "vocab", "head",
                     tied_to="embed.tok.weight" if cfg.tie_embeddings else None)


@lru_cache(maxsize=256)
def param_table(cfg: GPTConfig, with_tied: bool = False) -> tuple[ParamSpec, ...]:
    """Every parameter of `models.GPT(cfg)` in `named_parameters()` order; `with_tied`: a tied head too."""
    head = head_spec(cfg)
    blocks = tuple(s for i in range(cfg.layers) for s in block_table(cfg, i))
    return (*embed_table(cfg), *blocks, *final_table(cfg), *((head,) if with_tied or head.tied_to is None else ()))


# Every parameter kind that exists in some configuration (biases, layernorm, learned positions, a head,
# a dense block and an MoE block with shared experts).
_EVERY_KIND = GPTConfig(layers=2, bias=True, norm="layernorm", position="learned", tie_embeddings=False,
                        experts=2, shared_experts=1, dense_layers=1)


@lru_cache(maxsize=1)
def _spec_by_role() -> dict[str, ParamSpec]:
    """A table entry per name inside its part (`attn.qkv.weight`, `embed.tok.weight`): no tp kind,
    ep kind or number of dims depends on the configuration, only whether the parameter exists."""
    return {_role(s.name): s for s in param_table(_EVERY_KIND)}


def _role(name: str) -> str:
    """A parameter's name without its block prefix: `blocks.3.attn.qkv.weight` → `attn.qkv.weight`."""
    parts = name.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[digits[-1] + 1:]) if digits else name


def role_spec(name: str) -> ParamSpec:
    """The table entry of parameter `name`'s kind (its tp and ep kinds and number of dims; the shape is
    an example's): named as in the full GPT, under a pipeline piece's prefix (`3.attn.qkv.weight`) or a
    wrapper's (`module.embed.tok.weight`); a name the GPT lacks is an error."""
    specs, parts = _spec_by_role(), _role(name).split(".")
    for k in range(len(parts)):
        if (spec := specs.get(".".join(parts[k:]))) is not None:
            return spec
    raise ValueError(f"{name!r} is not a parameter of models.GPT; known: {', '.join(specs)}")


def tp_kind(name: str) -> TpKind:
    """The tp kind of parameter `name` (named as `role_spec` reads names)."""
    return role_spec(name).tp


def split_dim(name: str) -> int | None:
    """Dimension along which parameter `name` is sharded over tp; None when replicated."""
    return role_spec(name).split_dim
