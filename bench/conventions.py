"""The conventions every layer counts by, as pure data and arithmetic: the floor of the import graph.

- element bytes of each training precision, and the matmul key of its peak FLOP/s;
- the per-collective wire-byte rule (the worker's counter and the cost model both use it);
- the devices' datasheet peaks (MFU's denominator on GPU; the hardware profiles start from them);
- a run's DeepSpeed config as data: gradient element size, bucket sizes in elements, its fixed knobs, the
  `ds_set` overrides and their check, DeepSpeed's defaults of the knobs the cost model reads.

No torch and no other `bench` module: `bench.analysis`, `bench.metrics`, `bench.capabilities` and
the DeepSpeed backend all read these, so none of them needs another's module for a convention.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# --- precisions ----------------------------------------------------------------------------------
LOW_PRECISION = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""The dtype mixed precision runs its matmuls in."""


def dtype_key(dtype: str) -> str:
    """RunConfig dtype → the peak-FLOP/s key: mixed precision runs its matmuls in the low precision."""
    return LOW_PRECISION.get(dtype, "fp32")


def low_precision_bytes(dtype: str) -> int:
    """Bytes of one element in the dtype's compute precision (2 under mixed precision, else 4)."""
    return 2 if dtype in LOW_PRECISION else 4


# --- communication -------------------------------------------------------------------------------
def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one rank moves for `payload` under a ring algorithm in a group of n ranks (all-gather:
    payload is the gathered output; reduce-scatter: the full input). The worker's counter
    (bench.metrics.comm) and the cost model both use this rule."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * payload
    return float(payload)


# --- device peaks --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DevicePeak:
    """A datasheet's dense peak FLOP/s per matmul precision, and how a CUDA device name is matched."""

    name: str
    match: tuple[str, ...]
    flops: dict


DEVICE_PEAKS: dict[str, DevicePeak] = {p.name: p for p in (
    # NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s dense bf16/fp16, 19.5 fp32
    DevicePeak("a100-80gb", ("A100",), {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 67 fp32
    DevicePeak("h100-sxm", ("H100",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    # NVIDIA H200 datasheet (SXM): H100's compute
    DevicePeak("h200", ("H200",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
)}


def device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet entry whose `match` names the CUDA device, or None (e.g. on CPU)."""
    return next((p for p in DEVICE_PEAKS.values() if any(m in device_name for m in p.match)), None)


# --- DeepSpeed's arithmetic ----------------------------------------------------------------------
DEEPSPEED_DEFAULTS = {"stage3_param_persistence_threshold": 100_000, "stage3_prefetch_bucket_size": 50_000_000,
                      "reduce_bucket_size": 500_000_000, "stage3_max_live_parameters": 1_000_000_000,
                      "stage3_max_reuse_distance": 1_000_000_000}
"""DeepSpeed 0.19.8's defaults of the `zero_optimization` knobs the cost model reads, from
deepspeed/runtime/zero/config.py `DeepSpeedZeroConfig`: param_persistence_threshold `pp_int(1e5)`,
prefetch_bucket_size `pp_int(5e7)`, reduce_bucket_size `pp_int(5e8)`, max_live_parameters and
max_reuse_distance `pp_int(1e9)` (their aliases are the stage3_* / reduce_* keys)."""

ZERO3_KNOBS = {"zero3_param_persistence_threshold": "stage3_param_persistence_threshold",
               "zero3_max_live_parameters": "stage3_max_live_parameters",
               "zero3_max_reuse_distance": "stage3_max_reuse_distance",
               "zero3_prefetch_bucket_size": "stage3_prefetch_bucket_size"}
"""RunConfig's ZeRO-3 fields → the `zero_optimization` keys they set (deepspeed backend, zero 3). The
prefetch bucket's None is `bucket_mb`'s elements, as every bucket of the generated config."""


def zero3_knobs(cfg) -> tuple[tuple[str, Any], ...]:
    """The run's ZeRO-3 fields as (field, value) pairs (hashable); an object without them (a planner
    shape) has DeepSpeed's defaults."""
    return tuple((field, getattr(cfg, field, DEEPSPEED_DEFAULTS[key] if field != "zero3_prefetch_bucket_size"
                                 else None)) for field, key in ZERO3_KNOBS.items())


def zero3_section(knobs: tuple[tuple[str, Any], ...], bucket: int) -> dict:
    """The stage-3 keys of `zero_optimization` from `zero3_knobs` (`bucket`: bucket_mb's elements, the
    prefetch bucket when the run names none)."""
    out = {ZERO3_KNOBS[field]: value for field, value in knobs}
    if out["stage3_prefetch_bucket_size"] is None:
        out["stage3_prefetch_bucket_size"] = bucket
    return out


ZERO_DEFAULTS = {"contiguous_gradients": True, "reduce_scatter": True}
"""What `zero_optimization` says beside the stage, so the row records every knob that shapes traffic
(DeepSpeed's own defaults; overlap_comm, on at stage 3 only, is set per stage)."""


DEEPSPEED_RUNTIME = {
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
    # DeepSpeed's throughput timer (on by default) synchronises the whole device at every forward
    # and every engine.step (engine.py `tput_timer`, utils/timer.py): on a GPU a host stall per
    # micro-batch that no other backend pays and that neither sync counter sees
    "timers": {"throughput": {"enabled": False}},
    "dump_state": False,
}
"""The knobs of every run's DeepSpeed config that only shape how its engine runs (beside
`deepspeed_sections`, which follow from the RunConfig)."""


class DSSetError(ValueError):
    """A malformed `ds_set` entry (the message names it and the expected form)."""


def grad_bytes(cfg) -> int:
    """Bytes of one gradient element under DeepSpeed: its engine casts the module's parameters to the
    fp16 or bf16 section's dtype (engine._configure_distributed_model), and backward makes gradients
    in that dtype, which its reduce buckets hold (stage_1_and_2.py: ipg buckets per parameter dtype)."""
    return low_precision_bytes(cfg.dtype)


def bucket_elements(cfg) -> int:
    """DeepSpeed counts its buckets in elements; `bucket_mb` is MiB of gradient."""
    return int(cfg.bucket_mb * 2**20 / grad_bytes(cfg))


def deepspeed_sections(cfg) -> dict:
    """The part of a run's DeepSpeed config that follows from its RunConfig: batch, ZeRO, precision,
    the plain update (bench.backends.deepspeed_config adds the knobs that only run the engine)."""
    bucket = bucket_elements(cfg)
    zero = {"stage": cfg.zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": cfg.zero == 3, **ZERO_DEFAULTS}
    if cfg.zero == 3:
        zero.update(zero3_section(zero3_knobs(cfg), bucket))
    return {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.micro_batches,
        "gradient_clipping": 0.0,  # no clipping: every backend runs the same plain AdamW update
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.dtype == "bf16-mixed"},
        "fp16": {"enabled": cfg.dtype == "fp16-mixed"},
        "zero_allow_untested_optimizer": False,
    }


def parse_ds_set(entries: tuple | list) -> list[tuple[list[str], Any]]:
    """'zero_optimization.stage3_max_live_parameters=0' → (['zero_optimization', 'stage3_...'], 0).

    Values are YAML scalars: 0 → int, 1e6 → float, true → bool, null → None, auto → 'auto'."""
    out = []
    for entry in entries:
        if not isinstance(entry, str) or "=" not in entry:
            raise DSSetError(f"ds_set entry {entry!r} must look like KEY=VALUE with a dotted KEY, "
                             "e.g. zero_optimization.stage3_max_live_parameters=0")
        key, text = (s.strip() for s in entry.split("=", 1))
        path = key.split(".")
        if not key or any(not part for part in path):
            raise DSSetError(f"ds_set entry {entry!r}: key {key!r} has an empty part; use a dotted path "
                             "such as zero_optimization.overlap_comm")
        import yaml  # only with an entry: a command that sets none (`bench plan`) starts without it (~20 ms)
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as e:
            raise DSSetError(f"ds_set entry {entry!r}: value {text!r} is not a YAML scalar ({e})") from None
        if isinstance(value, (list, dict)):
            raise DSSetError(f"ds_set entry {entry!r}: value must be a scalar, not {type(value).__name__}; "
                             "set nested keys one by one with dotted paths")
        out.append((path, _as_number(value)))
    return out


def _as_number(value):
    """YAML 1.1 reads '5e8' as a string; DeepSpeed wants a number there."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "e" in value.lower() else number
    return value


def apply_ds_set(config: dict, entries) -> dict:
    """A copy of `config` with each dotted override set (missing levels are created)."""
    out = copy.deepcopy(config)
    for path, value in parse_ds_set(entries):
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise DSSetError(f"ds_set key {'.'.join(path)!r}: {'.'.join(path[:i + 1])!r} is "
                                 f"{child!r} in the generated config, not a section")
            node = child
        node[path[-1]] = value
    return out


def deepspeed_settings(bucket_mb: float, grad_bytes_: int, ds_set: tuple, zero3: tuple = ()) -> dict:
    """The knobs of a run's DeepSpeed config (generated, then `ds_set`) that shape traffic and state:
    persistence threshold, bucket sizes (elements), ZeRO-3's live-parameter and reuse limits, pipeline
    partitioning; DeepSpeed's defaults where none sets them. `zero3`: the run's ZeRO-3 fields as
    `zero3_knobs` (hashable: the analysis caches on these arguments)."""
    bucket = int(bucket_mb * 2**20 / grad_bytes_)  # elements, as deepspeed_sections sets both
    stage3 = zero3_section(zero3, bucket) if zero3 else {"stage3_prefetch_bucket_size": bucket}
    config = apply_ds_set({"zero_optimization": {**stage3, "reduce_bucket_size": bucket}}, ds_set)
    zero, pipe = config.get("zero_optimization", {}), config.get("pipeline", {})
    return {**{k: zero.get(k, v) for k, v in DEEPSPEED_DEFAULTS.items()},
            "pipe_partitioned": pipe.get("pipe_partitioned", True),
            "grad_partitioned": pipe.get("grad_partitioned", True)}


def check_ds_set(cfg) -> str | None:
    """Why the `ds_set` overrides of `cfg` cannot run, or None (the last of bench.capabilities' checks
    for an engine that takes them)."""
    generated = deepspeed_sections(cfg)
    try:
        config = apply_ds_set({**generated, **DEEPSPEED_RUNTIME}, cfg.ds_set)
    except DSSetError as e:
        return f"backend deepspeed: {e}"
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", cfg.zero) if isinstance(zero, dict) else cfg.zero
    if stage != cfg.zero:
        return (f"backend deepspeed: ds_set zero_optimization.stage={stage} contradicts zero={cfg.zero}; "
                "use --zero to choose the stage (it is a column of the row)")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) != generated[key]:
            return (f"backend deepspeed: ds_set {key} contradicts the run's batch "
                    f"(micro_batch={cfg.micro_batch}, micro_batches={cfg.micro_batches}, dp={cfg.dp}); "
                    "set --micro-batch / --micro-batches instead")
    if cfg.cp > 1 and stage == 3 and zero.get("reduce_scatter", True) is not True:
        return ("backend deepspeed: ds_set zero_optimization.reduce_scatter=false is not supported with cp > 1 "
                "at zero=3 (DeepSpeed 0.19.8 then averages some gradient buckets over dp, others over dp × cp); "
                "drop that override")
    if _enabled(config, "fp16") and cfg.device != "cuda":
        return ("backend deepspeed: fp16 is not supported on cpu (DeepSpeed's CPU accelerator refuses it); "
                "use dtype bf16-mixed or fp32, or --device cuda on a GPU host")
    return None


def _enabled(config: dict, section: str) -> bool:
    value = config.get(section)
    return isinstance(value, dict) and bool(value.get("enabled"))
