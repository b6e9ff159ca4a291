"""The DeepSpeed config of a run, generated from its RunConfig (never hand-written), and `ds_set` overrides.

Pure (no torch, no deepspeed import): bench.capabilities parses the overrides before any process
starts, and a test can read the generated config without a rank.

Bucket sizes: DeepSpeed counts its buckets in *elements*; `bucket_mb` is MiB of gradient, so it is
divided by the gradient element size (4 B in fp32, 2 B in bf16).
"""
from __future__ import annotations

import copy
from typing import Any

import yaml

# What `zero_optimization` says beside the stage, so the row records every knob that shapes traffic.
# overlap_comm: DeepSpeed's own default (on at stage 3 only); the rest are DeepSpeed's defaults too.
_ZERO_DEFAULTS = {"contiguous_gradients": True, "reduce_scatter": True}


class DSSetError(ValueError):
    """A malformed `ds_set` entry (the message names it and the expected form)."""


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


def grad_bytes(cfg) -> int:
    return 2 if cfg.dtype == "bf16-mixed" else 4


def generate(cfg) -> dict:
    """The config DeepSpeed gets for `cfg`, before `ds_set` overrides."""
    bucket = int(cfg.bucket_mb * 2**20 / grad_bytes(cfg))  # elements
    zero = {"stage": cfg.zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": cfg.zero == 3, **_ZERO_DEFAULTS}
    if cfg.zero == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    return {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.micro_batches,
        "gradient_clipping": 0.0,  # no clipping: every backend runs the same plain AdamW update
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.dtype == "bf16-mixed"},
        "fp16": {"enabled": cfg.dtype == "fp16-mixed"},
        "zero_allow_untested_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the whole device at every forward
        # and every engine.step (engine.py `tput_timer`, utils/timer.py): on a GPU a host stall per
        # micro-batch that no other backend pays and that neither sync counter sees
        "timers": {"throughput": {"enabled": False}},
        "dump_state": False,
    }


def final_config(cfg) -> dict:
    """Generated config with the run's `ds_set` overrides applied: what `deepspeed.initialize` gets."""
    return apply_ds_set(generate(cfg), cfg.ds_set)


def check(cfg) -> str | None:
    """Why the overrides of `cfg` cannot run, or None (the last of bench.capabilities' deepspeed checks)."""
    try:
        config = final_config(cfg)
    except DSSetError as e:
        return f"backend deepspeed: {e}"
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", cfg.zero) if isinstance(zero, dict) else cfg.zero
    if stage != cfg.zero:
        return (f"backend deepspeed: ds_set zero_optimization.stage={stage} contradicts zero={cfg.zero}; "
                "use --zero to choose the stage (it is a column of the row)")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) != generate(cfg)[key]:
            return (f"backend deepspeed: ds_set {key} contradicts the run's batch "
                    f"(micro_batch={cfg.micro_batch}, micro_batches={cfg.micro_batches}, dp={cfg.dp}); "
                    "set --micro-batch / --micro-batches instead")
    if _enabled(config, "fp16") and cfg.device != "cuda":
        return ("backend deepspeed: fp16 is not supported on cpu (DeepSpeed's CPU accelerator refuses it); "
                "use dtype bf16-mixed or fp32, or --device cuda on a GPU host")
    return None


def _enabled(config: dict, section: str) -> bool:
    value = config.get(section)
    return isinstance(value, dict) and bool(value.get("enabled"))
