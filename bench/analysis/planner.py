"""The planner: every valid parallel config for a model, cluster and batch, ranked by predicted
throughput.

Enumerated: tp (dividing kv heads, ffn, vocab and the GPU count), cp (context parallel, dividing what is
left, for long sequences only: `context_sizes`), pp (dividing what is left, ≤ layers), dp = gpus /
(tp·cp·pp) dividing the global batch; for a mixture-of-experts model ep (dividing dp·cp and the experts:
`expert_sizes`); the micro-batch size b (m = B / (dp·b)); the
schedule (gpipe, 1f1b, interleaved with every v that divides the layers); the model-state sharding
(native ZeRO 0/1, DeepSpeed ZeRO 2/3, FSDP full/grad-op/hybrid); sequence parallel; recomputation;
the rank order (only when it changes which groups cross nodes). Each candidate is checked by
RunConfig's two validation layers (each cached on the fields it reads), then by
memory (one point's candidates share their stage plans and memory where the fields those read agree:
`_PointCosts`), then timed by `bench.analysis.estimate` if a lower bound of its step time can still
reach the top (`_best`). Candidates the model predicts identically under two backends are kept once
(native first).
"""
from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache

from bench.analysis.comm import tp_traffic
from bench.analysis.estimate import (CANDIDATE_FIELDS, DEFAULT_ATTENTION, conventions, crosses_nodes, extreme_stages,
                                     link, memory, predict_time, time_impl)
from bench.analysis.hardware import Hardware, format_bytes, get_hardware
from bench.analysis.stage_plan import StagePlan, stage_plan
from bench.analysis.time_model import collectives_time, step_time_floor
from bench.capabilities import CAPABILITIES, ZERO_SHARDS
from bench.config import ConfigError, RunConfig, check_number, structural_reason
from models.config import get_preset

# (backend, zero, fsdp) in order of preference; the cost model tells these apart by what they shard
SHARDINGS = (("native", 0, None), ("native", 1, None), ("deepspeed", 0, None), ("deepspeed", 1, None),
             ("deepspeed", 2, None), ("deepspeed", 3, None), ("fsdp", 0, "grad-op"), ("fsdp", 0, "full"),
             ("fsdp", 0, "hybrid"))
RECOMPUTE = ("none", "selective", "full")
MAX_MICRO_BATCH = 16
MAX_VIRTUAL = 8
CP_MIN_SEQ = 8192
"""Context parallel is searched from this sequence length on: the published runs that use it start there
(NeMo's and Megatron-Bridge's Llama 3 recipes at 8,192, Llama 3's long-context stage at 131,072;
NOTES-cp §3), and below it tp and dp split the work with less traffic."""
CP_MIN_TOKENS = 1024
"""The fewest tokens of a sequence a cp rank keeps (seq / cp): below ~1k a ring step's attention is too
short to hide its K/V pass even over NVLink for MHA (NOTES-cp §2: s/cp ≥ ≈2.2k), and the step is all
ring latency."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Plan:
    configs: list[dict]  # best first: RunConfig fields + predicted figures
    considered: int
    valid: int
    fitting: int
    dropped: Counter  # reason → count


ENGINES = ("suite", "any")
"""suite: what this suite's backends can run (RunConfig's whole validator); any: what a complete
engine such as Megatron-LM could run (RunConfig's layout and model checks, no backend checks)."""


def _structure_key(s: RunConfig) -> tuple:
    """What `structural_reason` reads (model fixed): the layout, the schedule, micro-batches only
    as a multiple of pp."""
    return (s.tp, s.cp, s.cp_comm, s.ep, s.pp, s.virtual_stages, s.schedule, s.sequence_parallel, s.seq,
            s.micro_batches % s.pp == 0)


def _support_facts(s: RunConfig) -> tuple:
    """What `bench.capabilities.unsupported_reason` reads of a point besides the backend options
    (model fixed): the sizes only through the comparisons its rules make."""
    return (s.dtype, s.sequence_parallel, s.schedule, s.tp > 1, s.pp > 1, s.virtual_stages > 1,
            s.micro_batches < s.pp, s.dp >= 2, s.cp, s.tp * s.cp, s.seq // s.cp, s.ep > 1)  # cp's rules: heads ÷ tp·cp


class _Validator:
    """The two validation layers, each cached on what it reads: tens of thousands of candidates
    share a few hundred answers (tests/test_analysis.py checks the keys against the uncached validator).
    Candidates are validated on `device` (the planner's hardware: cuda, or cpu for the cpu profile)."""

    def __init__(self, engines: str = "suite", device: str = "cuda"):
        if engines not in ENGINES:
            raise ValueError(f"engines is {engines!r}; choose one of {', '.join(ENGINES)}")
        self.engines, self.device, self.structures, self.supports = engines, device, {}, {}

    def structure(self, point: RunConfig) -> str | None:
        key = _structure_key(point)
        if key not in self.structures:
            self.structures[key] = structural_reason(point)
        return self.structures[key]

    def support(self, point: RunConfig, options: dict, facts: tuple) -> str | None:
        """`options`: the backend, zero, fsdp and recompute fields that complete the point;
        `facts`: `_support_facts(point)`, computed once per point."""
        if self.engines == "any":
            return None
        key = (*options.values(), *facts)
        if key not in self.supports:
            self.supports[key] = run_config_reason(RunConfig.unchecked(**{**_fields(point), **options}), self.device)
        return self.supports[key]

    def cp_comm(self, point: RunConfig) -> str | None:
        """The context-parallel algorithm of a point's candidates: each backend's own (None: RunConfig's
        default for it) or, for any engine, Megatron's ring (`--cp-comm-type p2p`, its default)."""
        return None if point.cp == 1 or self.engines == "suite" else "ring"

    def __call__(self, s: RunConfig) -> str | None:
        options = {k: getattr(s, k) for k in ("backend", "zero", "fsdp", "recompute", "cp_comm")}
        return self.structure(s) or self.support(s, options, _support_facts(s))


def run_config_reason(s: RunConfig, device: str = "cuda") -> str | None:
    """RunConfig's whole verdict on a candidate (uncached)."""
    try:
        RunConfig(**_fields(s), device=device)
    except ConfigError as e:
        return str(e)
    return None


@lru_cache(maxsize=None)
def _reason_class(reason: str) -> str:
    """Reasons differ only in their numbers between candidates; count them as one class."""
    return "invalid: " + re.sub(r"\b\d+\b", "N", reason)


def _sharding_what(zero: int, fsdp: str | None) -> str:
    if fsdp is not None:  # only an engine sharded by FSDP modes has one
        return {"grad-op": "grads", "full": "params", "hybrid": "hybrid"}[fsdp]
    return ZERO_SHARDS[zero]


def context_sizes(seq: int, n: int) -> list[int]:
    """The cp sizes searched for `seq` over n GPUs: 1, and from CP_MIN_SEQ on every divisor of n that
    splits the sequence into 2·cp equal chunks (zig-zag) of at least CP_MIN_TOKENS tokens a rank."""
    if seq < CP_MIN_SEQ:
        return [1]
    return [c for c in divisors(n) if c == 1 or (seq % (2 * c) == 0 and seq // c >= CP_MIN_TOKENS)]


def expert_sizes(experts: int, data_ranks: int) -> list[int]:
    """The ep sizes searched: 1 for a dense model, else every divisor of the dp·cp ranks that divides the
    experts (each ep rank holds whole experts)."""
    return [e for e in divisors(data_ranks) if experts % e == 0] if experts else [1]


def points(model: str, gpus: int, global_batch: int, seq: int, dtype: str, gpus_per_node: int):
    """Every layout × micro-batch size × schedule × sequence parallel, as an unchecked RunConfig with the default
    backend options, with the rank orders worth comparing; (None, (), reason) for a layout whose dp
    does not divide the global batch."""
    m = get_preset(model)
    for tp in divisors(gpus):
        if m.num_kv_heads % tp or m.ffn_hidden % tp or m.vocab % tp:  # kv_heads divides heads
            continue
        for cp, pp in ((cp, pp) for cp in context_sizes(seq, gpus // tp) for pp in divisors(gpus // (tp * cp))):
            if pp > m.layers:
                continue
            dp = gpus // (tp * cp * pp)
            if global_batch % dp:
                yield None, (), "global batch not divisible by dp"
                continue
            orders = ("tp-pp-dp",)
            inner = tp * cp  # cp sits next to tp in either order (bench.layout)
            if any(crosses_nodes(inner, pp, dp, "tp-pp-dp", gpus_per_node, d) !=
                   crosses_nodes(inner, pp, dp, "tp-dp-pp", gpus_per_node, d) for d in ("pp", "dp")):
                orders += ("tp-dp-pp",)
            for b in divisors(global_batch // dp):
                if b > MAX_MICRO_BATCH:
                    break
                mb = global_batch // (dp * b)
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules += [("gpipe", 1)] + [("interleaved", v) for v in divisors(m.layers // pp)
                                                   if 1 < v <= MAX_VIRTUAL and m.layers % (pp * v) == 0]
                for schedule, v in schedules:
                    for sp, ep in ((sp, ep) for sp in ((False, True) if tp > 1 else (False,))
                                   for ep in expert_sizes(m.experts, dp * cp)):
                        yield RunConfig.unchecked(model=model, tp=tp, cp=cp, ep=ep, pp=pp, dp=dp, schedule=schedule,
                                                  virtual_stages=v, micro_batch=b, micro_batches=mb, seq=seq,
                                                  dtype=dtype, sequence_parallel=sp), orders, None


def _valid_shapes(point: RunConfig, orders: tuple, validate: _Validator, dropped: Counter):
    """The distinct candidates of one point (sharding × recomputation × rank order) that pass validation;
    each refused candidate is counted under its reason. Validity does not depend on the rank order,
    so each answer counts for every order. Candidates the model predicts identically under two backends
    (same layout, schedule, micro-batch, recomputation, order and what is sharded) are kept once, native
    first; the fields that tell them apart all belong to the point, so duplicates are sought within it."""
    reason = validate.structure(point)
    if reason:
        dropped[_reason_class(reason)] += len(SHARDINGS) * len(RECOMPUTE) * len(orders)
        return
    facts, fields_, seen = _support_facts(point), _fields(point), set()
    cp_comm = validate.cp_comm(point)
    for backend, zero, fsdp in SHARDINGS:
        what = _sharding_what(zero, fsdp)
        for recompute in RECOMPUTE:
            options = {"backend": backend, "zero": zero, "fsdp": fsdp, "recompute": recompute, "cp_comm": cp_comm}
            reason = validate.support(point, options, facts)
            if reason:
                dropped[_reason_class(reason)] += len(orders)
                continue
            for order in orders:
                # backends running different cp algorithms are not duplicates
                comm = cp_comm or (None if point.cp == 1 else CAPABILITIES[backend].cp_comms[0])
                if (recompute, order, what, comm) in seen:
                    dropped["duplicate of an equivalent config on another backend"] += 1
                    continue
                seen.add((recompute, order, what, comm))
                yield _candidate(fields_, options, order)


def _candidate(point_fields: dict, options: dict, order: str) -> RunConfig:
    """The one place candidates are built: a point's fields (`_fields`) with the backend options and the
    rank order, an unchecked RunConfig (validity is asked once per point and options: `_Validator`)."""
    return RunConfig.unchecked(**{**point_fields, **options, "order": order})


def _fields(point: RunConfig) -> dict:
    return {name: getattr(point, name) for name in CANDIDATE_FIELDS}


class _PointCosts:
    """The stage plans and memory of one point's candidates, each worked out once for the candidates that
    differ only in fields it does not read (tests/test_planner.py checks both against the uncached
    functions): `stage_plan` reads neither the recomputation nor, but for FSDP hybrid's shard groups, the
    rank order; `memory` reads the rank order only through the plan's sharding."""

    def __init__(self, gpus_per_node: int, mixed_state: str, activations: str, attention: str):
        self.gpus_per_node, self.mixed_state, self.activations = gpus_per_node, mixed_state, activations
        self.attention = attention
        self.plans, self.memories = {}, {}

    def plan(self, s: RunConfig) -> StagePlan:
        key = (s.backend, s.zero, s.fsdp, s.order)
        base = self.plans.get(key)
        if base is None:
            base = self.plans[key] = stage_plan(s, self.gpus_per_node, extreme_stages(s.pp))
            return base
        return replace(base, cfg=s)

    def memory(self, stages: StagePlan) -> dict:
        s = stages.cfg
        key = (s.backend, s.zero, s.fsdp, s.recompute, stages.sharding, stages.shard)
        if key not in self.memories:
            self.memories[key] = memory(stages, self.mixed_state, self.activations, self.attention)
        return self.memories[key]


def plan(model: str, gpus: int, gpus_per_node: int, hardware: str | Hardware, global_batch: int,
         seq: int | None = None, top: int = 5, dtype: str = "bf16-mixed", mixed_state: str | None = None,
         activations: str | None = None, memory_fraction: float = 0.9, engines: str = "suite",
         attention: str | None = None) -> Plan:
    """Rank every valid config by predicted tokens/s (the attention kernel: DEFAULT_ATTENTION unless given). A config fits when its per-rank total is at
    most `memory_fraction` of the device memory (the rest: CUDA context, allocator, workspaces).
    `engines`: see ENGINES (with "any", backend names only label the sharding: native = ZeRO 0/1,
    deepspeed = ZeRO 2/3, fsdp = FSDP2 modes)."""
    hw = get_hardware(hardware)
    attention = attention or DEFAULT_ATTENTION
    cfg_model = get_preset(model)
    seq = seq or cfg_model.seq_len
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("global_batch", global_batch),
                        ("seq", seq), ("top", top)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    reason = check_number("memory_fraction", memory_fraction, False, (0, 1.0, True))
    if reason:
        raise ValueError(reason)
    limit = hw.memory_bytes * memory_fraction
    validate = _Validator(engines, "cpu" if hw.name == "cpu" else "cuda")
    dropped, fits = Counter(), []
    considered = valid = 0
    out_of_memory = f"out of memory (> {memory_fraction:.0%} of {hw.memory_bytes / 2**30:.0f} GiB; largest part: "
    for point, orders, skip in points(model, gpus, global_batch, seq, dtype, gpus_per_node):
        if skip:
            considered += 1
            dropped[skip] += 1
            continue
        considered += len(SHARDINGS) * len(RECOMPUTE) * len(orders)
        costs = _PointCosts(gpus_per_node, mixed_state, activations, attention)
        for shape in _valid_shapes(point, orders, validate, dropped):
            valid += 1
            stages = costs.plan(shape)
            mem = costs.memory(stages)
            if mem["total_bytes"] > limit:
                dropped[f"{out_of_memory}{_largest_part(mem)})"] += 1
                continue
            fits.append((stages, mem))
    best = _best(fits, hw, mixed_state, time_impl(activations), top, attention)
    return Plan([_row(p.cfg, mem, time) for _, p, mem, time in best], considered, valid, len(fits), dropped)


def _largest_part(mem: dict) -> str:
    parts = {k: mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")}
    return max(parts, key=parts.get).removesuffix("_bytes")


def _rank_key(tokens_per_s: float, mem: dict, i: int) -> tuple:
    """Best first: predicted tokens/s (to 3 decimals), then less memory, then enumeration order."""
    return -round(tokens_per_s, 3), mem["total_bytes"], i


def _best(fits: list, hw: Hardware, mixed_state: str | None, impl: str, top: int, attention: str) -> list[tuple]:
    """`impl` and `attention`: the time model's kernels (`time_impl`) and attention kernel, given to the
    bounds and the timing alike, or a bound could exceed the time it bounds (a fused attention computes
    less than an unfused one).
    The `top` best of the fitting candidates by `_rank_key`, as (key, plan, memory, time), timing only
    what can reach them. A bound's key is never worse than its candidate's (`_step_floor` is never above
    the step time): candidates are visited best compute bound first, the search stops at the first one
    worse than the top's last, and a candidate is skipped when its bound with the tp collectives is
    (keys are distinct: they end in the candidate's index)."""
    def key(i: int, seconds: float) -> tuple:
        plan, mem = fits[i]
        return _rank_key(plan.cfg.tokens_per_step / seconds if seconds > 0 else float("inf"), mem, i)

    best: list[tuple] = []
    floors = [_step_floor(plan, hw, impl, attention) for plan, _ in fits]
    for bound, i in sorted((key(i, floors[i]), i) for i in range(len(fits))):
        if len(best) >= top and bound > best[top - 1][0]:
            break
        plan, mem = fits[i]
        with_tp = _step_floor(plan, hw, impl, attention, _tp_floor(plan, hw, mixed_state)) if len(best) >= top else 0.0
        if len(best) >= top and key(i, with_tp) > best[top - 1][0]:
            continue
        time = predict_time(plan, hw, mixed_state, impl, attention)
        bisect.insort(best, (_rank_key(time["tokens_per_s"], mem, i), plan, mem, time), key=lambda r: r[0])
        del best[top:]
    return best


def _step_floor(plan: StagePlan, hw: Hardware, impl: str, attention: str, tp_s: float = 0.0) -> float:
    """A lower bound of the step time under `impl`: the busiest planned rank's micro-batch compute
    (`step_time_floor`) plus `tp_s`, at most any planned rank's tp collectives (`_tp_floor`:
    `step_terms` adds each rank's to its busy time), with the bubble over both bounded below by
    `bubble_floor` instead of simulated (no schedule is simulated for a candidate that cannot reach the
    top: the simulations were most of the planner's ranking time). The busiest rank's compute and tp
    are at least the compute of the busiest and the fewest tp seconds of any."""
    return (step_time_floor(plan, hw, impl, attention) + tp_s * (1 - 1e-9)) * (1 + bubble_floor(plan))


def _tp_floor(plan: StagePlan, hw: Hardware, mixed_state: str | None) -> float:
    """The fewest seconds of per-micro-batch tp collectives of any planned rank, from its own tp traffic
    (`comm.tp_traffic`, part of the traffic `time_model.stage_time` puts on the critical path) over the
    links `predict_time` gives the tp group, under the state convention `predict_time` resolves
    (`conventions`: the given one, else the backend's own)."""
    cfg, g = plan.cfg, plan.gpus_per_node or hw.gpus_per_node
    links, state = {"tp": link(cfg, hw, "tp", g)[:2]}, conventions(cfg, mixed_state)[0]
    return min(collectives_time([tr for tr in tp_traffic(plan, stage, state)
                                 if tr.per == "micro-batch" and tr.dim == "tp"], hw, links, cfg.world)
               for stage in plan.ranks)


def bubble_floor(plan: StagePlan) -> float:
    """A lower bound of `plan.step.bubble_over_ideal` (the simulated schedule's idle / busy time) from
    its sizes alone: (p − 1)/(m·v), PTD-P's bubble. Why it holds for every schedule simulated
    (`bench.schedule.simulate`, forward F and backward B per chunk action): every rank runs m·v of each,
    so all are busy alike, W = m·v·(F + B). Rank r's first action is the forward of global chunk r for
    micro-batch 0, which waits for chunks 0 … r−1 (r·F), and its last the backward of chunk r, which
    chunks r−1 … 0 follow on other ranks (r·B); so the step lasts at least W + r·(F + B) for every r,
    each rank idles at least (p − 1)·(F + B), and idle / busy ≥ p·(p − 1)·(F + B) / (p·W). The
    extrapolation beyond 3p micro-batches (`schedule_step`) keeps the idle time of 2p and scales the
    busy time, so the bound holds there too (tests/test_planner.py checks it against the simulator)."""
    c = plan.cfg
    v = c.virtual_stages if plan.schedule == "interleaved" and c.pp > 1 else 1
    return (c.pp - 1) / (c.micro_batches * v)


def _row(shape: RunConfig, mem: dict, time: dict) -> dict:
    row = {name: getattr(shape, name) for name in CANDIDATE_FIELDS if name != "model_overrides"}
    row["global_batch"] = shape.global_batch
    row.update({k: mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
                                     "transient_bytes", "total_bytes")})
    row.update({k: v for k, v in time.items()})
    return row


def describe(row: dict) -> str:
    """One line naming a planned config in the CLI's vocabulary."""
    cp = f" cp={row['cp']}" if row["cp"] > 1 else ""
    ep = f" ep={row['ep']}" if row["ep"] > 1 else ""
    parts = [f"tp={row['tp']}{cp} pp={row['pp']} dp={row['dp']}{ep}", f"--backend {row['backend']}"]
    if row["cp"] > 1:
        parts.append(f"--cp-comm {row['cp_comm']}")
    if row["fsdp"] is not None:  # an engine sharded by FSDP modes
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


# --- the plan as a sweep file (`bench plan --emit-sweep FILE`) -------------------------------------------

SWEEP_FIELDS = tuple(name for name in CANDIDATE_FIELDS if name not in ("model", "model_overrides"))


def plan_device(hardware: str | Hardware) -> str:
    """The device the plan's configs run on (and were validated for): cpu for the cpu profile."""
    return "cpu" if get_hardware(hardware).name == "cpu" else "cuda"


def sweep_text(result: Plan, model: str, gpus: int, gpus_per_node: int, hardware: str, global_batch: int,
               command: str, when: str) -> str:
    """The top configs of `result` as a sweep file (bench/sweep/spec.py): the values they share in
    `base`, the rest one entry of `runs` each (best first, its prediction in a comment), so the
    sweep expands to exactly these configs."""
    import yaml
    device = plan_device(hardware)
    rows = [{**{k: row[k] for k in SWEEP_FIELDS if row[k] is not None and not (k in ("cp", "ep") and row[k] == 1)},
             "device": device} for row in result.configs]  # cp, ep = 1: a plan without them reads as before
    shared = {k: v for k, v in rows[0].items() if all(r.get(k) == v for r in rows)} if len(rows) > 1 else {}
    hw = get_hardware(hardware)
    lines = [f"# written by `{command}` on {when}",
             (f"# model {model}, {gpus} GPUs ({gpus_per_node} per node), hardware {hw.name}, global batch "
              f"{global_batch}: the top {len(rows)} of {result.fitting:,} fitting configs by predicted tokens/s"),
             "# run it on the cluster the plan was made for: bench sweep THIS_FILE --launcher slurm [--profile NAME];",
             "# its --dry-run predicts each run as its row will (the backend's own state and activation conventions)",
             f"name: plan-{model}-{gpus}",
             f"model: {model}",
             "base: " + _flow(yaml, shared),
             "runs:"]
    for i, (row, full) in enumerate(zip(rows, result.configs), 1):
        own = {k: v for k, v in row.items() if k not in shared}
        lines.append(f"  - {_flow(yaml, own)}"
                     f"   # {i}. predicted {full['tokens_per_s']:,.0f} tokens/s, step {full['step_time_s']:.4g} s, "
                     f"MFU {full['mfu']:.1%}, {format_bytes(full['total_bytes'])} per rank")
    return "\n".join(lines) + "\n"


def _flow(yaml, values: dict) -> str:
    return yaml.safe_dump(values, default_flow_style=True, sort_keys=False, width=10**6).strip()
