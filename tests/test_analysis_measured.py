"""Predictions against real runs: every row carries the cost model's `pred_*` columns (bench.worker),
and the predicted communication must equal what the dispatcher-level counter measured, byte for
byte and op for op, per dimension and per kind of collective, and the predicted model state what
`Trainer.state_tensors` holds (one rule for every backend, DeepSpeed's own buffers included).

Memory: the measured step peak (live tensor bytes a step adds, bench.metrics.memory) is compared
with the predicted step peak on the `small` model.
"""
import json

import pytest

from bench.analysis.estimate import default_mixed_state, estimate
from bench.config import RunConfig
from bench.layout import DIMS, Layout

BASE = dict(model="tiny", steps=1, warmup=1, micro_batch=2)

# The fast tier (default test command): every backend, the quickstart's DeepSpeed layouts, ZeRO-3 with
# partitioned parameters. All at world 4, so one warm pool runs them; failures are collected per config.
PARTITIONED = ["zero_optimization.stage3_param_persistence_threshold=0"]  # every ZeRO-3 parameter partitioned
FAST = [
    dict(backend="native", tp=2, pp=2, dp=1, micro_batches=4),
    dict(backend="native", tp=2, pp=1, dp=2, micro_batches=2, zero=1, sequence_parallel=True),
    dict(backend="native", tp=2, pp=2, dp=1, micro_batches=2, sequence_parallel=True, recompute="full",
         dtype="bf16-mixed"),
    dict(backend="native", tp=1, pp=1, dp=4, micro_batches=1, zero=1),
    dict(backend="ddp", dp=4, micro_batches=2),
    dict(backend="fsdp", dp=4, micro_batches=2, fsdp="full"),
    dict(backend="fsdp", dp=2, tp=2, micro_batches=1, fsdp="full"),
    dict(backend="fsdp", dp=2, pp=2, micro_batches=4, fsdp="grad-op"),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=0),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=2),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=3, ds_set=PARTITIONED),
    # the quickstart's DeepSpeed layouts (pipeline with tp-partitioned sends; ZeRO-3 over tp)
    dict(backend="deepspeed", tp=2, pp=2, dp=1, micro_batches=4, zero=1),
    dict(backend="deepspeed", tp=2, pp=1, dp=2, micro_batches=2, zero=3),
    dict(backend="deepspeed", tp=1, pp=2, dp=2, micro_batches=2, zero=1),
    dict(backend="deepspeed", tp=2, pp=1, dp=2, micro_batches=2, zero=3, ds_set=PARTITIONED),
    dict(backend="deepspeed", tp=2, pp=1, dp=2, micro_batches=2, zero=3, ds_set=PARTITIONED,
         bucket_mb=0.05),  # the prefetcher over several buckets
    # mixed precision: bf16 weights, fp32 masters, the overflow flag beside the gradient norm
    dict(backend="deepspeed", tp=2, pp=1, dp=2, micro_batches=2, zero=1, dtype="bf16-mixed"),
    dict(backend="deepspeed", tp=2, pp=1, dp=2, micro_batches=2, zero=0, dtype="bf16-mixed"),
]
# context parallel: the ring's K/V sends, tp/pp on seq/cp tokens, the gradient over dp × cp
CONTEXT = [
    dict(backend="native", cp=2, dp=2, micro_batches=2, zero=1),
    dict(backend="native", cp=2, tp=2, micro_batches=1, sequence_parallel=True, recompute="selective",
         dtype="bf16-mixed"),
    dict(backend="native", cp=2, pp=2, micro_batches=2, recompute="full"),
    dict(backend="native", cp=4, micro_batches=1, model_overrides=("kv_heads=2",)),
    dict(backend="fsdp", cp=2, dp=2, micro_batches=2, fsdp="full"),
    dict(backend="fsdp", cp=2, tp=2, micro_batches=1, fsdp="full", dtype="bf16-mixed"),
    dict(backend="fsdp", cp=2, micro_batches=2, fsdp="grad-op"),
    dict(backend="deepspeed", cp=2, micro_batches=2, zero=1),
    dict(backend="deepspeed", cp=2, dp=2, micro_batches=1, zero=3, ds_set=PARTITIONED),
    dict(backend="deepspeed", cp=2, tp=2, micro_batches=1, zero=0, dtype="bf16-mixed"),
    dict(backend="deepspeed", cp=2, micro_batches=1, zero=2, recompute="selective"),
]
SLOW = [
    dict(backend="native", tp=1, pp=2, dp=2, micro_batches=4, schedule="gpipe", dtype="bf16-mixed"),
    dict(backend="native", tp=1, pp=2, dp=2, micro_batches=4, schedule="interleaved", virtual_stages=2, zero=1),
    dict(backend="native", tp=4, pp=1, dp=1, micro_batches=2, sequence_parallel=True),
    dict(backend="native", tp=2, pp=2, dp=1, micro_batches=4, recompute="full", dtype="bf16-mixed", zero=1),
    dict(backend="fsdp", dp=4, micro_batches=1, fsdp="grad-op", dtype="bf16-mixed"),
    dict(backend="fsdp", dp=4, micro_batches=2, fsdp="hybrid"),
    dict(backend="fsdp", dp=2, pp=2, micro_batches=4, fsdp="full"),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=1),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=3),
    dict(backend="deepspeed", dp=2, pp=2, micro_batches=4, zero=1),
    dict(backend="deepspeed", dp=2, tp=2, micro_batches=1, zero=1),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=3, bucket_mb=0.05),  # several reduce buckets
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=2, bucket_mb=0.0625),
    # ZeRO-3's prefetcher over several buckets, with and without tp, some parameters persistent
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=3, bucket_mb=0.05, ds_set=PARTITIONED),
    dict(backend="deepspeed", dp=4, micro_batches=2, zero=3, bucket_mb=0.05,
         ds_set=["zero_optimization.stage3_param_persistence_threshold=5000"]),
    dict(backend="deepspeed", pp=2, dp=2, micro_batches=2, zero=0, dtype="bf16-mixed"),  # its BF16_Optimizer
    dict(backend="deepspeed", pp=2, dp=2, micro_batches=2, zero=0),
]


# ZeRO-3's knobs (issue 23): parameters freed inside a micro-batch are gathered again in backward, every
# micro-batch (bench.analysis.zero3 replays DeepSpeed's coordinator). tiny's parameters: 64-element norms,
# a 2,048-element position table, 4,096-16,384-element matrices; 0 frees everything after its use (the
# ZeRO paper's ZeRO-3: forward and backward gather every parameter); DeepSpeed's defaults keep all of
# tiny whole (each ≤ 100,000 elements: nothing gathered in the step, every one after it); "partial" keeps
# the norms whole, and its budget (40,000 live, reuse within 20,000, 20,000 per prefetch) frees some
# parameters and keeps others; "loose" keeps the position table whole too, and frees less.
ZERO3_KNOBS = {
    "zero": dict(zero3_param_persistence_threshold=0, zero3_max_live_parameters=0, zero3_max_reuse_distance=0),
    "defaults": {},
    "partial": dict(zero3_param_persistence_threshold=100, zero3_max_live_parameters=40_000,
                    zero3_max_reuse_distance=20_000, zero3_prefetch_bucket_size=20_000),
    "loose": dict(zero3_param_persistence_threshold=3_000, zero3_max_live_parameters=100_000,
                  zero3_max_reuse_distance=60_000, zero3_prefetch_bucket_size=30_000),
}
KNOBS = [dict(backend="deepspeed", dp=2, zero=3, micro_batches=mb, **knobs)
         for knobs in ZERO3_KNOBS.values() for mb in (1, 4)] + \
        [dict(backend="fsdp", dp=2, micro_batches=4, fsdp=mode) for mode in ("full", "grad-op")]  # reshard_after_forward True, False


def _mismatches(row: dict, cfg: RunConfig) -> list[str]:
    """Every predicted column that differs from its measurement: comm bytes, wire bytes and ops per
    dimension and per kind of collective, and the model-state bytes (one accounting rule)."""
    if row["status"] != "ok":
        return [f"status {row['status']}: {row['error']}"]
    out = []
    for dim in DIMS:
        for what in ("bytes", "wire_bytes", "ops"):
            pred, meas = row[f"pred_comm_{what}_{dim}"], row[f"comm_{what}_{dim}"]
            if pred != pytest.approx(meas, abs=1e-6):
                out.append(f"comm_{what}_{dim}: predicted {pred} measured {meas}")
    est = estimate(cfg, mixed_state=default_mixed_state(cfg), activations="suite")
    kinds = {k for k in (*row, *est) if k.startswith(tuple(f"comm_{dim}_" for dim in DIMS))}
    for key in sorted(kinds):
        if est.get(key, 0) != pytest.approx(row.get(key, 0), abs=1e-6):
            out.append(f"{key}: predicted {est.get(key, 0)} measured {row.get(key, 0)}")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        if row[f"pred_{key}"] != row[key]:
            out.append(f"{key}: predicted {row[f'pred_{key}']} measured {row[key]}")
    return out


def _check_all(pools, options_list) -> None:
    failures = {}
    for options in options_list:
        cfg = RunConfig(**BASE, **options)
        wrong = _mismatches(pools(cfg.world).run(cfg), cfg)
        if wrong:
            failures[str(options)] = wrong
    assert not failures, "\n".join(f"{o}:\n  " + "\n  ".join(w) for o, w in failures.items())


def test_predicted_comm_and_state_equal_measured(pools):
    _check_all(pools, FAST)


def test_predicted_context_parallel_comm_and_state_equal_measured(pools):
    _check_all(pools, CONTEXT)


@pytest.mark.slow
@pytest.mark.parametrize("options", SLOW, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_predicted_comm_equals_measured_all_backends(pools, options):
    _check_all(pools, [options])


def test_predicted_zero3_knobs_and_fsdp_reshard_equal_measured(pools):
    """ZeRO-3 at stage3_param_persistence_threshold / max_live_parameters / max_reuse_distance /
    prefetch_bucket_size 0, DeepSpeed's defaults and two settings between, gradient accumulation 1 and 4;
    FSDP2 with reshard_after_forward true (full: a second all-gather per block in backward) and false
    (grad-op: none), accumulating 4. Bytes, wire bytes and ops per dimension and collective kind, and
    model state: exact. The issue's case (everything 0, accumulation 1) measured 1,395,464 dp wire bytes,
    which the model had at 930,312 before the backward re-gather."""
    _check_all(pools, KNOBS)
    zero = RunConfig(**BASE, **KNOBS[0])
    assert estimate(zero, mixed_state=default_mixed_state(zero), activations="suite")["comm_wire_bytes_dp"] == 1_395_464


def _count_functional_collectives_on_rank(n: int) -> dict:
    """DTensor's path: torch's functional collectives (`_c10d_functional` ops), under the worker's counter."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from bench.distributed import rank_session
    from bench.metrics.comm import CommCounter
    with rank_session("cpu"):
        world, rank = dist.get_world_size(), dist.get_rank()
        x = torch.full((n,), float(rank + 1))
        with CommCounter(dim_of=lambda ranks: "dp") as counter:
            gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
            scattered = funcol.reduce_scatter_tensor(torch.ones(n * world), "sum", 0, dist.group.WORLD)
            reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)
            values = [funcol.wait_tensor(t).tolist() for t in (gathered, scattered, reduced)]
        return {"values": values, "counted": {kind: (s.ops, s.bytes, s.wire_bytes)
                                               for (dim, kind), s in counter.stats.items() if dim == "dp"},
                "dims": sorted({dim for dim, _ in counter.stats})}


def test_counter_counts_functional_collectives_by_the_payload_convention(pools):
    """The counter's `_c10d_functional` branch (DTensor, FSDP2 with tp): an all-gather is counted at its
    output (world × the input), reduce-scatter and all-reduce at their input, as on the c10d path."""
    from bench.analysis.comm import wire_bytes
    n, world = 6, 2
    got = pools(world).call(_count_functional_collectives_on_rank, n)
    for rank in got:
        assert rank["values"] == [[1.0] * n + [2.0] * n, [2.0] * n, [3.0] * n]  # the ops really ran
        assert rank["dims"] == ["dp"], rank
        gather_bytes, input_bytes = 4 * n * world, 4 * n
        assert rank["counted"] == {
            "all_gather": (1, gather_bytes, wire_bytes("all_gather", gather_bytes, world)),
            "reduce_scatter": (1, 4 * n * world, wire_bytes("reduce_scatter", 4 * n * world, world)),
            "all_reduce": (1, input_bytes, wire_bytes("all_reduce", input_bytes, world)),
        }, rank["counted"]


def test_native_zero1_really_saves_memory(pools):
    """ZeRO-1 at dp 4, fp32, Ψ = parameter bytes: params Ψ + grads Ψ + Adam 2Ψ/4 (the optimizer steps
    on its shard of the flat parameter buffer in place: no copy of the shard, no separate gradient),
    against 4Ψ without ZeRO."""
    rows = {z: pools(4).run(RunConfig(**BASE, backend="native", dp=4, micro_batches=1, zero=z)) for z in (0, 1)}
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
    psi = rows[0]["params_bytes"]
    assert rows[0]["persistent_bytes"] == 4 * psi
    assert rows[1]["persistent_bytes"] == psi + psi + 2 * psi / 4


MEMORY_BAND = (0.6, 1.5)  # measured step peak / predicted (activations + transient), see module docstring


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(tp=2, pp=2, dp=1, micro_batches=2), dict(tp=1, pp=1, dp=4, micro_batches=1),
                                     dict(tp=2, pp=1, dp=2, micro_batches=1, sequence_parallel=True),
                                     dict(tp=1, pp=2, dp=2, micro_batches=4, schedule="gpipe"),
                                     dict(tp=4, pp=1, dp=1, micro_batches=1, dtype="bf16-mixed"),
                                     dict(tp=2, pp=2, dp=1, micro_batches=4, dtype="bf16-mixed")])
def test_predicted_memory_band_small(pools, options):
    cfg = RunConfig(model="small", steps=2, warmup=1, micro_batch=2, backend="native", **options)
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row["error"]
    est = estimate(cfg, mixed_state="autocast", activations="suite")
    predicted = max(s["activation_bytes"] + s["transient_bytes"] for s in est["stages"])
    ratio = row["peak_mem_bytes"] / predicted
    assert MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1], ratio


# The predicted step peak (pred_peak_mem_bytes) within ±15 % of the measured one on `small` at world ≤ 2
# (issue 11), one config per term that decides a peak: the loss's backward (native dp; tp's vocab-parallel
# loss), the micro-batches in flight (1F1B), gradients freed at the step start (ddp), the gathered root and
# blocks (FSDP2 full; grad-op keeps every block gathered), DeepSpeed's bucketed reduction after backward
# (ZeRO-0), ZeRO-3's resident gathered parameters and flat all-gather buffer. Each is repeatable to ~1 %
# here; ZeRO-1/2 are left out: one rank sometimes peaks 5-20 % higher in the reduction (gloo).
PEAK_TOLERANCE = 0.15
PEAK_CASES = [dict(backend="native", dp=2), dict(backend="native", tp=2),
              dict(backend="native", pp=2, schedule="1f1b", micro_batches=4), dict(backend="ddp", dp=2),
              dict(backend="fsdp", fsdp="full", dp=2), dict(backend="fsdp", fsdp="grad-op", dp=2),
              dict(backend="deepspeed", zero=0, dp=2), dict(backend="deepspeed", zero=3, dp=2)]


@pytest.mark.parametrize("options", PEAK_CASES, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_predicted_step_peak_memory_within_15_percent(pools, options):
    cfg = RunConfig(model="small", steps=2, warmup=1, **options)  # the peak of the second timed step: DDP
    row = pools(cfg.world).run(cfg)                               # rebuilds its buckets in the first
    assert row["status"] == "ok", row["error"]
    assert row["pred_peak_mem_error"] == pytest.approx(row["pred_peak_mem_bytes"] / row["peak_mem_bytes"] - 1)
    # every rank against its own stage's prediction (a pipeline's stages peak differently)
    stages = estimate(cfg, mixed_state=default_mixed_state(cfg), activations="suite")["stages"]
    layout = Layout(cfg.tp, cfg.pp, cfg.dp, cfg.order)
    for rank, measured in enumerate(json.loads(row["peak_mem_bytes_per_rank"])):
        predicted = stages[layout.coords(rank).pp]["peak_mem_bytes"]
        assert abs(predicted / measured - 1) <= PEAK_TOLERANCE, (rank, predicted, measured)


@pytest.mark.slow
def test_context_parallel_divides_the_step_peak(pools):
    """Issue 24's figure: on `small` at seq 1,024 the step peak of cp 2 and cp 4 is within ±10 % of 1/2
    and 1/4 of cp 1's, measured and predicted alike (every per-token activation is held on seq/cp tokens)."""
    rows = {}
    for cp in (1, 2, 4):
        cfg = RunConfig(model="small", model_overrides=("seq_len=1024",), seq=1024, cp=cp, micro_batch=1,
                        steps=1, warmup=1)
        rows[cp] = pools(cfg.world).run(cfg)
        assert rows[cp]["status"] == "ok", rows[cp]["error"]
    for cp in (2, 4):
        for key in ("peak_mem_bytes", "pred_peak_mem_bytes"):
            assert rows[cp][key] / rows[1][key] == pytest.approx(1 / cp, rel=0.10), (cp, key)
