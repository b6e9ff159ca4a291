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


# Every preset's exact count. Llama: the parameter counts of the released checkpoints (sum of the
# tensor sizes); the GPT models: from the architecture of the cited papers (see models/config.py).
EXACT_PARAMS = {
    "tiny": 232_576, "tiny-gqa": 216_192, "tiny-llama": 180_800, "tiny-moe": 255_296, "small": 5_280_256,
    "small-moe": 11_579_904, "mixtral-8x7b": 46_702_792_704, "mixtral-8x22b": 140_630_071_296,
    "gpt2-124m": 124_475_904, "gpt2-1.5b": 1_557_686_400,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
    "gpt-22b": 22_074_273_792, "gpt3-175b": 174_615_846_912, "gpt-530b": 529_600_819_200,
    "gpt-1t": 1_008_038_758_400, "gpt-1.7b": 1_652_230_656, "gpt-3.6b": 3_562_168_320,
    "gpt-7.5b": 7_467_786_240, "gpt-18b": 18_449_756_160, "gpt-39b": 39_096_041_472, "gpt-76b": 76_050_739_200,
    "gpt-145b": 145_622_261_760, "gpt-310b": 310_130_540_544,
}


def test_exact_parameter_count_of_every_preset():
    assert set(EXACT_PARAMS) == set(PRESETS)
    for name, n in EXACT_PARAMS.items():
        assert count_params(PRESETS[name]) == n, name
    assert abs(count_params(PRESETS["gpt2-124m"]) - 124.4e6) < 0.2e6  # GPT-2 small (vocab padded to 50304)
    assert abs(count_params(PRESETS["gpt3-175b"]) - 174.6e9) < 0.5e9  # Brown et al. 2020


def test_models_page_preset_table_lists_every_preset_with_its_count():
    import re
    from pathlib import Path
    page = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    table = {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^\| `([\w.-]+)` \| ([\d,]+) \|", page, re.M)}
    assert table == EXACT_PARAMS


def test_gqa_param_counts_match_the_module_and_kv_heads_default_is_mha():
    base = get_preset("tiny")
    assert base.with_overrides(kv_heads=4).qkv_out == base.qkv_out == 3 * base.hidden
    for cfg in (get_preset("tiny-gqa"), get_preset("tiny-llama"), base.with_overrides(kv_heads=1, bias=True)):
        assert sum(p.numel() for p in build_model(cfg, 0).parameters()) == count_params(cfg), cfg.name
    with pytest.raises(ValueError, match="kv_heads .3. must be ≥ 1 and divide model.heads .4."):
        base.with_overrides(kv_heads=3)


def test_gqa_equals_multi_head_attention_with_shared_kv():
    # A GQA model computes what the MHA model computes when every query head of a group gets
    # its group's K/V weights: the fused layout (kv_heads, group + 2, head_dim) read as intended.
    gqa_cfg = get_preset("tiny-gqa").with_overrides(bias=True, position="rope")
    mha_cfg = gqa_cfg.with_overrides(kv_heads=None)
    gqa, mha = build_model(gqa_cfg, 0), build_model(mha_cfg, 0)
    g, hd = gqa_cfg.group, gqa_cfg.head_dim
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                grouped = src.view(gqa_cfg.num_kv_heads, g + 2, hd, *src.shape[1:])
                q, k, v = grouped.split((g, 1, 1), dim=1)
                heads = torch.stack((q, k.expand_as(q), v.expand_as(q)), dim=2)  # (kv, g, 3, hd, ...)
                src = heads.reshape(p.shape)
            p.copy_(src)
    idx = torch.randint(0, gqa_cfg.vocab, (2, gqa_cfg.seq_len))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


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


def test_config_hash_is_its_fields_hash_in_every_process():
    """GPTConfig keeps its hash (the cost model's caches key on it); a copy or an unpickled config
    (a spawned rank) hashes and compares as one built from its fields."""
    import copy
    import pickle
    import subprocess
    import sys
    from dataclasses import astuple, replace
    from pathlib import Path
    cfg = get_preset("llama2-70b")
    assert hash(cfg) == hash(astuple(cfg)) and hash(replace(cfg, layers=3)) == hash(astuple(replace(cfg, layers=3)))
    for twin in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg), replace(cfg)):
        assert twin == cfg and hash(twin) == hash(cfg) and {twin: 1}[cfg] == 1
    code = ("import pickle, sys; from dataclasses import astuple; c = pickle.loads(sys.stdin.buffer.read()); "
            "assert hash(c) == hash(astuple(c)), 'stale hash'")
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cfg), check=True, cwd=Path(__file__).parents[1])
