"""An HF `config.json`: the model's shape (alone: `bench import config.json --world-size N`, data parallel over N;
or with a framework config: `--model-config config.json`). One key table per model family; defaults are
transformers' own config classes' (LlamaConfig, GPT2Config)."""
from __future__ import annotations

from bench.ecosystem.table import Flag, Imported, SourceError, prefix_reason

FRAMEWORK = "transformers"

LLAMA = {
    "vocab_size": Flag("model.vocab", 32000, int), "max_position_embeddings": Flag("model.seq_len", 2048, int),
    "num_hidden_layers": Flag("model.layers", 32, int), "hidden_size": Flag("model.hidden", 4096, int),
    "num_attention_heads": Flag("model.heads", 32, int), "num_key_value_heads": Flag("model.kv_heads", None, int),
    "intermediate_size": Flag("model.ffn_hidden", 11008, int),
    "hidden_act": Flag("model.activation", "silu", {"silu": "swiglu"}),
    "tie_word_embeddings": Flag("model.tie_embeddings", False, bool),
    "attention_bias": Flag("model.bias", False, {False: False}), "mlp_bias": Flag("model.bias", False, {False: False}),
}
"""LlamaConfig (Mistral and Qwen2 read alike, with their own blockers): RMSNorm, rope, gated MLP."""
GPT2 = {
    "vocab_size": Flag("model.vocab", 50257, int), "n_positions": Flag("model.seq_len", 1024, int),
    "n_layer": Flag("model.layers", 12, int), "n_embd": Flag("model.hidden", 768, int),
    "n_head": Flag("model.heads", 12, int), "n_inner": Flag("model.ffn_hidden", None, int),
    "activation_function": Flag("model.activation", "gelu_new", {"gelu_new": "gelu", "gelu": "gelu"}),
    "tie_word_embeddings": Flag("model.tie_embeddings", True, bool),
}
FIXED = {"llama": dict(norm="rmsnorm", position="rope"), "gpt2": dict(norm="layernorm", position="learned", bias=True)}
FAMILIES = {"llama": ("llama", LLAMA), "mistral": ("llama", LLAMA), "qwen2": ("llama", LLAMA), "gpt2": ("gpt2", GPT2)}
BLOCKS = {"head_dim": "a head_dim of its own", "sliding_window": "sliding-window attention",
          "num_local_experts": "mixture of experts", "num_experts": "mixture of experts", "qk_norm": "qk-layernorm"}
FAMILY_BLOCKS = {"qwen2": "bias on q, k and v only (Qwen2)"}
NO_EFFECT = {"architectures": "class name", "model_type": "read above", "torch_dtype": "checkpoint dtype",
             "dtype": "checkpoint dtype", "transformers_version": "version", "bos_token_id": "tokenizer",
             "eos_token_id": "tokenizer", "pad_token_id": "tokenizer", "rope_theta": "rope base: numerics only",
             "rope_scaling": "rope scaling: numerics only", "rms_norm_eps": "numerics only",
             "layer_norm_epsilon": "numerics only", "initializer_range": "initialization", "use_cache": "inference only",
             "attention_dropout": "dropout (none here)", "resid_pdrop": "dropout (none here)", "embd_pdrop": "dropout (none here)",
             "attn_pdrop": "dropout (none here)", "pretraining_tp": "numerics only", "summary_": "a classification head",
             "task_specific_params": "inference only", "n_ctx": "the same as n_positions", "_name_or_path": "name",
             "max_window_layers": "sliding window (off)", "use_sliding_window": "sliding window switch",
             "scale_attn_": "numerics only", "reorder_and_upcast_attn": "numerics only"}


def read(data: dict, source: str, world_size: int | None = None) -> Imported:
    """The shape (Imported.model) and, for an import on its own, a data-parallel layout over the world."""
    kind = data.get("model_type")
    if kind not in FAMILIES:
        raise SourceError(source, "model_type", f"{kind!r} is not a known family ({', '.join(FAMILIES)})")
    family, table = FAMILIES[kind]
    imp = Imported(FRAMEWORK, source)
    imp.model.update(FIXED[family])
    for key, flag in table.items():
        if key in data:
            try:
                imp.mapped(key, data[key], flag.target, _convert(flag, data[key], key, source))
            except KeyError:
                imp.dropped(key, data[key], f"not expressible: {key} {data[key]} (issue 26)", blocks=True)
        elif flag.default is not None:
            imp.defaulted(key, flag.default, flag.target, flag.value(flag.default))
    if imp.model.get("ffn_hidden") is None:  # GPT-2's n_inner: None is 4h
        imp.model["ffn_hidden"] = 4 * imp.model["hidden"]
    if kind in FAMILY_BLOCKS:
        imp.dropped("model_type", kind, f"not expressible: {FAMILY_BLOCKS[kind]} (issue 26)", blocks=True)
    for key, value in data.items():
        if key not in table:
            _leftover(imp, key, value)
    imp.values.update(backend="native", world_size=world_size or 1, dp=world_size or 1)
    imp.on_gpus()
    return imp


def _convert(flag: Flag, value, key: str, source: str):
    if flag.convert is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise SourceError(source, key, f"{value!r} is not an integer")
    return value if flag.convert in (int, bool) else flag.value(value)


def _leftover(imp: Imported, key: str, value) -> None:
    if key == "head_dim" and value * imp.model["heads"] == imp.model["hidden"]:
        imp.add(key, value, "mapped", "head_dim = hidden / heads (implied)")
    elif key in BLOCKS and value not in (None, False, 0):
        imp.dropped(key, value, f"not expressible: {BLOCKS[key]} (issue 26)", blocks=True)
    elif key in BLOCKS or prefix_reason(key, NO_EFFECT):
        imp.dropped(key, value, f"no effect on the layout: {prefix_reason(key, NO_EFFECT) or 'off'}")
    else:
        imp.dropped(key, value, "unknown to the importer: assumed not to change the layout or the math")
