"""torchtitan: read a train-config TOML (or the JSON `--debug.print_config` writes) into a RunConfig, and write one back.

torchtitan trains with FSDP2 (backend fsdp here). Its mesh is [pp, dp_replicate, fsdp, cp, tp]: tp fastest,
pp outermost, order tp-dp-pp. The model is a named flavor whose shape lives in code
(torchtitan/models/llama3/__init__.py at 238fa99): FLAVORS holds those shapes. Defaults are its JobConfig's
(torchtitan/config/job_config.py at the same commit). TOML configs ended with commit 9810191 (2026-02):
later torchtitan writes Python recipes, which are not read (they would have to be run).
"""
from __future__ import annotations

from bench.ecosystem.table import Flag, Imported, SourceError, prefix_reason

FRAMEWORK = "torchtitan"


def _llama3(dim, n_layers, n_heads, n_kv_heads=None, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=None):
    """A torchtitan Llama-3 flavor as GPTConfig fields (its FeedForward's width rule)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    ffn = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    return dict(vocab=vocab_size, layers=n_layers, hidden=dim, heads=n_heads, kv_heads=n_kv_heads, ffn_hidden=ffn,
                norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False)


FLAVORS = {
    ("llama3", "debugmodel"): _llama3(256, 6, 16, vocab_size=2048),
    ("llama3", "8B"): _llama3(4096, 32, 32, 8, ffn_dim_multiplier=1.3, multiple_of=1024),
    ("llama3", "70B"): _llama3(8192, 80, 64, 8, ffn_dim_multiplier=1.3, multiple_of=4096),
    ("llama3", "405B"): _llama3(16384, 126, 128, 8, ffn_dim_multiplier=1.2, multiple_of=4096),
}
"""(model.name, model.flavor) → shape; the flavors' `_flex`/`_varlen` twins change the attention mask (blocked)."""

MAPPED = {
    "parallelism.tensor_parallel_degree": Flag("tp", 1, int),
    "parallelism.pipeline_parallel_degree": Flag("pp", 1, int),
    "parallelism.context_parallel_degree": Flag("cp", 1, int),
    "training.seq_len": Flag("seq", 2048, int),
    "compile.enable": Flag("compile", False, bool),
}
RULES = ("model.name", "model.flavor", "model.converters", "parallelism.data_parallel_replicate_degree",
         "parallelism.data_parallel_shard_degree", "parallelism.fsdp_reshard_after_forward",
         "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
         "parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers",
         "parallelism.pipeline_parallel_layers_per_stage", "parallelism.context_parallel_rotate_method",
         "training.local_batch_size", "training.global_batch_size", "training.dtype", "training.mixed_precision_param",
         "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option")
DEFAULTS = {"parallelism.data_parallel_replicate_degree": 1, "parallelism.data_parallel_shard_degree": -1,
            "parallelism.fsdp_reshard_after_forward": "default", "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": 1, "parallelism.pipeline_parallel_first_stage_less_layers": 1,
            "parallelism.pipeline_parallel_last_stage_less_layers": 1, "parallelism.context_parallel_rotate_method": "allgather",
            "training.local_batch_size": 8, "training.global_batch_size": -1, "training.dtype": "float32",
            "training.mixed_precision_param": "bfloat16", "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "2", "model.name": "llama3", "model.flavor": "debugmodel"}
"""JobConfig's defaults of the keys read together below."""
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
BLOCKS = {"parallelism.expert_parallel_degree": "expert parallelism", "parallelism.expert_tensor_parallel_degree":
          "expert tensor parallelism", "training.enable_cpu_offload": "CPU offload",
          "parallelism.module_fqns_per_model_part": "a hand-made pipeline split",
          "optimizer.name": "an optimizer other than AdamW", "model.attn_type": "an attention variant"}
NEUTRAL = {"parallelism.expert_parallel_degree": 1, "parallelism.expert_tensor_parallel_degree": 1,
           "training.enable_cpu_offload": False, "parallelism.module_fqns_per_model_part": None,
           "optimizer.name": "AdamW", "model.attn_type": "sdpa"}
NO_EFFECT = {"job.": "job metadata", "profiling.": "profiling", "metrics.": "logging", "optimizer.": "optimizer hyper-parameter",
             "lr_scheduler.": "learning-rate schedule", "checkpoint.": "checkpointing", "validation.": "evaluation",
             "comm.": "time-outs", "training.max_norm": "gradient clipping: parabench never clips (issue 26)",
             "training.steps": "run length", "training.dataset": "data", "training.seed": "seed",
             "training.deterministic": "kernel determinism", "training.gc_": "host garbage collection",
             "training.mixed_precision_reduce": "numerics only (fp32 reduction, as here)",
             "model.hf_assets_path": "tokenizer files", "model.tokenizer_path": "tokenizer files",
             "compile.components": "which parts compile", "quantize.": "float8 settings (used only with converters)",
             "float8.": "float8 settings (used only with converters)", "mx.": "MX settings (used only with converters)",
             "memory_estimation.": "memory estimation", "fault_tolerance.": "fault tolerance", "experimental.": "extensions",
             "parallelism.enable_async_tensor_parallel": "timing only", "parallelism.disable_loss_parallel": "loss parallel (TP only)",
             "parallelism.enable_compiled_autograd": "compiled autograd", "activation_checkpoint.": "recompute details",
             "debug.": "debugging"}


def flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and prefix.count(".") < 1:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read(data: dict, source: str, world_size: int | None) -> Imported:
    imp = Imported(FRAMEWORK, source)
    imp.values.update(backend="fsdp", order="tp-dp-pp")
    imp.on_gpus()
    keys = flatten(data)
    for key, flag in MAPPED.items():
        _simple(imp, keys, key, flag, source)
    get = lambda key: keys.get(key, DEFAULTS[key])  # noqa: E731
    _model(imp, keys, get)
    _layout(imp, keys, get, source, world_size)
    _batch(imp, keys, get, source)
    _precision_and_recompute(imp, keys, get)
    for key, value in keys.items():
        if key not in MAPPED and key not in RULES:
            _leftover(imp, key, value)
    return imp


def _simple(imp: Imported, keys, key, flag: Flag, source) -> None:
    if key not in keys:
        imp.defaulted(key, flag.default, flag.target)
        return
    value = keys[key]
    if not isinstance(value, (bool, int) if flag.convert is bool else int) or (flag.convert is int and isinstance(value, bool)):
        raise SourceError(source, key, f"{value!r} is not {'true or false' if flag.convert is bool else 'an integer'}")
    imp.mapped(key, value, flag.target)


def _note(imp: Imported, keys, key, status_detail: str, value=None) -> None:
    """A row for one of the keys read together: mapped when the source sets it, else defaulted."""
    given = key in keys
    imp.add(key, keys[key] if given else DEFAULTS.get(key, value), "mapped" if given else "defaulted",
            status_detail + ("" if given else " (torchtitan's default)"))


def _model(imp: Imported, keys, get) -> None:
    name, flavor = get("model.name"), get("model.flavor")
    shape = FLAVORS.get((name, flavor))
    if shape is None:
        known = ", ".join(f"{n} {f}" for n, f in FLAVORS)
        imp.dropped("model.flavor", f"{name} {flavor}", f"not expressible: model {name} {flavor} (known: {known})",
                    blocks=True)
        imp.model = {}
        return
    from models.config import PRESETS
    seq = imp.values["seq"]
    same = next((p for p in PRESETS.values() if all(getattr(p, k) == v for k, v in shape.items())), None)
    imp.model = {**shape, "seq_len": same.seq_len if same else seq}  # rope: seq_len only sets the default seq
    _note(imp, keys, "model.name", f"model = {name}")
    _note(imp, keys, "model.flavor", f"model = {same.name if same else 'the flavor'}: {shape['layers']} layers, "
          f"hidden {shape['hidden']}, {shape['heads']} heads / {shape['kv_heads'] or shape['heads']} kv, "
          f"ffn {shape['ffn_hidden']}, vocab {shape['vocab']}")
    converters = keys.get("model.converters") or []
    if converters:
        imp.dropped("model.converters", converters, f"not expressible: {', '.join(converters)} training (issue 26)",
                    blocks=True)


def _layout(imp: Imported, keys, get, source, world_size) -> None:
    tp, pp, cp = imp.values["tp"], imp.values["pp"], imp.values["cp"]
    replicate, shard = get("parallelism.data_parallel_replicate_degree"), get("parallelism.data_parallel_shard_degree")
    if shard == -1:
        if world_size is None:
            raise SourceError(source, "parallelism.data_parallel_shard_degree",
                              "-1 fills the world size, which the TOML does not hold: give --world-size N")
        parallel = tp * pp * cp * replicate
        if world_size % parallel:
            raise SourceError(source, "--world-size", f"{world_size} is not divisible by tp ({tp}) × pp ({pp}) × cp "
                              f"({cp}) × data_parallel_replicate_degree ({replicate}) = {parallel}")
        shard = world_size // parallel
    dp = replicate * shard
    world = tp * pp * cp * dp
    if world_size is not None and world_size != world:
        raise SourceError(source, "--world-size", f"{world_size}, but the TOML's degrees multiply to {world}")
    imp.values.update(dp=dp, world_size=world)
    reshard = get("parallelism.fsdp_reshard_after_forward")
    reshards = reshard == "always" or (reshard == "default" and pp == 1)  # "default": not with a pipeline
    mode = "none" if shard == 1 and replicate > 1 else "hybrid" if replicate > 1 else "full" if reshards else "grad-op"
    imp.values["fsdp"] = mode
    _note(imp, keys, "parallelism.data_parallel_shard_degree", f"dp = {dp} (replicate {replicate} × shard {shard})")
    _note(imp, keys, "parallelism.data_parallel_replicate_degree", f"fsdp = {mode}")
    _note(imp, keys, "parallelism.fsdp_reshard_after_forward", f"fsdp = {mode}")
    if mode == "hybrid":
        imp.dropped("parallelism.data_parallel_replicate_degree", replicate, f"not expressible: an explicit HSDP split "
                    f"(replicate {replicate} × shard {shard}); the fsdp backend derives it from the node (issue 26)",
                    blocks=True)
    if tp > 1:
        imp.dropped("parallelism.tensor_parallel_degree", tp, "not expressible: torchtitan's TP plan (sequence-parallel "
                    "norms, loss parallel, sharded embedding and head) is not the fsdp backend's (issue 26)", blocks=True)
    _pipeline(imp, keys, get, pp)
    if cp > 1:
        rotate = get("parallelism.context_parallel_rotate_method")
        if rotate == "alltoall":
            imp.values["cp_comm"] = "ring"
            _note(imp, keys, "parallelism.context_parallel_rotate_method", "cp_comm = ring (K/V passed round the group)")
        else:
            imp.dropped("parallelism.context_parallel_rotate_method", rotate, f"not expressible: context parallel "
                        f"by {rotate} of K/V (ring passes them round; issue 26)", blocks=True)


def _pipeline(imp: Imported, keys, get, pp: int) -> None:
    schedule = get("parallelism.pipeline_parallel_schedule")
    pipeline_keys = [k for k in RULES if k.startswith("parallelism.pipeline_parallel_") and k in keys]
    if pp == 1:
        for key in pipeline_keys:
            if key != "parallelism.pipeline_parallel_microbatch_size":
                imp.dropped(key, keys[key], "no effect at pp 1")
        return
    if schedule not in SCHEDULES:
        imp.dropped("parallelism.pipeline_parallel_schedule", schedule, f"not expressible: schedule {schedule} "
                    f"(known: {', '.join(SCHEDULES)})", blocks=True)
    else:
        imp.values["schedule"] = SCHEDULES[schedule]
        _note(imp, keys, "parallelism.pipeline_parallel_schedule", f"schedule = {SCHEDULES[schedule]}")
    per_stage = keys.get("parallelism.pipeline_parallel_layers_per_stage")
    layers = imp.model.get("layers")
    if schedule == "Interleaved1F1B":
        if not per_stage or not layers or layers % (pp * per_stage):
            imp.dropped("parallelism.pipeline_parallel_layers_per_stage", per_stage, "not expressible: interleaved "
                        "stages from torchtitan's own split (give pipeline_parallel_layers_per_stage dividing the layers)",
                        blocks=True)
        else:
            imp.values["virtual_stages"] = layers // (pp * per_stage)
            _note(imp, keys, "parallelism.pipeline_parallel_layers_per_stage",
                  f"virtual_stages = {imp.values['virtual_stages']} (layers / (pp × {per_stage}))")
    for key in ("parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers"):
        if get(key):
            imp.dropped(key, get(key), "not expressible: uneven pipeline stages (torchtitan's default takes a layer off "
                        "the first and last stage; issue 26)", blocks=True)
        else:
            _note(imp, keys, key, "even stages")


def _batch(imp: Imported, keys, get, source) -> None:
    local, dp, pp = get("training.local_batch_size"), imp.values["dp"], imp.values["pp"]
    micro = get("parallelism.pipeline_parallel_microbatch_size") if pp > 1 else local
    if local % micro:
        raise SourceError(source, "parallelism.pipeline_parallel_microbatch_size",
                          f"{micro} does not divide training.local_batch_size ({local})")
    batch = get("training.global_batch_size")
    batch = local * dp if batch == -1 else batch
    if batch % (local * dp):
        raise SourceError(source, "training.global_batch_size", f"{batch} is not a multiple of local_batch_size "
                          f"({local}) × dp ({dp}) = {local * dp}")
    imp.values.update(micro_batch=micro, micro_batches=(local // micro) * (batch // (local * dp)))
    _note(imp, keys, "training.local_batch_size", f"micro_batch = {local}" if pp == 1 else
          f"micro_batches = local_batch_size / pipeline microbatch ({micro}) × accumulation")
    if pp > 1:
        _note(imp, keys, "parallelism.pipeline_parallel_microbatch_size", f"micro_batch = {micro}")
    _note(imp, keys, "training.global_batch_size", f"micro_batches = {imp.values['micro_batches']} "
          f"(accumulation {batch // (local * dp)})")


def _precision_and_recompute(imp: Imported, keys, get) -> None:
    if get("training.dtype") == "bfloat16":
        imp.dropped("training.dtype", "bfloat16", "not expressible: pure bf16 training (no fp32 master weights; issue 26)",
                    blocks=True)
    param = get("training.mixed_precision_param")
    imp.values["dtype"] = "bf16-mixed" if param == "bfloat16" else "fp32"
    _note(imp, keys, "training.mixed_precision_param", f"dtype = {imp.values['dtype']}")
    mode, option = get("activation_checkpoint.mode"), str(get("activation_checkpoint.selective_ac_option"))
    if mode in ("none", "full") or (mode == "selective" and option == "1"):
        imp.values["recompute"] = "full" if mode != "none" else "none"
        _note(imp, keys, "activation_checkpoint.mode", f"recompute = {imp.values['recompute']}")
    else:
        what = {"op": "per-op selective recompute"}.get(option, f"full recompute of one layer in {option}")
        what = what if mode == "selective" else f"recompute mode {mode}"
        closest = "selective" if option == "op" and mode == "selective" else "full"
        imp.dropped("activation_checkpoint.mode", mode, f"not expressible: {what} (parabench's selective recomputes the "
                    f"attention core; the closest: recompute {closest}; issue 26)", blocks=True)
        imp.values["recompute"] = closest


def _leftover(imp: Imported, key: str, value) -> None:
    block = prefix_reason(key, BLOCKS)
    if block and NEUTRAL.get(key, object()) != value:
        imp.dropped(key, value, f"not expressible: {block} (issue 26)", blocks=True)
    elif block:
        imp.dropped(key, value, "no effect at this value")
    elif prefix_reason(key, NO_EFFECT):
        imp.dropped(key, value, f"no effect on the layout: {prefix_reason(key, NO_EFFECT)}")
    else:
        imp.dropped(key, value, "unknown to the importer: assumed not to change the layout or the math")


# --- writing -------------------------------------------------------------------------------------------------

def export_toml(cfg) -> str:
    """A torchtitan train-config TOML of `cfg` (backend fsdp): importing it gives `cfg` back."""
    refuse = _export_reason(cfg)
    if refuse:
        raise SourceError("export --to torchtitan", "", refuse)
    name, flavor = next(k for k, shape in FLAVORS.items() if _is_flavor(cfg.model_config, shape))
    replicate, shard = (cfg.dp, 1) if cfg.fsdp == "none" else (1, cfg.dp)
    local = cfg.micro_batch * (cfg.micro_batches if cfg.pp > 1 else 1)
    sections = {
        "model": {"name": name, "flavor": flavor},
        "training": {"local_batch_size": local, "global_batch_size": local * cfg.dp * (1 if cfg.pp > 1 else cfg.micro_batches),
                     "seq_len": cfg.seq, "mixed_precision_param": "bfloat16" if cfg.dtype == "bf16-mixed" else "float32"},
        "parallelism": {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                        "fsdp_reshard_after_forward": "never" if cfg.fsdp == "grad-op" else "always",
                        "tensor_parallel_degree": cfg.tp, "pipeline_parallel_degree": cfg.pp,
                        "context_parallel_degree": cfg.cp},
        "activation_checkpoint": {"mode": cfg.recompute} if cfg.recompute != "selective" else
                                 {"mode": "selective", "selective_ac_option": "op"},
        "compile": {"enable": cfg.compile},
    }
    if cfg.pp > 1:
        inverse = {v: k for k, v in SCHEDULES.items()}
        sections["parallelism"].update(pipeline_parallel_schedule=inverse[cfg.schedule],
                                       pipeline_parallel_microbatch_size=cfg.micro_batch,
                                       pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0)
        if cfg.schedule == "interleaved":
            sections["parallelism"]["pipeline_parallel_layers_per_stage"] = cfg.model_config.layers // (cfg.pp * cfg.virtual_stages)
    if cfg.cp > 1:
        sections["parallelism"]["context_parallel_rotate_method"] = "alltoall"
    lines = [f"# parabench run {cfg.run_id}: world size {cfg.world}"] + [f"# not the same: {why}" for why in _differences(cfg)]
    for section, values in sections.items():
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _is_flavor(model, shape: dict) -> bool:
    return all(getattr(model, k) == v for k, v in shape.items())


def _export_reason(cfg) -> str | None:
    if cfg.backend != "fsdp":
        return f"backend {cfg.backend}: torchtitan trains with FSDP2; export backend fsdp configs"
    if not any(_is_flavor(cfg.model_config, shape) for shape in FLAVORS.values()):
        return f"model {cfg.model}: not a torchtitan flavor ({', '.join(f'{n} {f}' for n, f in FLAVORS)})"
    if cfg.fsdp == "hybrid":
        return "fsdp hybrid: the fsdp backend derives its HSDP split from the node; torchtitan needs it explicit"
    if cfg.order != "tp-dp-pp" and cfg.pp > 1 and cfg.dp > 1:
        return f"order {cfg.order}: torchtitan's mesh is [pp, dp, cp, tp], order tp-dp-pp"
    if cfg.fsdp == "none" and cfg.dp == 1:
        return "fsdp none at dp 1: torchtitan shards whenever it does not replicate; use fsdp full"
    return None


def _differences(cfg) -> list[str]:
    """What torchtitan runs differently from this config (its import lists them as blockers)."""
    out = []
    if cfg.tp > 1:
        out.append("tp: torchtitan's TP plan (sequence-parallel norms, loss parallel, sharded embedding and head) is not "
                   "the fsdp backend's (issue 26)")
    if cfg.recompute == "selective":
        out.append("recompute: written as torchtitan's per-op selective recompute, the closest to parabench's "
                   "(the attention core; issue 26)")
    return out


def _toml(value) -> str:
    return "true" if value is True else "false" if value is False else f'"{value}"' if isinstance(value, str) else str(value)
