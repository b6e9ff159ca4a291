"""DeepSpeed: read a DeepSpeed JSON (with its launch arguments) into a RunConfig, and write one back.

A DeepSpeed JSON holds the batch, ZeRO and precision but neither the layout nor the model: those come from
the Megatron-DeepSpeed launch arguments (`bench import ds.json -- --tensor-model-parallel-size 2 …`, read
by bench/ecosystem/megatron.py), or `--model` / `--model-config` and `--world-size` (dp fills the world).
`"auto"` is resolved as transformers' integration does (integrations/deepspeed.py) from TrainingArguments'
defaults: micro-batch 8, accumulation 1, train batch = their product × dp, fp16 and bf16 off, buckets from
the model's hidden size. Other keys of the engine's sections that parabench's generated config does not
hold as given become `ds_set` entries (exact); DeepSpeed's topology puts pipe outermost and model innermost:
order tp-dp-pp.
"""
from __future__ import annotations

from bench.ecosystem.table import Flag, Imported, SourceError, prefix_reason

FRAMEWORK = "deepspeed"
HF_DEFAULTS = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "fp16.enabled": False,
               "bf16.enabled": False}
"""transformers' TrainingArguments defaults, which fill "auto" (per_device_train_batch_size 8, …)."""

MAPPED = {
    "train_micro_batch_size_per_gpu": Flag("micro_batch", None, int),
    "gradient_accumulation_steps": Flag("micro_batches", 1, int),
    "zero_optimization.stage": Flag("zero", 0, int),
    "tensor_parallel.autotp_size": Flag("tp", 1, int),
}
RULES = ("train_batch_size", "bf16.enabled", "bfloat16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size")
DS_SET = ("zero_optimization.", "fp16.", "bf16.", "bfloat16.", "communication_data_type", "prescale_gradients",
          "gradient_predivide_factor", "pipeline.", "data_types.", "seq_parallel_communication_data_type")
"""Sections whose other keys shape the engine's traffic or state: kept exactly, as ds_set entries."""
OFFLOAD = ("zero_optimization.offload_", "zero_optimization.zenflow")
NO_EFFECT = {
    "optimizer.params": "optimizer hyper-parameter (parabench runs AdamW)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpointing",
    "scheduler": "learning-rate schedule", "gradient_clipping": "gradient clipping: parabench never clips (issue 26)",
    "steps_per_print": "logging", "wall_clock_breakdown": "logging", "timers.": "logging", "dump_state": "logging",
    "tensorboard.": "logging", "wandb.": "logging", "csv_monitor.": "logging", "comms_logger.": "logging",
    "flops_profiler.": "profiling", "zero_allow_untested_optimizer": "a check",
    "activation_checkpointing.": "DeepSpeed's checkpointing API (parabench recomputes by its recompute field)",
    "checkpoint.": "checkpointing", "aio.": "NVMe I/O settings", "autotuning.": "autotuning",
    "elasticity.": "elastic training",
}
BLOCKS = {"compression_training.": "compression", "sparse_attention.": "sparse attention",
          "curriculum_learning.": "curriculum learning (varying sequence length)", "moe.": "mixture of experts",
          "data_efficiency.": "data efficiency (varying sequence length)", "fp8.": "fp8 training"}
OPTIMIZERS = ("adam", "adamw", "fusedadam")


def flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read(data: dict, source: str, base: Imported, world_size: int | None) -> Imported:
    """`data` (the JSON) over `base`: the launch arguments' config, or a model with the default layout."""
    imp = base
    imp.framework, imp.source = FRAMEWORK, source
    imp.values.update(backend="deepspeed", order="tp-dp-pp")
    if "device" not in imp.values:
        imp.on_gpus()
    keys = flatten(data)
    for key, flag in MAPPED.items():
        _mapped(imp, keys, key, flag, source)
    _world(imp, keys, source, world_size)
    _precision(imp, keys)
    _bucket(imp, keys, source)
    leftovers = {k: v for k, v in keys.items() if k not in MAPPED and k not in RULES}
    _engine_keys(imp, leftovers)
    return imp


def _value(imp: Imported, keys: dict, key: str, source: str, kind=int):
    raw = keys[key]
    if raw == "auto":
        return HF_DEFAULTS[key]
    if kind is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise SourceError(source, key, f"{raw!r} is not an integer")
    return raw


def _mapped(imp: Imported, keys, key, flag: Flag, source) -> None:
    previous = imp.get(flag.target)
    if key not in keys:
        if previous is None:
            imp.defaulted(key, flag.default, flag.target)
        elif flag.target in ("zero", "micro_batches"):
            imp.defaulted(key, flag.default, flag.target, note="DeepSpeed's default")
        return
    value = _value(imp, keys, key, source)
    note = "transformers' TrainingArguments default for \"auto\"" if keys[key] == "auto" else ""
    if previous is not None and previous != value and flag.target in ("micro_batch", "tp"):
        imp.conflict(key, keys[key], f"the launch arguments say {flag.target} {previous}; the JSON's {value} is used")
    imp.mapped(key, keys[key], flag.target, value, note)


def _world(imp: Imported, keys, source, world_size) -> None:
    """dp from the world size, or by DeepSpeed's own rule: train_batch_size / (micro × accumulation)."""
    parallel = imp.values.get("tp", 1) * imp.values.get("pp", 1) * imp.values.get("cp", 1)
    micro, steps = imp.values["micro_batch"], imp.values["micro_batches"]
    batch = keys.get("train_batch_size", "auto")
    if world_size is None and batch != "auto":
        if not isinstance(batch, int) or isinstance(batch, bool) or batch % (micro * steps):
            raise SourceError(source, "train_batch_size", f"{batch!r} is not a multiple of micro-batch ({micro}) × "
                              f"gradient_accumulation_steps ({steps})")
        world_size = batch // (micro * steps) * parallel
        imp.entries = [e for e in imp.entries if e.key != "world size"]
        imp.add("world size", None, "defaulted", f"world_size = {world_size} (train_batch_size / (micro × "
                "accumulation) × tp × cp × pp)")
    elif world_size is None:
        world_size = imp.values.get("world_size") or parallel
        if not any(e.key == "world size" for e in imp.entries):
            imp.add("world size", None, "defaulted", f"world_size = {world_size} (not in the source: dp = 1; give --world-size N)")
    if world_size % parallel:
        raise SourceError(source, "--world-size", f"{world_size} is not divisible by tp × cp × pp = {parallel}")
    dp = world_size // parallel
    imp.values.update(dp=dp, world_size=world_size)
    if batch == "auto":
        imp.add("train_batch_size", batch if "train_batch_size" in keys else None,
                "mapped" if "train_batch_size" in keys else "defaulted",
                f"= micro × accumulation × dp = {micro * steps * dp} (transformers' rule for \"auto\")")
    elif batch != micro * steps * dp:
        raise SourceError(source, "train_batch_size", f"{batch} ≠ micro-batch ({micro}) × gradient_accumulation_steps "
                          f"({steps}) × dp ({dp}) = {micro * steps * dp}: DeepSpeed refuses it")
    else:
        imp.add("train_batch_size", batch, "mapped", f"dp = {dp} (train_batch_size / (micro × accumulation))")


def _precision(imp: Imported, keys) -> None:
    bf16 = keys.get("bf16.enabled", keys.get("bfloat16.enabled", "auto"))
    fp16 = keys.get("fp16.enabled", "auto")
    bf16, fp16 = (False if v == "auto" else bool(v) for v in (bf16, fp16))
    dtype = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
    if bf16 and fp16:
        imp.conflict("fp16.enabled", True, "with bf16.enabled (DeepSpeed refuses both); bf16 is used")
    for key in ("bf16.enabled", "bfloat16.enabled", "fp16.enabled"):
        if key in keys:
            imp.mapped(key, keys[key], "dtype", dtype, "\"auto\": TrainingArguments' default off" if keys[key] == "auto" else "")
    if not any(k in keys for k in ("bf16.enabled", "bfloat16.enabled", "fp16.enabled")):
        imp.defaulted("bf16.enabled", False, "dtype", dtype, "DeepSpeed's default: fp32")


def _bucket(imp: Imported, keys, source) -> None:
    from bench.conventions import grad_bytes
    key = "zero_optimization.reduce_bucket_size"
    raw = keys.get(key)
    if raw is None:
        return
    hidden = imp.model.get("hidden")
    elements = hidden * hidden if raw == "auto" and hidden else raw
    if not isinstance(elements, (int, float)) or isinstance(elements, bool):
        raise SourceError(source, key, f"{raw!r} is not a number of elements")
    per = grad_bytes(_dtype_only(imp.values["dtype"]))
    imp.mapped(key, raw, "bucket_mb", int(elements) * per / 2**20,
               f"{int(elements):,} elements × {per} B" + (" (\"auto\": hidden²)" if raw == "auto" else ""))
    keys.setdefault("zero_optimization.allgather_bucket_size", int(elements))


def _dtype_only(dtype: str):
    from types import SimpleNamespace
    return SimpleNamespace(dtype=dtype, backend="deepspeed")


def _engine_keys(imp: Imported, keys: dict) -> None:
    """Keys beside the mapped ones: equal to parabench's generated config, a ds_set entry, or dropped."""
    generated = _generated(imp)
    hidden = imp.model.get("hidden")
    autos = {"zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
    ds_set = list(imp.values.get("ds_set", ()))
    for key, value in keys.items():
        if value == "auto" and key in autos and hidden:
            value = autos[key](hidden)
        if prefix_reason(key, BLOCKS):
            imp.dropped(key, value, f"not expressible: {prefix_reason(key, BLOCKS)} (issue 26)", blocks=True)
        elif key == "optimizer.type":
            ok = str(value).lower() in OPTIMIZERS
            imp.dropped(key, value, "parabench runs AdamW" if ok else f"not expressible: optimizer {value} (parabench runs AdamW)",
                        blocks=not ok)
        elif generated is not None and key in generated and generated[key] == value:
            imp.add(key, value, "mapped", "as parabench's generated DeepSpeed config")
        elif key.startswith(DS_SET) and value != "auto":
            ds_set.append(f"{key}={_yaml(value)}")
            note = " (runs; the estimate does not model offload)" if key.startswith(OFFLOAD) else ""
            imp.add(key, value, "mapped", f"ds_set {key}={_yaml(value)}{note}")
        elif prefix_reason(key, NO_EFFECT):
            imp.dropped(key, value, f"no effect on the layout: {prefix_reason(key, NO_EFFECT)}")
        elif value == "auto":
            imp.dropped(key, value, "\"auto\" with no model value to resolve it from: DeepSpeed's default applies")
        else:
            imp.dropped(key, value, "unknown to the importer: assumed not to change the layout or the math")
    if ds_set:  # sorted: the file's key order is no part of the run (its id included)
        imp.values["ds_set"] = tuple(sorted(ds_set))


def _generated(imp: Imported) -> dict | None:
    """parabench's generated DeepSpeed config of what is mapped so far (None when that is no valid config)."""
    from bench.backends.deepspeed_config import generate
    from bench.config import ConfigError
    try:
        cfg = imp.config()
    except (ConfigError, TypeError, ValueError):
        return None
    return flatten(generate(cfg))


def _yaml(value) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


# --- writing -------------------------------------------------------------------------------------------------

def export_json(cfg) -> dict:
    """The DeepSpeed JSON of `cfg` (backend deepspeed): parabench's generated config with its ds_set."""
    from bench.backends.deepspeed_config import final_config
    if cfg.backend != "deepspeed":
        raise SourceError("export --to deepspeed", "", f"backend {cfg.backend}: export backend deepspeed configs "
                          "(the JSON is what that backend gives DeepSpeed)")
    return final_config(cfg)


def launch_args(cfg) -> list[str]:
    """The Megatron-DeepSpeed arguments that carry the layout and the model (the JSON has neither)."""
    from bench.ecosystem.megatron import model_args
    return model_args(cfg, deepspeed=True)
