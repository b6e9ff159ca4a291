"""The planner: every valid parallel config for a model, cluster and batch, ranked by predicted
throughput.

Enumerated: tp (dividing kv heads, ffn, vocab and the GPU count), pp (dividing what is left, ≤ layers),
dp = gpus / (tp·pp) dividing the global batch; the micro-batch size b (m = B / (dp·b)); the
schedule (gpipe, 1f1b, interleaved with every v that divides the layers); the model-state sharding
(native ZeRO 0/1, DeepSpeed ZeRO 2/3, FSDP full/grad-op/hybrid); sequence parallel; recomputation;
the rank order (only when it changes which groups cross nodes). Each candidate is checked by
RunConfig's own validator (cached per combination of the fields the validator reads), then by
memory, then timed by `bench.analysis.estimate`. Candidates the model predicts identically under
two backends are kept once (native first).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, fields

from bench.analysis.estimate import Shape, crosses_nodes, extreme_stages, memory, predict_time
from bench.analysis.stage_plan import stage_plan
from bench.analysis.hardware import Hardware, get_hardware
from models.config import get_preset

# (backend, zero, fsdp) in order of preference; the cost model tells these apart by what they shard
SHARDINGS = (("native", 0, None), ("native", 1, None), ("deepspeed", 0, None), ("deepspeed", 1, None),
             ("deepspeed", 2, None), ("deepspeed", 3, None), ("fsdp", 0, "grad-op"), ("fsdp", 0, "full"),
             ("fsdp", 0, "hybrid"))
RECOMPUTE = ("none", "selective", "full")
MAX_MICRO_BATCH = 16
MAX_VIRTUAL = 8


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Plan:
    configs: list[dict]  # best first: RunConfig fields + predicted figures
    considered: int
    valid: int
    fitting: int
    dropped: Counter  # reason → count


def _validation_key(s: Shape) -> tuple:
    """The fields RunConfig's validator reads: every field but the micro-batch size, with dp and
    micro_batches only through the comparisons the checks make (dp ≥ 2; m vs pp)."""
    return (s.backend, s.tp, s.pp, s.dp >= 2, s.zero, s.fsdp, s.schedule, s.virtual_stages, s.order,
            s.micro_batches % s.pp == 0, s.micro_batches >= s.pp, s.sequence_parallel, s.recompute, s.dtype, s.seq)


ENGINES = ("suite", "any")
"""suite: what this suite's backends can run (RunConfig's whole validator); any: what a complete
engine such as Megatron-LM could run (RunConfig's layout and model checks, no backend checks)."""


def structural_reason(s) -> str | None:
    """RunConfig's own layout/model/pipeline checks without the backend support checks."""
    from bench.config import ConfigError, _validate_model_fit, _validate_pipeline
    try:
        _validate_model_fit(s)
        _validate_pipeline(s)
    except ConfigError as e:
        return str(e)
    return None


class _Validator:
    def __init__(self, engines: str = "suite"):
        if engines not in ENGINES:
            raise ValueError(f"engines is {engines!r}; choose one of {', '.join(ENGINES)}")
        self.engines, self.cache = engines, {}

    def __call__(self, s: Shape) -> str | None:
        key = _validation_key(s)
        if key not in self.cache:
            self.cache[key] = structural_reason(s) if self.engines == "any" else _run_config_reason(s)
        return self.cache[key]


def _run_config_reason(s: Shape) -> str | None:
    from bench.config import ConfigError, RunConfig
    try:
        RunConfig(**{f.name: getattr(s, f.name) for f in fields(Shape)})
    except ConfigError as e:
        return str(e)
    return None


def _sharding_what(backend: str, zero: int, fsdp: str | None) -> str:
    if backend == "fsdp":
        return {"grad-op": "grads", "full": "params", "hybrid": "hybrid"}[fsdp]
    return ("none", "optimizer", "grads", "params")[zero]


def candidates(model: str, gpus: int, global_batch: int, seq: int, dtype: str, gpus_per_node: int):
    """Every Shape to consider (before validation), with a few structural skips counted by the caller."""
    m = get_preset(model)
    for tp in divisors(gpus):
        if m.num_kv_heads % tp or m.ffn_hidden % tp or m.vocab % tp:  # kv_heads divides heads
            continue
        for pp in divisors(gpus // tp):
            if pp > m.layers:
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                yield None, "global batch not divisible by dp"
                continue
            orders = ["tp-pp-dp"]
            if any(crosses_nodes(tp, pp, dp, "tp-pp-dp", gpus_per_node, d) !=
                   crosses_nodes(tp, pp, dp, "tp-dp-pp", gpus_per_node, d) for d in ("pp", "dp")):
                orders.append("tp-dp-pp")
            for b in divisors(global_batch // dp):
                if b > MAX_MICRO_BATCH:
                    break
                mb = global_batch // (dp * b)
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules += [("gpipe", 1)] + [("interleaved", v) for v in divisors(m.layers // pp)
                                                   if 1 < v <= MAX_VIRTUAL and m.layers % (pp * v) == 0]
                for schedule, v in schedules:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for backend, zero, fsdp in SHARDINGS:
                            for recompute in RECOMPUTE:
                                for order in orders:
                                    yield Shape(model=model, tp=tp, pp=pp, dp=dp, backend=backend, order=order,
                                                zero=zero, fsdp=fsdp, schedule=schedule, virtual_stages=v,
                                                micro_batch=b, micro_batches=mb, seq=seq, dtype=dtype,
                                                sequence_parallel=sp, recompute=recompute), None


def plan(model: str, gpus: int, gpus_per_node: int, hardware: str | Hardware, global_batch: int,
         seq: int | None = None, top: int = 5, dtype: str = "bf16-mixed", mixed_state: str = "zero",
         activations: str = "table2", memory_fraction: float = 0.9, engines: str = "suite") -> Plan:
    """Rank every valid config by predicted tokens/s. A config fits when its per-rank total is at
    most `memory_fraction` of the device memory (the rest: CUDA context, allocator, workspaces).
    `engines`: see ENGINES (with "any", backend names only label the sharding: native = ZeRO 0/1,
    deepspeed = ZeRO 2/3, fsdp = FSDP2 modes)."""
    hw = get_hardware(hardware)
    cfg_model = get_preset(model)
    seq = seq or cfg_model.seq_len
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("global_batch", global_batch),
                        ("seq", seq), ("top", top)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    limit = hw.memory_bytes * memory_fraction
    validate, dropped, seen = _Validator(engines), Counter(), set()
    considered = valid = 0
    results = []
    for shape, skip in candidates(model, gpus, global_batch, seq, dtype, gpus_per_node):
        considered += 1
        if skip:
            dropped[skip] += 1
            continue
        reason = validate(shape)
        if reason:
            dropped["invalid: " + re.sub(r"\b\d+\b", "N", reason)] += 1
            continue
        key = (shape.tp, shape.pp, shape.schedule, shape.virtual_stages, shape.micro_batch, shape.sequence_parallel,
               shape.recompute, shape.order, _sharding_what(shape.backend, shape.zero, shape.fsdp))
        if key in seen:
            dropped["duplicate of an equivalent config on another backend"] += 1
            continue
        seen.add(key)
        valid += 1
        stages = stage_plan(shape, gpus_per_node, extreme_stages(shape.pp))
        mem = memory(stages, mixed_state, activations)
        if mem["total_bytes"] > limit:
            parts = {k: mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")}
            dropped[f"out of memory (> {memory_fraction:.0%} of {hw.memory_bytes / 2**30:.0f} GiB; "
                    f"largest part: {max(parts, key=parts.get).removesuffix('_bytes')})"] += 1
            continue
        time = predict_time(stages, hw, mixed_state)
        results.append((shape, mem, time))
    results.sort(key=lambda r: (-round(r[2]["tokens_per_s"], 3), r[1]["total_bytes"]))  # ties: less memory
    return Plan([_row(*r) for r in results[:top]], considered, valid, len(results), dropped)


def _row(shape: Shape, mem: dict, time: dict) -> dict:
    row = {f.name: getattr(shape, f.name) for f in fields(Shape) if f.name != "model_overrides"}
    row["global_batch"] = shape.global_batch
    row.update({k: mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
                                     "transient_bytes", "total_bytes")})
    row.update({k: v for k, v in time.items()})
    return row


def describe(row: dict) -> str:
    """One line naming a planned config in the CLI's vocabulary."""
    parts = [f"tp={row['tp']} pp={row['pp']} dp={row['dp']}", f"--backend {row['backend']}"]
    if row["backend"] == "fsdp":
        parts.append(f"--fsdp {row['fsdp']}")
    elif row["zero"]:
        parts.append(f"--zero {row['zero']}")
    if row["pp"] > 1:
        parts.append(f"--schedule {row['schedule']}" + (f" --virtual-stages {row['virtual_stages']}"
                                                       if row["virtual_stages"] > 1 else ""))
    parts.append(f"--micro-batch {row['micro_batch']} --micro-batches {row['micro_batches']}")
    if row["sequence_parallel"]:
        parts.append("--sequence-parallel")
    if row["recompute"] != "none":
        parts.append(f"--recompute {row['recompute']}")
    if row["order"] != "tp-pp-dp":
        parts.append(f"--order {row['order']}")
    return " ".join(parts)
