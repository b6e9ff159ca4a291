"""The headline columns against values computed independently of the code that fills them.

- MFU and tokens/s: recomputed by hand for tiny (its dimensions written out, the FLOP convention of
  models/config.py: 6 × matmul weights per token + 12·L·h·s for attention) from the row's own step
  time, global batch and MFU peak.
- The measured pipeline bubble against `bench.schedule.simulate`, on pipelines whose stage compute is
  dominated by a fixed delay per compute section (test-only fault `stage_sleep:MS`, native executor),
  so forward and backward cost the same and the simulator runs at F = B = 1: within ±0.05.
- Peak memory on `small`, whose activations (≥ 64 KiB tensors, mapped and unmapped by glibc) are signal
  rather than heap noise: measured step peak / predicted activations + transients within the band of
  tests/test_analysis_measured.py, at two micro-batch sizes (the peak must grow with it).
- A real allocation failure (fault `oom_real`: a rank under an address-space limit allocates 1 GiB)
  is classified `oom`, as the injected MemoryError is.
"""
import pytest

from bench.analysis.estimate import estimate
from bench.config import RunConfig
from bench.schedule import schedule, simulate
from test_analysis_measured import MEMORY_BAND


def run_ok(pools, cfg: RunConfig) -> dict:
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row


def test_mfu_and_tokens_per_s_by_hand(pools):
    row = run_ok(pools, RunConfig(model="tiny", micro_batch=2, micro_batches=2, steps=2, warmup=1))
    layers, h, ffn, vocab, seq = 4, 64, 256, 256, 32  # tiny: models/config.py PRESETS
    matmul = layers * (h * 3 * h + h * h + h * ffn + ffn * h) + vocab * h  # qkv, proj, fc1, fc2; LM head
    flops_per_token = 6 * matmul + 12 * layers * h * seq  # forward + backward; attention scores and values
    tokens = 2 * 2 * seq  # micro_batch × micro_batches × seq, dp = 1
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"], rel=1e-12)
    assert row["mfu"] == pytest.approx(flops_per_token * tokens / row["step_time_s"] / row["peak_flops"], rel=1e-9)
    assert 0 < row["mfu"] < 1


BUBBLE_CASES = [dict(schedule="gpipe", micro_batches=4), dict(schedule="1f1b", micro_batches=2),
                dict(schedule="interleaved", micro_batches=2, virtual_stages=2)]


@pytest.mark.parametrize("case", BUBBLE_CASES, ids=lambda c: f"{c['schedule']}-m{c['micro_batches']}")
def test_measured_bubble_matches_the_simulated_schedule(pools, case):
    cfg = RunConfig(model="tiny", pp=2, micro_batch=1, steps=1, warmup=1, fault="stage_sleep:150", **case)
    row = run_ok(pools, cfg)
    v = cfg.virtual_stages
    orders = [schedule(cfg.schedule, cfg.micro_batches, cfg.pp, r, v) for r in range(cfg.pp)]
    simulated = simulate(orders, v, forward=1, backward=1).step.bubble_fraction
    assert 0.1 < simulated  # a pipeline with a bubble worth measuring
    assert abs(row["bubble_fraction"] - simulated) <= 0.05, (row["bubble_fraction"], simulated)


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_peak_memory_of_small_is_the_predicted_activations(pools, micro_batch):
    cfg = RunConfig(model="small", backend="native", micro_batch=micro_batch, steps=2, warmup=1)
    row = run_ok(pools, cfg)
    est = estimate(cfg, mixed_state="autocast", activations="suite")
    predicted = max(s["activation_bytes"] + s["transient_bytes"] for s in est["stages"])
    assert MEMORY_BAND[0] <= row["peak_mem_bytes"] / predicted <= MEMORY_BAND[1], (row["peak_mem_bytes"], predicted)


def test_a_real_allocation_failure_is_classified_oom(pools):
    row = pools(2).run(RunConfig(model="tiny", dp=2, steps=1, warmup=0, fault="oom_real", timeout_s=120))
    assert row["status"] == "oom", (row["status"], row.get("error"))
    assert row["failed_rank"] == 1 and "Cannot allocate memory" in row["error"]  # the allocator's own ENOMEM
