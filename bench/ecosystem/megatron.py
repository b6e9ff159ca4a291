"""Megatron-LM: read its arguments into a RunConfig, write a RunConfig back as its arguments.

Sources: an argument list (`bench import megatron -- ARGS…`), a launch script (its training command after
static expansion, bench/ecosystem/shell.py) and the functional tests' `model_config.yaml` (`MODEL_ARGS`,
anchors and several `MODEL_ARGS_N` blocks, each block's GPUS_PER_NODE from `MODEL_ENV_VARS`).
Defaults are Megatron-LM's own (megatron/training/arguments.py at d98e8a6); its rank order is
tp-cp-ep-dp-pp, which is tp-dp-pp here, and `--use-tp-pp-dp-mapping` makes it tp-pp-dp.
"""
from __future__ import annotations

import math

from bench.ecosystem.table import Flag, Imported, SourceError, flag_name, prefix_reason

FRAMEWORK = "megatron"

MAPPED = {
    "--tensor-model-parallel-size": Flag("tp", 1, int),
    "--pipeline-model-parallel-size": Flag("pp", 1, int),
    "--context-parallel-size": Flag("cp", 1, int),
    "--micro-batch-size": Flag("micro_batch", None, int),
    "--seq-length": Flag("seq", None, int),
    "--num-layers": Flag("model.layers", None, int),
    "--hidden-size": Flag("model.hidden", None, int),
    "--num-attention-heads": Flag("model.heads", None, int),
    "--normalization": Flag("model.norm", "LayerNorm", {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}),
    "--position-embedding-type": Flag("model.position", "learned_absolute", {"learned_absolute": "learned", "rope": "rope"}),
    "--use-rotary-position-embeddings": Flag("model.position", None, {True: "rope"}),
    "--swiglu": Flag("model.activation", False, {True: "swiglu", False: "gelu"}),
    "--disable-bias-linear": Flag("model.bias", False, {True: False, False: True}),
    "--untie-embeddings-and-output-weights": Flag("model.tie_embeddings", False, {True: False, False: True}),
    "--use-distributed-optimizer": Flag("zero", False, {True: 1, False: 0}),
    "--use-tp-pp-dp-mapping": Flag("order", False, {True: "tp-pp-dp", False: "tp-dp-pp"}),
}
"""Source flag → target and Megatron-LM's default: one line per flag read as it stands."""

RULES = ("--global-batch-size", "--step-batch-size-schedule", "--rampup-batch-size", "--ffn-hidden-size",
         "--max-position-embeddings", "--group-query-attention", "--num-query-groups", "--kv-channels",
         "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
         "--bf16", "--fp16", "--cp-comm-type", "--ddp-bucket-size", "--recompute-granularity", "--recompute-method",
         "--recompute-num-layers", "--recompute-modules", "--tokenizer-type", "--vocab-size", "--vocab-file",
         "--make-vocab-size-divisible-by")
"""Flags read together by the functions below (the batch, the shape's derived widths, vocab padding, …)."""

BLOCKS = {
    "--qk-layernorm": "qk-layernorm",
    "--squared-relu": "squared-ReLU activation",
    "--use-fused-weighted-squared-relu": "squared-ReLU activation",
    "--quick-geglu": "GeGLU activation",
    "--num-experts": "mixture of experts",
    "--moe-": "mixture of experts",
    "--expert-model-parallel-size": "expert parallelism",
    "--expert-tensor-parallel-size": "expert tensor parallelism",
    "--multi-latent-attention": "multi-latent attention",
    "--q-lora-rank": "multi-latent attention", "--kv-lora-rank": "multi-latent attention",
    "--qk-head-dim": "multi-latent attention", "--qk-pos-emb-head-dim": "multi-latent attention",
    "--v-head-dim": "multi-latent attention",
    "--mtp-": "multi-token prediction",
    "--fp8": "fp8 training",
    "--first-last-layers-bf16": "fp8 training", "--num-layers-at-": "fp8 training",
    "--grad-reduce-in-bf16": "bf16 gradient reduction",
    "--apply-layernorm-1p": "zero-centred LayerNorm (1p)",
    "--rotary-percent": "partial rotary embedding",
    "--decoder-first-pipeline-num-layers": "uneven pipeline stages",
    "--decoder-last-pipeline-num-layers": "uneven pipeline stages",
    "--pipeline-model-parallel-layout": "uneven pipeline stages",
    "--account-for-embedding-in-pipeline-split": "uneven pipeline stages",
    "--account-for-loss-in-pipeline-split": "uneven pipeline stages",
    "--num-distributed-optimizer-instances": "several distributed-optimizer instances",
    "--use-megatron-fsdp": "Megatron-FSDP", "--data-parallel-sharding-strategy": "Megatron-FSDP",
    "--use-torch-fsdp2": "torch FSDP2 inside Megatron-LM",
    "--hierarchical-context-parallel-sizes": "hierarchical context parallelism",
    "--encoder-num-layers": "an encoder-decoder model", "--decoder-num-layers": "an encoder-decoder model",
    "--hybrid-": "a hybrid (Mamba) model", "--mamba-": "a hybrid (Mamba) model", "--is-hybrid-model": "a hybrid model",
    "--spec": "a custom layer spec", "--model-provider": "a model other than GPT",
    "--experimental-attention-variant": "a linear/sparse attention variant", "--linear-": "linear attention",
    "--attention-output-gate": "gated attention output", "--window-size": "sliding-window attention",
    "--softmax-type": "a learnable softmax", "--dsa-": "sparse attention",
    "--perform-rl-step": "RL training", "--grpo-": "RL training", "--rl-": "RL training",
    "--optimizer": "an optimizer other than Adam",
    "--muon-": "the Muon optimizer",
    "--fine-grained-activation-offloading": "activation offloading", "--offload-modules": "activation offloading",
    "--use-mup": "muP", "--flextron": "Flextron", "--vocab-extra-ids": "an encoder-decoder model",
    "--img-": "a multimodal model", "--patch-dim": "a multimodal model", "--dataset-provider": "a multimodal model",
    "--bert-": "BERT", "--yarn-": "YaRN rotary scaling", "--rotary-scaling-factor": "rotary scaling",
}
"""Flags that change the math or the cost and have no field here: the config is not exactly expressible.
Keys are prefixes ('--moe-' covers every MoE flag)."""

NEUTRAL = {"--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1, "--rotary-percent": 1.0,
           "--num-distributed-optimizer-instances": 1, "--optimizer": "adam", "--mtp-num-layers": 0,
           "--rotary-scaling-factor": 1.0, "--first-last-layers-bf16": False, "--num-layers-at-start-in-bf16": 0}
"""Values of blocking flags that change nothing (then the flag is dropped without blocking)."""

NO_EFFECT = {
    "--log": "logging", "--tensorboard": "logging", "--wandb-": "logging", "--timing-log": "logging",
    "--logging-level": "logging", "--straggler": "monitoring", "--check-weight-hash": "monitoring",
    "--save": "checkpointing", "--load": "checkpointing", "--ckpt": "checkpointing", "--dist-ckpt": "checkpointing",
    "--async-": "checkpointing", "--use-persistent-ckpt-worker": "checkpointing", "--no-load-": "checkpointing",
    "--finetune": "checkpointing", "--use-checkpoint-": "checkpointing", "--auto-detect-ckpt-format": "checkpointing",
    "--no-ckpt": "checkpointing", "--override-opt": "checkpointing", "--pretrained-checkpoint": "checkpointing",
    "--exit-": "run length", "--train-iters": "run length", "--train-samples": "run length",
    "--eval-": "evaluation", "--skip-train": "evaluation",
    "--lr": "learning-rate schedule", "--min-lr": "learning-rate schedule", "--decoupled-": "learning-rate schedule",
    "--weight-decay": "optimizer hyper-parameter", "--adam-": "optimizer hyper-parameter",
    "--start-weight-decay": "optimizer hyper-parameter", "--end-weight-decay": "optimizer hyper-parameter",
    "--init-method-std": "initialization", "--seed": "seed", "--rerun-": "result validation",
    "--error-injection": "result validation", "--check-for-": "result validation", "--no-check-for-": "result validation",
    "--data-": "data", "--split": "data", "--mock-data": "data", "--num-workers": "data", "--dataloader-": "data",
    "--no-mmap-bin-files": "data", "--no-create-attention-mask-in-dataloader": "data", "--fim-": "data",
    "--merge-file": "tokenizer file", "--tokenizer-model": "tokenizer file", "--tiktoken-": "tokenizer",
    "--no-use-tokenizer-model-from-checkpoint-args": "tokenizer",
    "--distributed-backend": "process-group backend (gloo here, nccl on GPUs)",
    "--distributed-timeout-minutes": "time-out", "--disable-gloo-process-groups": "process-group setup",
    "--transformer-impl": "kernel choice", "--attention-backend": "kernel choice", "--use-flash-attn": "kernel choice",
    "--use-mcore-models": "implementation", "--use-legacy-models": "implementation",
    "--no-gradient-accumulation-fusion": "kernel fusion", "--no-": "kernel fusion or a check turned off",
    "--cross-entropy-": "kernel fusion", "--use-flashinfer-fused-rope": "kernel fusion",
    "--deterministic-mode": "kernel determinism", "--te-rng-tracker": "random-number tracker",
    "--attention-softmax-in-fp32": "kernel numerics", "--apply-query-key-layer-scaling": "kernel numerics",
    "--norm-epsilon": "numerics only", "--rotary-base": "rope base: numerics only",
    "--rotary-interleaved": "rope layout: numerics only", "--ddp-average-in-collective": "numerics only",
    "--accumulate-allreduce-grads-in-fp32": "numerics only", "--calculate-per-token-loss": "loss normalization",
    "--attention-dropout": "dropout: parabench trains without it (estimate --activations table2 counts its masks)",
    "--hidden-dropout": "dropout: parabench trains without it (estimate --activations table2 counts its masks)",
    "--clip-grad": "gradient clipping: parabench never clips (its norm reduction is not modelled; issue 26)",
    "--overlap-grad-reduce": "timing only: the native engine always overlaps the dp reduction (issue 26)",
    "--overlap-param-gather": "timing only: no param-gather overlap here (issue 26)",
    "--overlap-p2p-communication": "timing only", "--tp-comm-overlap": "timing only: no TP comm overlap here",
    "--defer-embedding-wgrad-compute": "timing only", "--wgrad-deferral-limit": "timing only",
    "--delay-wgrad-compute": "timing only", "--microbatch-group-size-per-virtual-pipeline-stage": "timing only",
    "--ddp-num-buckets": "timing only: one bucket size here (bucket_mb)", "--ddp-pad-buckets": "timing only",
    "--cuda-graph": "CUDA graphs: launch overhead only", "--enable-cuda-graph": "CUDA graphs: launch overhead only",
    "--manual-gc": "host garbage collection", "--empty-unused-memory-level": "allocator setting",
    "--inference-": "inference only", "--prompts": "inference only", "--prompt-file": "inference only",
    "--num-tokens-to-generate": "inference only", "--temperature": "inference only", "--top_k": "inference only",
    "--top_p": "inference only", "--top-n-logprobs": "inference only", "--return-log-probs": "inference only",
    "--output-path": "inference only", "--incoming-requests-": "inference only", "--flash-decode": "inference only",
    "--enable-chunked-prefill": "inference only", "--termination-id": "inference only", "--stop-words": "inference only",
    "--use-legacy-static-engine": "inference only", "--output-every-n-results": "inference only",
    "--export-": "model export", "--test-mode": "test harness", "--profile": "profiling",
    "--loss-scale": "loss scale: parabench's fp16 uses a dynamic scaler", "--initial-loss-scale": "loss scale",
    "--deepspeed": "the DeepSpeed switch and its JSON (read with the JSON)",
    "--recompute-activations": "recompute (legacy spelling of --recompute-granularity selective)",
}
"""Dropped flags, by prefix, and why they leave the layout, the model and the step unchanged."""

TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "TikTokenizer": 131072}
"""Tokenizers whose size is fixed (GPT-2's BPE files; TikTokenizer's default vocab_size): others read a file."""
FUNCTIONAL_TEST_WORLD = 8
"""tests/test_utils/recipes/*/gpt.yaml: the functional tests run on 1 node × 8 GPUs unless a block says otherwise."""
DEFAULT_BUCKET_ELEMENTS = 40_000_000
"""Megatron-LM's DDP bucket: max(40M, 1M × dp) elements of fp32 main gradient."""


def parse_argv(argv: list[str]) -> list[tuple[str, object]]:
    """['--tp', '2', '--bf16'] → [('--tp', '2'), ('--bf16', True)]; a flag with several values → a list."""
    pairs: list[tuple[str, object]] = []
    for token in argv:
        if token.startswith("--"):
            key, eq, value = token.partition("=")
            pairs.append((flag_name(key), value if eq else True))
        elif pairs:
            key, value = pairs[-1]
            pairs[-1] = (key, token if value is True else [*([value] if isinstance(value, str) else value), token])
        else:
            pairs.append((token, True))  # a stray word: reported as an unknown key
    return pairs


def yaml_blocks(data: dict, source: str) -> list[tuple[str, list[tuple[str, object]], int | None]]:
    """The functional test's MODEL_ARGS blocks: (name, flag pairs, GPUS_PER_NODE of that block or None)."""
    names = [k for k, v in data.items() if k.startswith("MODEL_ARGS") and isinstance(v, dict)]
    if not names:
        raise SourceError(source, "MODEL_ARGS", "no MODEL_ARGS block (the functional tests' model_config.yaml holds one)")
    env = data.get("MODEL_ENV_VARS") or {}
    blocks = []
    for name in names:
        gpus = (env.get(name) or {}).get("GPUS_PER_NODE") if isinstance(env.get(name), dict) else None
        pairs = [(flag_name(str(k)), v) for k, v in data[name].items()]
        blocks.append((name if len(names) > 1 else "", pairs, gpus))
    return blocks


def read(pairs: list[tuple[str, object]], source: str, world_size: int | None = None, *, world_hint=None,
         world_why: str = "", label: str = "", framework: str = FRAMEWORK, backend: str = "native",
         model: dict | None = None) -> Imported:
    """One Megatron-LM argument list as an Imported config; `model` (an HF config's shape) fills what the
    arguments leave out, and a flag that disagrees with it is a conflict (the flag wins, as in Megatron-LM)."""
    imp = Imported(framework, source, label, model=dict(model or {}))
    args = _unique(pairs, imp)
    imp.values["backend"] = backend
    imp.on_gpus()
    for key, flag in MAPPED.items():
        _simple(imp, args, key, flag, source, model or {})
    _shape(imp, args, source)
    _layout(imp, args, source, world_size, world_hint, world_why)
    _batch(imp, args, source)
    _engine(imp, args, source)
    _vocab(imp, args, source)
    for key, value in args.items():
        if key not in MAPPED and key not in RULES:
            _leftover(imp, key, value)
    for name, value in (model or {}).items():
        if imp.model.get(name) != value:
            imp.conflict(f"model config: {name}", value, f"the arguments make it {imp.model.get(name)}")
    return imp


def _unique(pairs, imp: Imported) -> dict:
    args: dict = {}
    for key, value in pairs:
        if key in args and args[key] != value:
            imp.conflict(key, value, f"given twice ({args[key]!r}, then {value!r}); Megatron-LM takes the last")
        args[key] = value
    return args


def _number(value, key: str, source: str, kind=int):
    text = str(value)
    if "$" in text:
        raise SourceError(source, key, f"{text} cannot be expanded statically; give its value")
    try:
        number = kind(text)
    except ValueError:
        raise SourceError(source, key, f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    return number


def _simple(imp: Imported, args: dict, key: str, flag: Flag, source: str, hint: dict) -> None:
    if key not in args:
        if flag.target.removeprefix("model.") in hint:
            imp.defaulted(key, None, flag.target, imp.get(flag.target), "from the model config")
        elif flag.default is not None:
            imp.defaulted(key, flag.default, flag.target, flag.value(flag.default))
        return
    raw = args[key]
    if flag.convert is int:
        imp.mapped(key, raw, flag.target, _number(raw, key, source))
        return
    try:
        imp.mapped(key, raw, flag.target, flag.value(raw))
    except KeyError:
        imp.dropped(key, raw, f"not expressible: {key} {raw} (issue 26)", blocks=True)


def _required(imp: Imported, target: str, key: str, source: str):
    value = imp.get(target)
    if value is None:
        raise SourceError(source, key, "not given, and Megatron-LM requires it")
    return value


def _shape(imp: Imported, args: dict, source: str) -> None:
    hidden = _required(imp, "model.hidden", "--hidden-size", source)
    heads = _required(imp, "model.heads", "--num-attention-heads", source)
    _required(imp, "model.layers", "--num-layers", source)
    seq = _required(imp, "seq", "--seq-length", source)
    ffn = (imp.model["ffn_hidden"], "from the model config") if imp.model.get("ffn_hidden") else \
        _ffn_default(imp.model["activation"], hidden)
    _int(imp, args, "--ffn-hidden-size", "model.ffn_hidden", source, *ffn)
    positions = (imp.model["seq_len"], "from the model config") if imp.model.get("seq_len") else (seq, "the sequence length")
    _int(imp, args, "--max-position-embeddings", "model.seq_len", source, *positions)
    if args.get("--group-query-attention") is True:
        imp.add("--group-query-attention", True, "mapped", "model.kv_heads = --num-query-groups")
        _int(imp, args, "--num-query-groups", "model.kv_heads", source, 1, "Megatron-LM's default with --group-query-attention")
    else:
        imp.set("model.kv_heads", imp.model.get("kv_heads"))
        if "--num-query-groups" in args:
            imp.dropped("--num-query-groups", args["--num-query-groups"], "no effect without --group-query-attention")
    if "--kv-channels" in args:
        channels = _number(args["--kv-channels"], "--kv-channels", source)
        if channels * heads == hidden:
            imp.add("--kv-channels", channels, "mapped", "head_dim = hidden / heads (implied)")
        else:
            imp.dropped("--kv-channels", channels, f"not expressible: kv-channels {channels} ≠ hidden / heads = "
                        f"{hidden // heads} (a head_dim of its own; issue 26)", blocks=True)


def _ffn_default(activation: str, hidden: int) -> tuple[int, str]:
    """arguments.py: 4h, or with SwiGLU two thirds of it rounded down to a multiple of 64."""
    if activation == "swiglu":
        return int(4 * hidden * 2 / 3 / 64) * 64, "Megatron-LM's default with --swiglu: int(4h × 2/3 / 64) × 64"
    return 4 * hidden, "Megatron-LM's default: 4h"


def _int(imp: Imported, args, key: str, target: str, source: str, default, why: str) -> int:
    """An integer flag, or its default (computed from other flags: `why` says how)."""
    if key in args:
        imp.mapped(key, args[key], target, _number(args[key], key, source))
    else:
        imp.defaulted(key, default, target, default, why)
    return imp.get(target)


def _layout(imp: Imported, args, source, world_size, world_hint, world_why) -> None:
    tp, pp, cp = imp.values["tp"], imp.values["pp"], imp.values["cp"]
    parallel = tp * pp * cp
    if world_size is not None:
        world, key = world_size, "--world-size"
    elif world_hint is not None and int(world_hint) % parallel:
        world, key = parallel, "world size"
        imp.conflict("world size", int(world_hint), f"{world_why} gives {world_hint} GPUs for tp ({tp}) × cp ({cp}) × "
                     f"pp ({pp}) = {parallel}; dp = 1 is used (give --world-size N)")
    elif world_hint is not None:
        world, key = int(world_hint), "world size"
        imp.defaulted("world size", world, "world_size", world, world_why)
    else:
        world, key = parallel, "world size"
        imp.defaulted("world size", None, "world_size", world, "not in the source: dp = 1; give --world-size N")
    if world % parallel:
        raise SourceError(source, key, f"{world} is not divisible by tp ({tp}) × cp ({cp}) × pp ({pp}) = {parallel}")
    imp.set("dp", world // parallel)
    imp.set("world_size", world)
    _virtual_stages(imp, args, source)
    if args.get("--sequence-parallel") is True and tp == 1:
        imp.conflict("--sequence-parallel", True, "at tp 1: Megatron-LM ignores it (sequence_parallel = false)")
    elif "--sequence-parallel" in args:
        imp.mapped("--sequence-parallel", args["--sequence-parallel"], "sequence_parallel",
                   args["--sequence-parallel"] is True)
    _cp_comm(imp, args)


def _virtual_stages(imp: Imported, args, source) -> None:
    pp, layers = imp.values["pp"], imp.model["layers"]
    key = "--num-layers-per-virtual-pipeline-stage"
    if key in args:
        per = _number(args[key], key, source)
        if layers % (pp * per):
            raise SourceError(source, key, f"num-layers ({layers}) is not divisible by pp ({pp}) × {per}")
        imp.mapped(key, per, "virtual_stages", layers // (pp * per), f"layers / (pp × {per})")
    elif "--num-virtual-stages-per-pipeline-rank" in args:
        _int(imp, args, "--num-virtual-stages-per-pipeline-rank", "virtual_stages", source, 1, "")
    if imp.values.get("virtual_stages", 1) > 1:
        imp.set("schedule", "interleaved")


def _cp_comm(imp: Imported, args) -> None:
    key, kinds = "--cp-comm-type", {"p2p": "ring", "a2a": "ulysses"}
    kind = args.get(key, "p2p")
    kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
    if imp.values["cp"] == 1:
        if key in args:
            imp.dropped(key, kind, "no effect at cp 1")
    elif kind not in kinds:
        imp.dropped(key, kind, f"not expressible: cp-comm-type {kind} (ring is p2p, ulysses a2a; issue 26)", blocks=True)
    elif key in args:
        imp.mapped(key, kind, "cp_comm", kinds[kind])
    else:
        imp.defaulted(key, kind, "cp_comm", kinds[kind])


def _batch(imp: Imported, args, source) -> None:
    micro = _required(imp, "micro_batch", "--micro-batch-size", source)
    dp = imp.values["dp"]
    key, ramp = "--global-batch-size", args.get("--step-batch-size-schedule")
    if key in args:
        batch = _number(args[key], key, source)
        if ramp is not None:
            imp.conflict("--step-batch-size-schedule", ramp, "given with --global-batch-size, which Megatron-LM "
                         "rejects (arguments.py); the global batch is used")
    elif ramp is not None:
        key, batch = "--step-batch-size-schedule", _number(str(ramp).split()[-1].split(":")[-1], key, source)
    else:
        batch = micro * dp
    if batch % (micro * dp):
        raise SourceError(source, key, f"{batch} is not a multiple of micro-batch-size ({micro}) × dp ({dp}) = {micro * dp}")
    how = f"global batch {batch} / (micro-batch {micro} × dp {dp})"
    if key in args:
        imp.mapped(key, args[key], "micro_batches", batch // (micro * dp),
                   how + ("; the final batch of the ramp" if key != "--global-batch-size" else ""))
    else:
        imp.defaulted(key, batch, "micro_batches", 1, "Megatron-LM's default: micro-batch-size × dp")
    if "--rampup-batch-size" in args:
        imp.dropped("--rampup-batch-size", args["--rampup-batch-size"], "batch ramp: the final global batch is used")


def _engine(imp: Imported, args, source) -> None:
    bf16, fp16 = args.get("--bf16") is True, args.get("--fp16") is True
    if bf16 and fp16:
        imp.conflict("--fp16", True, "given with --bf16 (Megatron-LM refuses both); bf16 is used")
    if bf16 or fp16:
        imp.mapped("--bf16" if bf16 else "--fp16", True, "dtype", "bf16-mixed" if bf16 else "fp16-mixed")
    else:
        imp.defaulted("--bf16", False, "dtype", "fp32", "Megatron-LM's default: neither --bf16 nor --fp16")
    key = "--ddp-bucket-size"
    if key in args:
        elements = _number(args[key], key, source)
        imp.mapped(key, elements, "bucket_mb", elements * 4 / 2**20, "fp32 gradient elements × 4 B")
    else:
        elements = max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * imp.values["dp"])
        imp.defaulted(key, elements, "bucket_mb", elements * 4 / 2**20,
                      "Megatron-LM's default: max(40M, 1M × dp) fp32 gradient elements")
    _recompute(imp, args)


def _recompute(imp: Imported, args) -> None:
    granularity = args.get("--recompute-granularity")
    method, layers, modules = args.get("--recompute-method"), args.get("--recompute-num-layers", 1), args.get("--recompute-modules")
    rest = ("--recompute-method", "--recompute-num-layers", "--recompute-modules")
    if granularity is None:
        imp.defaulted("--recompute-granularity", None, "recompute", "none")
        for key in rest:
            if key in args:
                imp.dropped(key, args[key], "no effect without --recompute-granularity")
        return
    exact = ((granularity == "selective" and modules in (None, "core_attn", ["core_attn"]))
             or (granularity == "full" and method in (None, "uniform") and str(layers) == "1"))
    if exact:
        imp.mapped("--recompute-granularity", granularity, "recompute", granularity)
    else:
        what = (f"selective recompute of {modules}" if granularity == "selective"
                else f"full recompute by {method} blocks of {layers} layer(s)")
        imp.dropped("--recompute-granularity", granularity, f"not expressible: {what} (issue 26)", blocks=True)
        imp.set("recompute", "full" if granularity == "full" else "selective")
    for key in rest:
        if key in args:
            imp.add(key, args[key], "mapped", f"with --recompute-granularity {granularity}")


def _vocab(imp: Imported, args, source) -> None:
    tokenizer = args.get("--tokenizer-type") or ("GPT2BPETokenizer" if "--vocab-file" in args else None)
    if "--vocab-size" in args:
        size, origin = _number(args["--vocab-size"], "--vocab-size", source), "--vocab-size"
    elif tokenizer in TOKENIZER_VOCAB:
        size, origin = TOKENIZER_VOCAB[tokenizer], f"{tokenizer}'s {TOKENIZER_VOCAB[tokenizer]:,} tokens"
    elif imp.model.get("vocab"):
        size, origin = imp.model["vocab"], "the model config's vocab_size"
    else:
        imp.dropped("--tokenizer-type", tokenizer, f"vocab: the tokenizer ({tokenizer}) reads its size from a file; "
                    "give --model-config config.json (its vocab_size)", blocks=True)
        imp.set("model.vocab", None)
        return
    for key in ("--tokenizer-type", "--vocab-file"):
        if key in args:
            imp.add(key, args[key], "mapped", "model.vocab (its size)")
    divisor = _number(args.get("--make-vocab-size-divisible-by", 128), "--make-vocab-size-divisible-by", source)
    multiple = divisor * imp.values["tp"]
    padded = math.ceil(size / multiple) * multiple
    how = f"{origin} padded to a multiple of make-vocab-size-divisible-by {divisor} × tp {imp.values['tp']}"
    (imp.mapped if "--vocab-size" in args else imp.defaulted)("--vocab-size", size, "model.vocab", padded, how)
    if "--make-vocab-size-divisible-by" in args:
        imp.add("--make-vocab-size-divisible-by", divisor, "mapped", "model.vocab (its padding)")


def _leftover(imp: Imported, key: str, value) -> None:
    block = prefix_reason(key, BLOCKS)
    if block and not _neutral(key, value):
        imp.dropped(key, value, f"not expressible: {block} (issue 26)", blocks=True)
    elif block:
        imp.dropped(key, value, "no effect at this value")
    elif prefix_reason(key, NO_EFFECT):
        imp.dropped(key, value, f"no effect on the layout: {prefix_reason(key, NO_EFFECT)}")
    elif not key.startswith("--"):
        imp.dropped(key, value, "not a Megatron-LM flag: ignored")
    else:
        imp.dropped(key, value, "unknown to the importer: assumed not to change the layout or the math")


def _neutral(key: str, value) -> bool:
    if key not in NEUTRAL or value is True:
        return value is False
    try:
        return type(NEUTRAL[key])(value) == NEUTRAL[key]
    except (TypeError, ValueError):
        return False


# --- writing -------------------------------------------------------------------------------------------------

def export_args(cfg) -> list[str]:
    """The Megatron-LM arguments of `cfg` (backend native): importing them gives `cfg` back."""
    refuse = _export_reason(cfg)
    if refuse:
        raise SourceError("export --to megatron", "", refuse)
    return model_args(cfg)


def model_args(cfg, deepspeed: bool = False) -> list[str]:
    """The arguments of `cfg`'s layout, batch, shape and precision; for Megatron-DeepSpeed (`deepspeed`)
    without what its JSON holds (ZeRO, the buckets)."""
    m = cfg.model_config
    divisor = math.gcd(m.vocab // cfg.tp, 128)  # divisor × tp divides the vocab: no padding, the vocab stays exact
    args = ["--tensor-model-parallel-size", cfg.tp, "--pipeline-model-parallel-size", cfg.pp]
    if cfg.cp > 1:
        args += ["--context-parallel-size", cfg.cp, "--cp-comm-type", {"ring": "p2p", "ulysses": "a2a"}[cfg.cp_comm]]
    if cfg.order == "tp-pp-dp":
        args.append("--use-tp-pp-dp-mapping")
    if cfg.virtual_stages > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", m.layers // (cfg.pp * cfg.virtual_stages)]
    if cfg.sequence_parallel:
        args.append("--sequence-parallel")
    if cfg.zero == 1 and not deepspeed:
        args.append("--use-distributed-optimizer")
    args += ["--micro-batch-size", cfg.micro_batch, "--global-batch-size", cfg.global_batch, "--seq-length", cfg.seq,
             "--num-layers", m.layers, "--hidden-size", m.hidden, "--num-attention-heads", m.heads,
             "--ffn-hidden-size", m.ffn_hidden, "--max-position-embeddings", m.seq_len]
    if m.kv_heads is not None:
        args += ["--group-query-attention", "--num-query-groups", m.kv_heads]
    args += ["--normalization", {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[m.norm],
             "--position-embedding-type", {"learned": "learned_absolute", "rope": "rope"}[m.position]]
    args += [flag for flag, on in (("--swiglu", m.activation == "swiglu"), ("--disable-bias-linear", not m.bias),
                                   ("--untie-embeddings-and-output-weights", not m.tie_embeddings)) if on]
    args += ["--tokenizer-type", "NullTokenizer", "--vocab-size", m.vocab, "--make-vocab-size-divisible-by", divisor]
    args += {"bf16-mixed": ["--bf16"], "fp16-mixed": ["--fp16"], "fp32": []}[cfg.dtype]
    args += {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]}[cfg.recompute]
    if not deepspeed:
        args += ["--ddp-bucket-size", int(cfg.bucket_mb * 2**20 / 4)]
    return [str(a) for a in args]


def _export_reason(cfg) -> str | None:
    if cfg.backend != "native":
        return f"backend {cfg.backend}: Megatron-LM runs what the native engine runs; export backend native configs"
    if cfg.schedule == "gpipe" and cfg.pp > 1:
        return "schedule gpipe: Megatron-LM has 1F1B and interleaved 1F1B only"
    if cfg.schedule == "interleaved" and cfg.virtual_stages == 1 and cfg.pp > 1:
        return "schedule interleaved with virtual_stages 1 is 1F1B in Megatron-LM; set schedule 1f1b or virtual_stages > 1"
    if (cfg.bucket_mb * 2**20 / 4) % 1:
        return f"bucket_mb {cfg.bucket_mb:g} is not a whole number of fp32 elements (--ddp-bucket-size)"
    return None


def export_text(cfg) -> str:
    """A launch script's argument array for `cfg`, with the torchrun line that runs it."""
    import shlex
    args = export_args(cfg)
    lines, i = [], 0
    while i < len(args):  # one flag and its value per line
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append("    " + " ".join(shlex.quote(a) for a in args[i:j]))
        i = j
    return (f"# parabench run {cfg.run_id}: world size {cfg.world} (tp {cfg.tp} × cp {cfg.cp} × pp {cfg.pp} × dp {cfg.dp}), "
            f"order {cfg.order}\nMEGATRON_ARGS=(\n" + "\n".join(lines) + "\n)\n"
            f"torchrun --nproc_per_node {cfg.world} pretrain_gpt.py ${{MEGATRON_ARGS[@]}}\n")
