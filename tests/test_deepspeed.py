"""DeepSpeed backend: parity with the single-process reference, ZeRO traffic and state by formula.

Real DeepSpeed 0.19.8 on gloo, tiny model, fp32 unless stated, warmup 0 and 3 steps (loss_last = the
loss after 3 steps; loss parity within `bench.report.parity.loss_tolerance`, the report's rule too; gradient
parity of every ZeRO stage, tp and the pipeline is in tests/test_grad_parity.py). World-2 runs share one warm pool (`pools`), so they also prove that DeepSpeed's
module-level state is reset between runs in one rank process (ZeRO stages, pipeline and tp in turn).
"""
import json
import math

import pytest

from bench.backends import deepspeed_config as dsc
from bench.config import ConfigError, RunConfig
from bench.layout import Layout
from bench.report.parity import loss_tolerance, training_signal
from models import PRESETS, count_params

TINY = PRESETS["tiny"]
P = count_params(TINY)                 # 232,576
PB = 4 * P                             # fp32 parameter bytes: one full gradient
RUN = dict(model="tiny", steps=3, warmup=0)
# ZeRO-3 as the paper counts it: nothing kept whole, nothing kept live between forward and backward.
ZERO3_STRICT = ("zero_optimization.stage3_param_persistence_threshold=0",
                "zero_optimization.stage3_max_live_parameters=0",
                "zero_optimization.stage3_max_reuse_distance=0")
LOGGER = ("comms_logger.enabled=true", "comms_logger.prof_all=true")

WORLD2 = {  # name → RunConfig fields; global batch 4 unless stated
    "zero0": dict(zero=0, dp=2), "zero1": dict(zero=1, dp=2), "zero2": dict(zero=2, dp=2),
    "zero3": dict(zero=3, dp=2), "zero3_strict": dict(zero=3, dp=2, ds_set=ZERO3_STRICT + LOGGER),
    "pipe2": dict(pp=2, micro_batches=2), "tp2": dict(tp=2, micro_batch=4),
    "zero2_bf16": dict(zero=2, dp=2, dtype="bf16-mixed"),
    "zero2_bf16_lr0": dict(zero=2, dp=2, dtype="bf16-mixed", fault="lr_scale:0"),
    "zero2_bf16_lr_half": dict(zero=2, dp=2, dtype="bf16-mixed", fault="lr_scale:0.5"),
    "zero3_recompute": dict(zero=3, dp=2, recompute="full"), "pipe2_recompute": dict(pp=2, micro_batches=2, recompute="full"),
}


def run_ok(pools, **kw) -> dict:
    cfg = RunConfig(backend=kw.pop("backend", "deepspeed"), **RUN, **kw)
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row


@pytest.fixture(scope="module")
def reference(pools):
    """The single-process native fp32 reference row for a global batch size."""
    cache = {}

    def get(global_batch: int) -> dict:
        if global_batch not in cache:
            cache[global_batch] = run_ok(pools, backend="native", micro_batch=global_batch)
        return cache[global_batch]
    return get


@pytest.fixture(scope="module")
def rows(pools):
    return {name: run_ok(pools, **kw) for name, kw in WORLD2.items()}


def within_tolerance(row, reference) -> bool:
    ref = reference(row["global_batch"])
    tol = loss_tolerance(row["dtype"], training_signal(json.loads(ref["losses"])))
    return math.isclose(row["loss_last"], ref["loss_last"], rel_tol=tol)


def assert_parity(row, reference):
    assert within_tolerance(row, reference), (row["loss_last"], reference(row["global_batch"])["loss_last"])


# --- pure: the generated config, overrides, validation, topology --------------------------------------
def test_config_is_generated_from_the_run_config():
    cfg = RunConfig(backend="deepspeed", zero=2, dp=2, micro_batch=3, micro_batches=4, bucket_mb=1.0,
                    dtype="bf16-mixed")
    c = dsc.final_config(cfg)
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (3, 4, 24)
    z = c["zero_optimization"]
    assert z["stage"] == 2 and z["reduce_bucket_size"] == z["allgather_bucket_size"] == 2**20 // 2  # bf16 elements
    assert c["bf16"]["enabled"] and not c["fp16"]["enabled"] and c["gradient_clipping"] == 0.0


def test_deepspeeds_device_syncing_throughput_timer_is_off():
    """Read by DeepSpeed's own parser: its throughput timer synchronises the device at every forward."""
    from deepspeed.utils.config import get_timers_config
    assert get_timers_config(dsc.final_config(RunConfig(backend="deepspeed", dp=2))).enabled is False


def test_ds_set_overrides_dotted_keys_with_yaml_scalars():
    cfg = RunConfig(backend="deepspeed", zero=3, dp=2, ds_set=ZERO3_STRICT + (
        "zero_optimization.overlap_comm=false", "zero_optimization.reduce_bucket_size=5e8",
        "comms_logger.enabled=true", "activation_checkpointing.partition_activations=yes", "new_key=auto"))
    c = dsc.final_config(cfg)
    z = c["zero_optimization"]
    assert z["stage3_param_persistence_threshold"] == 0 and z["stage3_max_live_parameters"] == 0
    assert z["overlap_comm"] is False and z["reduce_bucket_size"] == 500_000_000
    assert c["comms_logger"] == {"enabled": True} and c["activation_checkpointing"]["partition_activations"] is True
    assert c["new_key"] == "auto"  # unknown top-level keys pass through: DeepSpeed may accept them


def test_zero3_fields_reach_deepspeeds_json_and_ds_set_still_wins():
    """The RunConfig's ZeRO-3 fields are the generated config's stage3_* keys (at zero 3 only), read back
    by DeepSpeed's own config class; unset, they are DeepSpeed's defaults (the prefetch bucket bucket_mb's)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    knobs = dict(zero3_param_persistence_threshold=10, zero3_max_live_parameters=20, zero3_max_reuse_distance=30,
                 zero3_prefetch_bucket_size=40)
    parsed = DeepSpeedZeroConfig(**dsc.final_config(RunConfig(backend="deepspeed", zero=3, dp=2, **knobs))["zero_optimization"])
    assert (parsed.param_persistence_threshold, parsed.max_live_parameters, parsed.max_reuse_distance,
            parsed.prefetch_bucket_size) == (10, 20, 30, 40)
    default = DeepSpeedZeroConfig(**dsc.final_config(RunConfig(backend="deepspeed", zero=3, dp=2))["zero_optimization"])
    assert (default.param_persistence_threshold, default.max_live_parameters, default.max_reuse_distance) == \
        (DeepSpeedZeroConfig().param_persistence_threshold, DeepSpeedZeroConfig().max_live_parameters,
         DeepSpeedZeroConfig().max_reuse_distance)
    assert default.prefetch_bucket_size == dsc.final_config(RunConfig(backend="deepspeed", zero=3, dp=2))[
        "zero_optimization"]["reduce_bucket_size"]
    overridden = dsc.final_config(RunConfig(backend="deepspeed", zero=3, dp=2, zero3_max_live_parameters=5,
                                            ds_set=("zero_optimization.stage3_max_live_parameters=7",)))
    assert overridden["zero_optimization"]["stage3_max_live_parameters"] == 7
    assert "stage3_max_live_parameters" not in dsc.final_config(RunConfig(backend="deepspeed", zero=2, dp=2))[
        "zero_optimization"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(zero=2, dp=2, zero3_max_live_parameters=0), r"zero3_max_live_parameters applies to backend deepspeed at zero=3 only"),
    (dict(backend="fsdp", dp=2, zero3_max_reuse_distance=0), "zero3_max_reuse_distance applies to backend deepspeed"),
    (dict(zero=3, zero3_param_persistence_threshold=-1), "zero3_param_persistence_threshold must be a non-negative"),
    (dict(pp=2, zero=2), "zero=2 is incompatible with pipeline parallel"),
    (dict(pp=2, zero=3), "zero=3 is incompatible with pipeline parallel"),
    (dict(dtype="fp16-mixed", device="cpu"), "fp16"),
    (dict(dtype="fp16-mixed"), "fp16-mixed is not supported on cpu"),  # device auto: needs an explicit cuda
    (dict(ds_set=("fp16.enabled=true",)), "fp16 is not supported on cpu"),
    (dict(ds_set=("zero_optimization.stage",)), "must look like KEY=VALUE"),
    (dict(ds_set=("zero_optimization..stage=1",)), "empty part"),
    (dict(ds_set=("zero_optimization=[1, 2]",)), "must be a scalar"),
    (dict(ds_set=("zero_optimization.stage=3",)), r"contradicts zero=0; use --zero"),
    (dict(ds_set=("train_batch_size=64",)), "contradicts the run's batch"),
    (dict(ds_set=("bf16=true", "bf16.enabled=true")), "'bf16' is True in the generated config, not a section"),
    (dict(pp=2, schedule="gpipe"), "runs 1f1b only"),
    (dict(compile=True), "compile is not supported"),
    (dict(model_overrides=("tie_embeddings=true",), tp=2), "tie_embeddings"),
    (dict(model="tiny", cp=2, pp=2, micro_batches=2), r"cp \(2\) with pp \(2\) is not supported .* use pp = 1"),
    (dict(model="tiny-llama", cp=4), r"kv_heads \(2\) divisible by tp × cp = 4"),
    (dict(model="tiny", cp=2, zero=3, ds_set=("zero_optimization.reduce_scatter=false",)),
     "reduce_scatter=false is not supported with cp > 1"),
])
def test_bad_options_rejected_before_processes_start(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**{"backend": "deepspeed", **kwargs})


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
def test_deepspeed_topology_has_our_rank_order(order):
    from bench.backends.deepspeed import topology
    layout = Layout(tp=2, pp=2, dp=2, order=order)
    topo = topology(layout)
    for rank in range(layout.world_size):
        c, t = layout.coords(rank), topo.get_coord(rank)
        assert (t.data, t.pipe, t.model) == (c.dp, c.pp, c.tp)


# --- world 2 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_strict", "pipe2", "tp2",
                                  "zero3_recompute", "pipe2_recompute"])
def test_parity_with_the_single_process_reference(rows, reference, name):
    assert_parity(rows[name], reference)


def test_bf16_within_its_bound_and_the_bound_bites(rows, reference):
    """bf16 (fp32 master) passes the shared mixed-precision rule; the same run with the learning rate
    zero or halved (test-only fault lr_scale:K) fails it."""
    assert_parity(rows["zero2_bf16"], reference)
    assert not within_tolerance(rows["zero2_bf16_lr0"], reference)
    assert not within_tolerance(rows["zero2_bf16_lr_half"], reference)


def test_row_records_the_final_config_and_tp_implementation(rows):
    strict = json.loads(rows["zero3_strict"]["ds_config"])
    assert strict["zero_optimization"]["stage3_max_live_parameters"] == 0 and strict["zero_optimization"]["stage"] == 3
    assert rows["tp2"]["tp_impl"] == "native" and rows["zero0"]["tp_impl"] == "none"
    assert rows["zero3"]["ds_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_zero0_all_reduces_the_full_gradient_once(rows):
    r = rows["zero0"]
    assert r["comm_dp_all_reduce_ops"] == 1 and r["comm_bytes_dp"] == PB == r["comm_wire_bytes_dp"]


def test_zero3_strict_moves_one_and_a_half_times_ddp(rows):
    """Params all-gathered in forward and again in backward, gradients reduce-scattered: 3 × (n−1)/n · Ψ
    against DDP's 2 (n−1)/n · Ψ (ZeRO paper §7). Only DeepSpeed's 8-byte scalar all-reduce is extra."""
    r = rows["zero3_strict"]
    assert r["comm_dp_all_gather_bytes"] == 2 * PB and r["comm_dp_reduce_scatter_bytes"] == PB
    assert math.isclose(r["comm_wire_bytes_dp"] / PB, 1.5, rel_tol=1e-4)


def test_counter_agrees_with_deepspeeds_comms_logger(rows):
    """The dispatcher-level counter and DeepSpeed's own logger see the same step (the counted one).
    The logger sizes an all-gather by its input shard, the counter by its gathered output."""
    r = rows["zero3_strict"]
    logged = json.loads(r["ds_comms_logger"])
    for op, kind, scale in (("all_gather_into_tensor", "all_gather", 2), ("reduce_scatter_tensor", "reduce_scatter", 1),
                            ("all_reduce", "all_reduce", 1)):
        assert logged[op]["ops"] == r[f"comm_dp_{kind}_ops"], op
        assert logged[op]["bytes"] * scale == r[f"comm_dp_{kind}_bytes"], op
    assert sum(v["ops"] for v in logged.values()) == r["comm_ops_dp"]


def test_persistent_bytes_fall_with_the_stage_exactly(rows):
    """Per rank, fp32, dp = 2, Ψ = parameter bytes. What DeepSpeed keeps (its real local tensors,
    counted by the one rule, bench.metrics.memory.state_bytes):
    stage 0: Ψ params + Ψ grads + 2Ψ Adam moments;
    stage 1 and 2 alike: Ψ params + the fp32 gradient partition its optimizer steps on (Ψ/dp)
    + (fp32 master + 2 moments)/dp — ZeRO ≥ 1 keeps an fp32 master partition even in fp32 training;
    stage 3 (strict knobs): (params + grads + master + 2 moments)/dp = 5Ψ/2."""
    per_rank = {name: json.loads(rows[name]["persistent_bytes_per_rank"]) for name in rows}
    assert per_rank["zero0"] == [4 * PB] * 2
    assert per_rank["zero1"] == per_rank["zero2"] == [PB + PB // 2 + 3 * PB // 2] * 2
    assert per_rank["zero3_strict"] == [5 * PB // 2] * 2
    assert rows["zero3_strict"]["params_bytes"] == rows["zero3_strict"]["grads_bytes"] == PB // 2


def test_pipeline_moves_activations_between_stages(rows):
    r = rows["pipe2"]
    act = 2 * TINY.seq_len * TINY.hidden * 4  # (micro_batch, seq, hidden) fp32
    # stage 0 sends 2 micro-batches of activations, stage 1 their 2 gradients back
    assert r["comm_pp_send_ops"] == 2 and r["comm_pp_send_bytes"] == 2 * act


# --- world 4 --------------------------------------------------------------------------------------------
def test_world4_zero3_and_pipeline_times_data_parallel(pools, reference):
    assert_parity(run_ok(pools, zero=3, dp=4), reference)
    pipe = run_ok(pools, pp=2, dp=2, micro_batches=2, zero=1)
    assert_parity(pipe, reference)
    # DeepSpeed's pipeline sends on WORLD; the counter still files them under pp (both ends in a pp group)
    act = 2 * TINY.seq_len * TINY.hidden * 4
    assert pipe["comm_pp_send_bytes"] == 2 * act and pipe.get("comm_bytes_world", 0) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(zero=1, dp=4), dict(zero=2, dp=4), dict(tp=2, dp=2),
                                dict(tp=2, pp=2, micro_batches=2), dict(tp=2, pp=2, micro_batches=2, order="tp-dp-pp"),
                                dict(pp=2, dp=2, micro_batches=2, order="tp-dp-pp"), dict(tp=2, dp=2, zero=3)])
def test_world4_layouts(pools, reference, kw):
    assert_parity(run_ok(pools, **kw), reference)


# --- context parallel: Ulysses' all-to-alls, counted -------------------------------------------------------
ULYSSES = {  # tiny-llama (GQA: 4 query heads, 2 K/V heads of 16), cp 2, micro-batch 2 × seq 32, ZeRO-0
    "fp32": dict(), "bf16": dict(dtype="bf16-mixed"), "selective": dict(recompute="selective"),
    "full": dict(recompute="full")}


def _ulysses_all_to_alls(cfg, trainer, groups) -> dict | None:
    """(ops, payload bytes) of the cp group's all-to-alls in one micro-batch's forward and its backward."""
    from bench.metrics.comm import CommCounter
    (x, y), = trainer.batch(0)
    with CommCounter.for_groups(groups) as forward:
        loss = trainer.loss(trainer.engine(x), y)
    with CommCounter.for_groups(groups) as backward:
        trainer.engine.backward(loss)
    counted = {phase: c.stats[("cp", "all_to_all")] for phase, c in (("forward", forward), ("backward", backward))}
    return {phase: (s.ops, s.bytes) for phase, s in counted.items()} if groups.rank == 0 else None


def _ulysses_on_rank(cfg_dicts: list[dict]) -> list | None:
    from support.parity import each_config
    return each_config(cfg_dicts, _ulysses_all_to_alls)


def test_ulysses_sends_four_all_to_alls_per_layer_each_way(pools):
    """Per layer and micro-batch, forward: one all-to-all each of Q, K and V (heads scattered, sequence
    gathered) and one of the output (back); backward: the four mirrored (dO, then dQ, dK, dV). Each payload
    is the rank's whole tensor: B·(T/cp)·hd·(2·nh + 2·nkv)·β bytes per layer each way. Selective recompute
    reruns the local attention only; full recompute reruns the forward's four in backward."""
    cfgs = [RunConfig(backend="deepspeed", model="tiny-llama", cp=2, micro_batch=2, steps=1, warmup=0, **f)
            for f in ULYSSES.values()]
    counts = pools(2).call(_ulysses_on_rank, [c.to_dict() for c in cfgs], timeout_s=600)[0]
    m = PRESETS["tiny-llama"]
    for name, cfg, got in zip(ULYSSES, cfgs, counts):
        beta = 2 if cfg.dtype == "bf16-mixed" else 4
        per_layer = cfg.micro_batch * (cfg.seq // cfg.cp) * m.head_dim * (2 * m.heads + 2 * m.num_kv_heads) * beta
        reruns = 2 if cfg.recompute == "full" else 1
        assert got == {"forward": (4 * m.layers, per_layer * m.layers),
                       "backward": (4 * m.layers * reruns, per_layer * m.layers * reruns)}, (name, got)
