"""The shared model: determinism, shard materialization from meta, exact counts."""
import pytest
import torch

from bench.data import global_batch, micro_batches
from bench.config import RunConfig
from models import GPT, build_model, count_params, flops_per_token, get_preset, init_value, PRESETS
from models.config import matmul_params


def test_same_seed_identical_weights_other_seed_differs():
    cfg = get_preset("tiny")
    a, b, c = build_model(cfg, 0), build_model(cfg, 0), build_model(cfg, 1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "weight" in n and pa.dim() == 2:
            assert not torch.equal(pa, pc), n


def test_shard_materialized_from_meta_equals_slice_of_full():
    cfg = get_preset("tiny")
    full = build_model(cfg, 3)
    with torch.device("meta"):
        meta = GPT(cfg)
    tp, rank = 4, 1
    for name, p in meta.named_parameters():
        if p.dim() == 2:  # column shard along dim 0, as tensor parallel takes it
            shard = init_value(name, p.shape, cfg, 3).chunk(tp, dim=0)[rank]
            assert torch.equal(shard, dict(full.named_parameters())[name].chunk(tp, dim=0)[rank])
    assert all(p.is_meta for p in meta.parameters())


def test_param_counts_exact_for_every_small_variant():
    base = get_preset("tiny")
    for over in [{}, {"bias": True}, {"activation": "swiglu", "norm": "rmsnorm", "position": "rope"},
                 {"tie_embeddings": True}]:
        cfg = base.with_overrides(**over)
        assert sum(p.numel() for p in build_model(cfg, 0).parameters()) == count_params(cfg), over


def test_published_parameter_counts():
    assert abs(count_params(PRESETS["gpt2-124m"]) - 124.4e6) < 0.2e6  # GPT-2 small (vocab padded to 50304)
    assert abs(count_params(PRESETS["llama2-7b"]) - 6.738e9) < 0.01e9  # Touvron et al. 2023
    assert abs(count_params(PRESETS["gpt3-175b"]) - 174.6e9) < 0.5e9  # Brown et al. 2020


def test_flops_convention():
    cfg = get_preset("gpt3-175b")
    # Narayanan et al. 2021 (PTD-P) eq. 3 per token: 72·l·h²·(1 + s/6h + V/12lh).
    l, h, s, V = cfg.layers, cfg.hidden, cfg.seq_len, cfg.vocab
    assert flops_per_token(cfg) == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    assert matmul_params(cfg) == 12 * l * h * h + V * h


def test_data_same_global_batch_whatever_the_layout():
    x, y = global_batch(0, 5, 8, 32, 256)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, global_batch(0, 5, 8, 32, 256)[0]) and not torch.equal(x, global_batch(0, 6, 8, 32, 256)[0])
    one = RunConfig(micro_batch=8)
    four = RunConfig(dp=4, micro_batch=1, micro_batches=2)
    parts = [mb[0] for r in range(4) for mb in micro_batches(four, 5, r)]
    assert torch.equal(torch.cat(parts), micro_batches(one, 5, 0)[0][0])
