"""GPT model configuration, named presets, exact parameter and FLOP counts.

FLOP convention (the one place it is written; `bench` and docs/row-schema.md quote it):
model FLOPs per token for one training step (forward + backward = 3 × forward) are
    6 · (weights of every matmul: QKV, attention output, MLP, LM head)
  + 12 · layers · hidden · seq          (attention scores QKᵀ and the weighted sum of V, per query
                                         head: grouped-query attention shrinks QKV, not this term)
Attention is counted non-causal (the full s×s product, as Megatron and PaLM count it);
embedding lookups, norms, biases, softmax and activations are not counted; recomputation
is not counted (model FLOPs, not hardware FLOPs).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


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

    def __post_init__(self):
        for name in ("vocab", "seq_len", "layers", "hidden", "heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"model.kv_heads ({self.kv_heads}) must be ≥ 1 and divide model.heads ({self.heads}); "
                             f"pick kv_heads from the divisors of {self.heads}")
        for name, allowed in (("norm", NORMS), ("activation", ACTIVATIONS), ("position", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name} is {getattr(self, name)!r}; choose one of {', '.join(allowed)}")

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


def _llama(name, layers, hidden, heads, ffn, kv_heads=None, vocab=32000, seq_len=4096):
    """Llama: RMSNorm, SwiGLU, rotary positions, no biases, untied LM head."""
    return GPTConfig(name=name, vocab=vocab, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv_heads, ffn_hidden=ffn, norm="rmsnorm", activation="swiglu", position="rope")


PRESETS: dict[str, GPTConfig] = {
    # CPU tests: small enough for 8 ranks on 2 cores.
    "tiny": GPTConfig(name="tiny", vocab=256, seq_len=32, layers=4, hidden=64, heads=4, ffn_hidden=256),
    # tiny with grouped-query attention (2 query heads per K/V head), and as a Llama.
    "tiny-gqa": GPTConfig(name="tiny-gqa", vocab=256, seq_len=32, layers=4, hidden=64, heads=4, kv_heads=2,
                          ffn_hidden=256),
    "tiny-llama": _llama("tiny-llama", 4, 64, 4, 128, kv_heads=2, vocab=256, seq_len=32),
    # CPU benchmarks: big enough that compute dominates start-up.
    "small": GPTConfig(name="small", vocab=4096, seq_len=128, layers=4, hidden=256, heads=8, ffn_hidden=1024),
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
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 3
    # (the models its analysis is validated on; 175B is GPT-3, Brown et al. 2020, Table 2.1).
    "gpt-22b": _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt3-175b": _megatron_gpt("gpt3-175b", 96, 12288, 96),
    "gpt-530b": _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _megatron_gpt("gpt-1t", 128, 25600, 160),
}


def get_preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def block_params(cfg: GPTConfig) -> int:
    """Parameters of one transformer block."""
    biases = (cfg.qkv_out + cfg.hidden + cfg.fc1_out + cfg.hidden) if cfg.bias else 0
    return block_matmul_weights(cfg) + biases + 2 * _norm_params(cfg)


def block_matmul_weights(cfg: GPTConfig) -> int:
    """Elements of one block's four matmul weights: qkv, attention output, fc1 (with SwiGLU's gate), fc2."""
    h = cfg.hidden
    return h * cfg.qkv_out + h * h + h * cfg.fc1_out + cfg.ffn_hidden * h


def _norm_params(cfg: GPTConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" else 1)


def embedding_params(cfg: GPTConfig) -> int:
    """Token table plus the learned position table."""
    return cfg.vocab * cfg.hidden + (cfg.seq_len * cfg.hidden if cfg.position == "learned" else 0)


def head_params(cfg: GPTConfig) -> int:
    """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
    return _norm_params(cfg) + (0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden)


def count_params(cfg: GPTConfig) -> int:
    """Exact number of trainable parameters of `models.GPT(cfg)`."""
    return embedding_params(cfg) + cfg.layers * block_params(cfg) + head_params(cfg)


def matmul_params(cfg: GPTConfig) -> int:
    """Weights that take part in a matmul per token: block linears plus the LM head."""
    return cfg.layers * block_matmul_weights(cfg) + cfg.vocab * cfg.hidden


def flops_per_token(cfg: GPTConfig, seq: int | None = None) -> int:
    """Training FLOPs per token (forward + backward), by the convention in this module's docstring."""
    seq = cfg.seq_len if seq is None else seq
    return 6 * matmul_params(cfg) + 12 * cfg.layers * cfg.hidden * seq
