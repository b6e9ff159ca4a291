"""DDP and FSDP2 backends: parity with the single-process reference, communication and memory by formula.

Real FSDP2 / DTensor / torch.pipelining on gloo, tiny model, fp32 unless stated. Every multi-rank run
uses global batch 4, so one single-process reference (native, tp = pp = dp = 1, micro_batch 4) serves all.
Loss parity is within `bench.report.parity.loss_tolerance` (the report's rule too); gradient parity of
every layout here is in tests/test_grad_parity.py.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench.backends.fsdp import hybrid_shape
from bench.config import ConfigError, RunConfig
from bench.distributed import ProcessGroups
from bench.layout import DIMS, Layout
from bench.report.parity import loss_tolerance, training_signal
from bench.report.tables import loss_parity
from models import PRESETS, count_params
from models.config import block_params, embedding_params, head_params

TINY = PRESETS["tiny"]
P = count_params(TINY)                                  # 232,576
BLOCK, L = block_params(TINY), TINY.layers              # 49,408 × 4
ROOT = embedding_params(TINY) + head_params(TINY)       # 34,944: what fully_shard(root) owns
F32 = 4
RUN = dict(model="tiny", steps=3, warmup=0)             # loss_last = the loss of the 3rd step


@pytest.fixture(scope="module")
def reference(pools):
    row = pools(1).run(RunConfig(**RUN, micro_batch=4))
    assert row["status"] == "ok", row.get("error")
    return row


def run_ok(pools, **kw) -> dict:
    cfg = RunConfig(**RUN, **kw)
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row


def within_tolerance(row, reference) -> bool:
    """loss_last within the shared rule: 1e-5 in fp32; a tenth of the reference's training signal in bf16."""
    tol = loss_tolerance(row["dtype"], training_signal(json.loads(reference["losses"])))
    return math.isclose(row["loss_last"], reference["loss_last"], rel_tol=tol)


def assert_parity(row, reference):
    assert within_tolerance(row, reference), (row["loss_last"], reference["loss_last"], row["dtype"])


# --- pure ---------------------------------------------------------------------------------------------
def test_hybrid_shape_shards_within_a_node_and_keeps_two_replicas():
    assert hybrid_shape(2, 2) == (2, 1)
    assert hybrid_shape(4, 4) == (2, 2)
    assert hybrid_shape(16, 8) == (2, 8)
    assert hybrid_shape(16, 4) == (4, 4)
    assert hybrid_shape(6, 8) == (2, 3)
    with pytest.raises(ValueError, match="dp ≥ 2"):
        hybrid_shape(1, 8)


def test_the_counter_names_hsdp_shard_groups_under_cp_dp():
    """HSDP at dp 4 (2 replicas × 2 shards) × cp 2: FSDP's shard group, dp_shard × cp, is neither a dp nor
    a cp group but part of the gradient's dp × cp group, so its traffic is data-parallel."""
    layout = Layout(dp=4, cp=2)  # rank = cp + 2·dp
    groups = ProcessGroups(layout=layout, rank=0, tp=None, cp=None, pp=None, dp=None, dp_cp=None,
                           ranks={**{d: layout.group_of(0, d) for d in DIMS}, "dp_cp": layout.groups("dp", "cp")[0]})
    assert groups.dim_of([0, 1, 2, 3]) == "dp"  # shard ranks d ∈ {0, 1}, cp ranks c ∈ {0, 1}
    assert groups.dim_of([0, 4]) == "dp"  # the replicate group: a sub-group of dp
    assert groups.dim_of([0, 1]) == "cp"


@pytest.mark.parametrize("kw,match", [
    (dict(backend="fsdp", fsdp="ful", dp=2), r"fsdp is 'ful'; did you mean 'full'\?"),
    (dict(backend="fsdp", fsdp="hybrid", dp=1), r"backend fsdp: fsdp=hybrid needs dp ≥ 2"),
    (dict(backend="fsdp", dtype="fp16-mixed", dp=2), r"backend fsdp: dtype fp16-mixed is not supported on cpu"),
    (dict(backend="ddp", dtype="fp16-mixed", dp=2, device="cpu"), r"backend ddp: dtype fp16-mixed is not supported on cpu"),
    (dict(backend="ddp", tp=2), r"backend ddp is data parallel only"),
    (dict(backend="fsdp", pp=2, micro_batches=1, schedule="1f1b"), r"schedule 1f1b needs micro_batches ≥ pp"),
    (dict(backend="fsdp", pp=2, micro_batches=2, model_overrides=("tie_embeddings=true",)), r"tie_embeddings"),
    (dict(backend="ddp", fsdp="full"), r"fsdp='full' applies to backend fsdp only"),
    (dict(backend="fsdp", compile=True, warmup=0), r"compile needs warmup ≥ 1"),
])
def test_bad_options_are_rejected_in_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kw)


# --- world 2 ------------------------------------------------------------------------------------------
def test_ddp_all_reduces_the_full_gradient_once(pools, reference):
    row = run_ok(pools, backend="ddp", dp=2, micro_batch=2)
    assert_parity(row, reference)
    assert row["comm_dp_all_reduce_bytes"] == row["comm_bytes_dp"] == P * F32
    assert row["comm_wire_bytes_dp"] == P * F32  # ring 2(n−1)/n = 1 at n = 2
    assert row["persistent_bytes"] == 4 * P * F32  # params + grads + 2 Adam moments, unsharded


def test_fsdp_full_gathers_twice_per_block_and_reduce_scatters_once(pools, reference):
    row = run_ok(pools, backend="fsdp", fsdp="full", dp=2, micro_batch=2)
    assert_parity(row, reference)
    gathered = ROOT + 2 * L * BLOCK  # root kept after forward; every block re-gathered in backward
    assert row["comm_dp_all_gather_bytes"] == gathered * F32
    assert row["comm_dp_all_gather_ops"] == 1 + 2 * L
    assert row["comm_dp_reduce_scatter_bytes"] == P * F32 and row["comm_dp_reduce_scatter_ops"] == 1 + L
    assert row["comm_wire_bytes_dp"] == (gathered + P) * F32 / 2  # (n−1)/n of the full tensors
    ratio = row["comm_wire_bytes_dp"] / (P * F32)  # DDP's ring all-reduce moves P·4 bytes at n = 2
    assert 1.4 < ratio < 1.5, ratio  # ZeRO §7's 1.5×, less the root's skipped backward re-gather
    assert row["persistent_bytes"] == 4 * P * F32 // 2  # everything sharded over dp = 2, exactly
    assert row["params_bytes"] == row["grads_bytes"] == P * F32 // 2


def test_fsdp_grad_op_gathers_once(pools, reference):
    row = run_ok(pools, backend="fsdp", fsdp="grad-op", dp=2, micro_batch=2)
    assert_parity(row, reference)
    assert row["comm_dp_all_gather_bytes"] == P * F32 and row["comm_dp_reduce_scatter_bytes"] == P * F32
    assert row["persistent_bytes"] == 4 * P * F32 // 2


@pytest.mark.parametrize("strategy", ["none", "hybrid"])  # hybrid at dp = 2 is (2 replicas × shard 1)
def test_fsdp_unsharded_strategies_all_reduce_like_ddp(pools, reference, strategy):
    row = run_ok(pools, backend="fsdp", fsdp=strategy, dp=2, micro_batch=2)
    assert_parity(row, reference)
    assert row["comm_bytes_dp"] == row["comm_dp_all_reduce_bytes"] == P * F32
    assert row["comm_dp_all_reduce_ops"] == 1 + L  # one per fully_shard/replicate group
    assert row["persistent_bytes"] == 4 * P * F32
    assert (row["fsdp_replicate"], row["fsdp_shard"]) == (2, 1)


def test_fsdp_gradient_accumulation_reduces_once(pools, reference):
    row = run_ok(pools, backend="fsdp", fsdp="full", dp=2, micro_batch=1, micro_batches=2)
    assert_parity(row, reference)
    assert row["comm_dp_reduce_scatter_bytes"] == P * F32  # not once per micro-batch


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_recompute_full_keeps_parity_and_traffic(pools, reference, backend):
    row = run_ok(pools, backend=backend, dp=2, micro_batch=2, recompute="full")
    assert_parity(row, reference)
    assert row["comm_bytes_dp"] == (P if backend == "ddp" else ROOT + 2 * L * BLOCK + P) * F32


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_bf16_mixed_close_to_fp32_reference(pools, reference, backend):
    row = run_ok(pools, backend=backend, dp=2, micro_batch=2, dtype="bf16-mixed")
    assert_parity(row, reference)
    if backend == "fsdp":  # bf16 all-gathers (half the bytes), fp32 gradient reduce-scatter
        assert row["comm_dp_all_gather_bytes"] == (ROOT + 2 * L * BLOCK) * 2
        assert row["comm_dp_reduce_scatter_bytes"] == P * F32


def test_mixed_precision_tolerance_fails_runs_that_train_at_half_speed_or_not_at_all(pools, reference):
    """The bf16 tolerance is small against the training signal: with the learning rate halved or zero
    (test-only fault lr_scale:K) DDP and FSDP both fail it, here and in the report's parity table."""
    bf16 = dict(dp=2, micro_batch=2, dtype="bf16-mixed")
    good = run_ok(pools, backend="ddp", **bf16)
    bad = [run_ok(pools, backend=b, fault=f"lr_scale:{k}", **bf16) for b in ("ddp", "fsdp") for k in (0, 0.5)]
    assert within_tolerance(good, reference)
    assert not any(within_tolerance(row, reference) for row in bad), [r["loss_last"] for r in bad]
    single_bf16 = run_ok(pools, micro_batch=4, dtype="bf16-mixed")  # the report's reference: world 1, same dtype
    table, _ = loss_parity(pd.DataFrame([single_bf16, good, *bad]))
    assert [v[0] for v in table["parity"]] == ["✓", "✗", "✗", "✗", "✗"], table.to_string()


# --- world 4 ------------------------------------------------------------------------------------------
def test_fsdp_hybrid_2x2_shards_within_and_all_reduces_across(pools, reference):
    row = run_ok(pools, backend="fsdp", fsdp="hybrid", dp=4, micro_batch=1)
    assert_parity(row, reference)
    assert (row["fsdp_replicate"], row["fsdp_shard"]) == (2, 2)
    assert row["comm_dp_all_gather_bytes"] == (ROOT + 2 * L * BLOCK) * F32  # on the shard pairs
    assert row["comm_dp_reduce_scatter_bytes"] == P * F32
    assert row["comm_dp_all_reduce_bytes"] == P * F32 // 2  # the gradient shard, across replicas
    assert row["persistent_bytes"] == 4 * P * F32 // 2


def test_fsdp_with_tensor_parallel_2x2(pools, reference):
    row = run_ok(pools, backend="fsdp", fsdp="full", tp=2, dp=2, micro_batch=2)
    assert_parity(row, reference)
    act = 2 * TINY.seq_len * TINY.hidden * F32  # (micro_batch, seq, hidden) fp32
    assert row["comm_tp_all_reduce_ops"] == 4 * L  # 2 forward (proj, fc2) + 2 backward (qkv, fc1) per block
    assert row["comm_tp_all_reduce_bytes"] == 4 * L * act
    tp_block = (BLOCK - 4 * TINY.hidden) // 2 + 4 * TINY.hidden  # linears split over tp, norms replicated
    assert row["comm_dp_all_gather_bytes"] == (ROOT + 2 * L * tp_block) * F32
    assert row["comm_dp_reduce_scatter_bytes"] == (ROOT + L * tp_block) * F32


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_fsdp_with_pipeline_2_stages(pools, reference, schedule, virtual):
    row = run_ok(pools, backend="fsdp", fsdp="full", pp=2, dp=2, micro_batch=1, micro_batches=2,
                 schedule=schedule, virtual_stages=virtual)
    assert_parity(row, reference)
    act = 1 * TINY.seq_len * TINY.hidden * F32  # one micro-batch's activation (or its gradient)
    boundaries = 2 * virtual - 1
    sent = 2 * boundaries * 2 * act * 2  # fwd + bwd × boundaries × micro-batches × 2 pipelines (dp)
    assert row["comm_bytes_pp"] == row["comm_pp_send_bytes"] == sent / 4  # averaged over 4 ranks
    assert row["comm_dp_reduce_scatter_bytes"] == P * F32 / 2  # each rank: its stage's gradients
    assert row["pp_impl"].endswith(schedule)


# --- the CLI ------------------------------------------------------------------------------------------
def test_bench_run_fsdp_full_matches_native(pools):
    bench = str(Path(sys.executable).with_name("bench"))  # the installed console script
    out = subprocess.run([bench, "run", "--model", "tiny", "--backend", "fsdp",
                          "--fsdp", "full", "--dp", "2", "--steps", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    ref = pools(2).run(RunConfig(model="tiny", backend="native", dp=2, steps=3))
    assert row["status"] == ref["status"] == "ok", row.get("error")
    assert math.isclose(row["loss_last"], ref["loss_last"], rel_tol=1e-5)
    assert row["comm_bytes_dp"] > 0 and row["comm_bytes_tp"] == row["comm_bytes_pp"] == 0
    assert row["persistent_bytes"] == 4 * P * F32 // 2


# --- world 8: full 3-D (slow tier) --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy,schedule,virtual", [("full", "1f1b", 1), ("hybrid", "interleaved", 2)])
def test_fsdp_3d_tp_pp_dp(pools, reference, strategy, schedule, virtual):
    row = run_ok(pools, backend="fsdp", fsdp=strategy, tp=2, pp=2, dp=2, micro_batch=1, micro_batches=2,
                 schedule=schedule, virtual_stages=virtual, timeout_s=900)
    assert_parity(row, reference)
    assert row["comm_bytes_tp"] > 0 and row["comm_bytes_pp"] > 0 and row["comm_bytes_dp"] > 0
    assert row.get("comm_bytes_other", 0) == 0  # every mesh group is classified as tp, pp or dp
