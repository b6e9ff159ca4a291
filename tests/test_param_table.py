"""The model's parameter table (models.config.param_table) is the GPT's `named_parameters()`, and every
reader agrees with it: surgery's tp split, the native tp layers, the fsdp backend's DTensor plan and the
cost model's per-rank listing (bench.analysis.params)."""
import types

import pytest
import torch

from bench.analysis.params import chunk_params, stage_chunk_params
from bench.native.tensor import apply_tensor_parallel
from bench.surgery import meta_module, split_dim
from models import GPT, PRESETS, get_preset
from models.config import block_params, block_table, count_params, param_table, tp_kind

TINY = get_preset("tiny")
# Every shape variety: activation, norm, positions, biases, tying, GQA, layer counts, MoE blocks (with
# dense ones, shared experts, biases elsewhere); and every preset.
VARIANTS = {
    "tiny": TINY,
    "swiglu-rmsnorm-rope": TINY.with_overrides(activation="swiglu", norm="rmsnorm", position="rope"),
    "bias-tied": TINY.with_overrides(bias=True, tie_embeddings=True),
    "bias-untied-rope": TINY.with_overrides(bias=True, position="rope"),
    "gqa-bias": TINY.with_overrides(kv_heads=2, bias=True),
    "mqa-swiglu": TINY.with_overrides(kv_heads=1, activation="swiglu"),
    "one-layer": TINY.with_overrides(layers=1),
    "seven-layers-tied-rmsnorm": TINY.with_overrides(layers=7, tie_embeddings=True, norm="rmsnorm"),
    "moe-gelu-bias-shared": TINY.with_overrides(experts=4, moe_top_k=1, shared_experts=2, bias=True, dense_layers=1),
    "moe-swiglu-shared-all-moe": get_preset("tiny-moe").with_overrides(shared_experts=1, dense_layers=0,
                                                                      moe_ffn_hidden=32),
    **{f"preset-{name}": cfg for name, cfg in PRESETS.items()},
}

# The Megatron split, written out once more as the golden answer (a table that drifts fails here).
MEGATRON = {"embed.tok.weight": "vocab", "embed.pos.weight": "replicated", "ln1.weight": "replicated",
            "ln1.bias": "replicated", "attn.qkv.weight": "column", "attn.qkv.bias": "column",
            "attn.proj.weight": "row", "attn.proj.bias": "replicated", "ln2.weight": "replicated",
            "ln2.bias": "replicated", "mlp.fc1.weight": "column", "mlp.fc1.bias": "column",
            "mlp.fc2.weight": "row", "mlp.fc2.bias": "replicated", "norm.weight": "replicated",
            "norm.bias": "replicated", "head.weight": "vocab",
            # MoE: the router replicated; each expert (and the shared MLP) split as the dense MLP
            "mlp.router.weight": "replicated", "mlp.experts.fc1": "column", "mlp.experts.fc2": "row",
            "mlp.shared.fc1.weight": "column", "mlp.shared.fc2.weight": "row"}
EXPERT_WEIGHTS = {"mlp.experts.fc1", "mlp.experts.fc2"}


def role(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_table_is_the_models_named_parameters_in_order(cfg):
    model = meta_module(lambda: GPT(cfg))
    assert [(s.name, s.shape) for s in param_table(cfg)] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_parameter_is_split_as_megatron_and_owned_by_its_part(cfg):
    for s in param_table(cfg, with_tied=True):
        assert s.tp == MEGATRON[role(s.name)] == tp_kind(s.name), s.name
        stacked = role(s.name) in EXPERT_WEIGHTS  # (E, out, in): each expert's matrix split as a linear's
        assert s.ep == ("expert" if stacked else "dense"), s.name
        want = {"column": 0, "vocab": 0, "row": 1}.get(s.tp)
        assert split_dim(s.name) == s.split_dim == (want + 1 if stacked and want is not None else want), s.name
        if s.name.startswith("blocks."):
            assert (s.owner, s.layer) == ("block", int(s.name.split(".")[1])), s.name
        else:
            assert (s.owner, s.layer) == ({"embed": "embed", "norm": "final", "head": "head"}[s.name.split(".")[0]],
                                          None), s.name


def test_a_tied_head_is_listed_only_on_request_and_names_its_tensor():
    cfg = VARIANTS["bias-tied"]
    model = meta_module(lambda: GPT(cfg))
    assert model.head.weight is model.embed.tok.weight
    head = param_table(cfg, with_tied=True)[-1]
    assert (head.name, head.tied_to) == ("head.weight", "embed.tok.weight")
    assert param_table(cfg) == param_table(cfg, with_tied=True)[:-1]
    assert param_table(TINY, with_tied=True)[-1].tied_to is None


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_counts_are_the_tables_sums(cfg):
    numel = lambda specs: sum(torch.Size(s.shape).numel() for s in specs)  # noqa: E731
    assert numel(param_table(cfg)) == count_params(cfg)
    for layer in range(cfg.layers):
        assert numel(block_table(cfg, layer)) == block_params(cfg, layer)


def test_split_dim_reads_pipeline_piece_names_and_refuses_unknown_ones():
    assert split_dim("3.attn.proj.weight") == 1 and split_dim("blocks.3.attn.qkv.bias") == 0
    assert split_dim("embed.pos.weight") is None
    with pytest.raises(ValueError, match="'blocks.0.attn.wq.weight' is not a parameter of models.GPT"):
        split_dim("blocks.0.attn.wq.weight")


@pytest.mark.parametrize("name", ["tiny", "gqa-bias", "bias-tied", "swiglu-rmsnorm-rope"])
@pytest.mark.parametrize("tp", [2])
def test_native_tp_layers_hold_the_tables_local_shapes(name, tp):
    cfg = VARIANTS[name]
    run_cfg = types.SimpleNamespace(model_config=cfg, sequence_parallel=False)
    model = apply_tensor_parallel(meta_module(lambda: GPT(cfg)), run_cfg, None, 0, tp)
    model.tie_weights()
    want = [(s.name, s.local_shape(tp)) for s in param_table(cfg)]
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == want


def test_cost_model_lists_the_tables_local_shapes():
    cfg, tp = VARIANTS["gqa-bias"], 2
    listing = chunk_params(cfg, tp, True, True, list(range(cfg.layers)), False)
    assert listing == [(s.name, s.local_shape(tp), s.tp != "replicated") for s in param_table(cfg)]
    # fsdp's DTensor plan keeps the vocab tables whole
    whole = {n: shape for n, shape, _ in stage_chunk_params(cfg, tp, 1, 1, 0, vocab_parallel=False)[0]}
    assert whole["embed.tok.weight"] == whole["head.weight"] == (cfg.vocab, cfg.hidden)
    assert whole["blocks.0.mlp.fc2.weight"] == (cfg.hidden, cfg.ffn_hidden // tp)


def test_a_tied_head_on_another_stage_than_the_embedding_is_its_own_parameter():
    cfg = VARIANTS["bias-tied"]
    first, last = (stage_chunk_params(cfg, 2, 2, 1, stage)[0] for stage in (0, 1))
    assert first[0][0] == "embed.tok.weight" and last[-1] == ("head.weight", (cfg.vocab // 2, cfg.hidden), True)
    assert "head.weight" not in {n for n, _, _ in stage_chunk_params(cfg, 2, 1, 1, 0)[0]}


def test_fsdp_plan_is_colwise_for_column_and_rowwise_for_row():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from bench.backends.fsdp import block_tp_plan
    plan = block_tp_plan(VARIANTS["gqa-bias"])
    assert list(plan) == ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
    assert [type(style) for style in plan.values()] == [ColwiseParallel, RowwiseParallel, ColwiseParallel,
                                                         RowwiseParallel]
