"""Grouped-query attention on every backend: loss parity with the single-process reference, and the
cost model's communication and model-state bytes equal to what the counter measured.

tiny-gqa: 4 query heads sharing 2 K/V heads, so tp 2 puts one whole group (2 query heads, their K and
V) on each rank. The native engine's gradient parity on tp / pp / dp layouts is in test_native.py.
"""
import json
import math

import pytest
from click.testing import CliRunner

from bench.analysis.memory import layer_activation_bytes
from bench.cli import app
from bench.config import ConfigError, RunConfig
from models import PRESETS, count_params, flops_per_token

GQA = PRESETS["tiny-gqa"]
RUN = dict(model="tiny-gqa", steps=3, warmup=0)  # loss_last = the loss of the 3rd step; global batch 4


@pytest.fixture(scope="module")
def reference(pools):
    row = pools(1).run(RunConfig(**RUN, micro_batch=4))
    assert row["status"] == "ok", row.get("error")
    assert row["params"] == count_params(GQA) == 216_192
    return row["loss_last"]


def run_ok(pools, **kw) -> dict:
    cfg = RunConfig(**RUN, **kw)
    assert cfg.global_batch == 4  # the reference's
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row


def assert_predicted_equals_measured(row: dict) -> None:
    for dim in ("tp", "pp", "dp"):
        for what in ("bytes", "wire_bytes", "ops"):
            key = f"comm_{what}_{dim}"
            assert row[f"pred_{key}"] == pytest.approx(row[key], abs=1e-6), key
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert row[f"pred_{key}"] == row[key], key


@pytest.mark.parametrize("kw", [
    dict(backend="native", tp=2, micro_batch=4),
    dict(backend="native", pp=2, micro_batch=2, micro_batches=2),
    dict(backend="ddp", dp=2, micro_batch=2),
    dict(backend="fsdp", fsdp="full", tp=2, micro_batch=4),
    dict(backend="fsdp", fsdp="full", dp=2, micro_batch=2),
    dict(backend="fsdp", fsdp="full", pp=2, micro_batch=2, micro_batches=2),
    dict(backend="deepspeed", tp=2, micro_batch=4),
    dict(backend="deepspeed", pp=2, micro_batch=2, micro_batches=2),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_gqa_world2_parity_and_predicted_comm(pools, reference, kw):
    row = run_ok(pools, **kw)
    assert math.isclose(row["loss_last"], reference, rel_tol=1e-5), (row["loss_last"], reference)
    assert_predicted_equals_measured(row)
    if row["tp"] == 2:  # the qkv shard of a rank: one K/V head with its 2 query heads
        assert row["comm_bytes_tp"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(backend="native", tp=2, pp=2, micro_batch=2, micro_batches=2, sequence_parallel=True),
    dict(backend="fsdp", fsdp="full", tp=2, dp=2, micro_batch=2),
    dict(backend="deepspeed", tp=2, dp=2, micro_batch=2, zero=1),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_gqa_world4_parity_and_predicted_comm(pools, reference, kw):
    row = run_ok(pools, **kw)
    assert math.isclose(row["loss_last"], reference, rel_tol=1e-5), (row["loss_last"], reference)
    assert_predicted_equals_measured(row)


@pytest.mark.parametrize("backend", ["native", "fsdp", "deepspeed"])
def test_tp_must_divide_kv_heads(backend):
    # No backend replicates K/V over tp (Megatron does when tp > kv_heads): refused with the fix.
    with pytest.raises(ConfigError, match=r"model kv_heads \(2\) is not divisible by tp \(4\); "
                                          r"pick tp from the divisors of 2"):
        RunConfig(model="tiny-gqa", backend=backend, tp=4)


# --- pure: the cost model follows the grouping ----------------------------------------------------
@pytest.mark.parametrize("model,published", [("llama3-8b", 8_030_261_248), ("llama2-70b", 68_976_648_192),
                                             ("gpt-1t", 1_008_038_758_400)])
def test_estimate_reports_the_published_parameter_count(model, published):
    args = ["estimate", "--model", model, "--dtype", "bf16-mixed", "--micro-batch", "1", "--json"]
    out = CliRunner().invoke(app, args + (["--tp", "8", "--pp", "8", "--any-engine"] if model == "gpt-1t" else []))
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["params"] == published


def test_flops_and_activations_shrink_only_by_the_kv_projections():
    gqa = PRESETS["llama2-70b"]
    mha = gqa.with_overrides(kv_heads=None)
    h, kv, s, b, t, e = gqa.hidden, gqa.num_kv_heads * gqa.head_dim, 4096, 1, 8, 2
    assert (gqa.num_kv_heads, kv) == (8, 1024)
    # Every weight but the token table and the norms is a matmul weight (untied head): 6 FLOPs each per
    # token, plus attention (per query head, so the same for both).
    matmul = count_params(gqa) - gqa.vocab * h - (2 * gqa.layers + 1) * h
    assert flops_per_token(gqa, s) == 6 * matmul + 12 * gqa.layers * h * s
    assert count_params(mha) - count_params(gqa) == gqa.layers * 2 * h * (h - kv)
    # Saved activations: K and V at kv_heads · head_dim instead of h (Table 2's 4sbh/t for QKᵀ and 2sbh/t for V)
    for sp, recompute in ((False, "none"), (True, "selective")):
        diff = layer_activation_bytes(mha, b, s, t, sp, recompute) - layer_activation_bytes(gqa, b, s, t, sp, recompute)
        assert diff == pytest.approx(e * s * b * 2 * (h - kv) / t)


@pytest.mark.slow
def test_measured_activation_memory_follows_the_grouping(pools):
    # `small` (h 256, 8 heads) against itself with 2 K/V heads: the measured step peak falls by what the
    # cost model says K and V save, 2·(h − kv_heads·head_dim) fp32 values per token and layer (measured
    # 99 % of it here), and each stays in the band of tests/test_analysis_measured.py.
    from bench.analysis.estimate import estimate
    peaks, predicted = [], []
    for over in ((), ("kv_heads=2",)):
        cfg = RunConfig(model="small", model_overrides=over, steps=2, warmup=1, micro_batch=8)
        row = pools(1).run(cfg)
        assert row["status"] == "ok", row.get("error")
        est = estimate(cfg, mixed_state="autocast", activations="suite")["stages"][0]
        peaks.append(row["peak_mem_bytes"])
        predicted.append(est["activation_bytes"] + est["transient_bytes"])
        assert 0.6 <= peaks[-1] / predicted[-1] <= 1.5
    saved = predicted[0] - predicted[1]
    assert saved == 4 * 2 * (256 - 2 * 32) * 8 * 128 * 4  # e · 2 · (h − kv) · tokens · layers
    assert peaks[0] - peaks[1] == pytest.approx(saved, rel=0.2)


def test_sweep_skips_a_tp_that_does_not_divide_kv_heads(tmp_path):
    from bench.sweep.spec import expand, load_sweep
    path = tmp_path / "gqa.yaml"
    path.write_text("name: gqa\nmodel: {preset: tiny, kv_heads: 2}\nworld_size: 4\n"
                    "grid: {tp: [1, 2, 4], dp: auto}\nlauncher: local\n")
    out = expand(load_sweep(path))
    assert sorted(c.tp for c in out.runs) == [1, 2]
    assert [row["tp"] for row in out.skipped] == [4]
    assert "model kv_heads (2) is not divisible by tp (4)" in out.skipped[0]["error"]
