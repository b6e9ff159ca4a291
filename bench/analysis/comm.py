"""Communication per step: every collective and send a rank issues, per parallel dimension.

The counting convention is the worker's (`bench.metrics.comm`; the comm columns of bench/results/schema.py), so predictions and
measurements compare exactly: payload per rank per optimizer step (all-reduce: its input;
all-gather: its output; reduce-scatter: its input; send/recv: the bytes sent), averaged over all
ranks; wire bytes as a ring moves them, all-reduce 2(n−1)/n, all-gather and reduce-scatter
(n−1)/n of the full tensor, a send its size.

What each dimension moves (b sequences × s tokens per micro-batch, hidden h, X = b·s·h elements):
- tp, per micro-batch, without sequence parallel (Megatron's f/g pairs; Narayanan et al. 2021 §3.2):
  per layer 2 forward all-reduces (after attention proj and fc2) and 2 backward all-reduces (at the
  attention and MLP inputs) of X; stage 0: 1 forward all-reduce of X (vocab-parallel embedding);
  last stage: 1 backward all-reduce of X (head input) and 3 forward all-reduces of b·s fp32
  (vocab-parallel cross-entropy: max, sum of exponentials, target logit).
- tp with sequence parallel (Korthikanti et al. 2022 §4.2.2): each all-reduce becomes an all-gather
  and a reduce-scatter of X (per layer 4 of each; the embedding reduce-scatters forward and
  all-gathers backward; the head all-gathers forward and reduce-scatters backward), plus, once per
  step, an all-reduce of the gradients of the parameters that see sequence shards (norms,
  row-parallel biases) in fp32.
- pp, per micro-batch and boundary: X (÷ t with sequence parallel) forward and the same backward,
  over p−1 boundaries (p·v−1 with the interleaved schedule); averaged over the p ranks.
- dp, per step: one all-reduce of the local gradients (native, ddp, deepspeed ZeRO-0); ZeRO-1/2:
  reduce-scatter of the gradients + all-gather of the parameters; ZeRO-3 / FSDP full, per
  micro-batch: all-gather of the root parameters (embeddings, head) once and of each block twice
  (forward, and re-gathered for backward) + reduce-scatter of all gradients; FSDP grad-op: one
  all-gather of all parameters + reduce-scatter per micro-batch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from bench.analysis.memory import block_params_local, precision
from bench.results.schema import comm_column, comm_columns, comm_op_column

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast")
FP32 = 4


@dataclass(frozen=True)
class Traffic:
    """`ops` calls of one kind on one dimension per step, `payload` bytes each (per rank)."""

    dim: str
    kind: str
    payload: float
    ops: int
    group: int  # ranks in the group
    what: str
    per: str = "micro-batch"  # "micro-batch" (on the pipeline's critical path) or "step"

    @property
    def total(self) -> float:
        return self.payload * self.ops

    @property
    def wire(self) -> float:
        return wire_bytes(self.kind, self.payload, self.group) * self.ops


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


def _bytes_per_param(cfg, mixed_state: str) -> tuple[int, int]:
    """(gradient reduction, parameter all-gather) element bytes for the backend."""
    prec = precision(cfg.dtype, mixed_state)
    if cfg.backend == "fsdp" and cfg.dtype != "fp32":  # MixedPrecisionPolicy: bf16 gathers, fp32 reduce
        return 4, 2
    return prec.grad_comm, prec.param_comm


def tp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg, rank = plan.cfg, plan.ranks[stage]
    m, prec, t = cfg.model_config, precision(cfg.dtype, mixed_state), cfg.tp
    if t == 1:
        return []
    layers, first, last = rank.layers, rank.first, rank.last
    x, mb = cfg.micro_batch * cfg.seq * m.hidden, cfg.micro_batches
    # Full recomputation (native: torch.utils.checkpoint per block) re-runs each block's forward in
    # backward, collectives included, up to the last saved tensor: the attention region's exit and
    # both region entries again, not the MLP's exit (checkpoint stops once everything is recomputed).
    again = layers * mb if cfg.recompute == "full" and cfg.backend == "native" else 0
    enter, leave, bwd = 2 * layers * mb + 2 * again, 2 * layers * mb + again, 2 * layers * mb
    if cfg.backend == "fsdp":  # DTensor Colwise/Rowwise on the blocks only; embedding and head replicated
        return [Traffic("tp", "all_reduce", x * prec.comm_fwd, leave, t, "block outputs (fwd)"),
                Traffic("tp", "all_reduce", x * prec.comm_bwd, bwd, t, "block input grads (bwd)")]
    out = []
    if cfg.backend == "deepspeed" and cfg.zero:  # ZeRO's overflow / gradient-norm check also reduces over
        # model parallel (ZeRO-0 has none: measured 21 tp ops, not 22, for tiny at tp 2)
        out.append(Traffic("tp", "all_reduce", FP32, 1, t, "gradient-norm scalar", "step"))
    if not cfg.sequence_parallel:
        out.append(Traffic("tp", "all_reduce", x * prec.comm_fwd, leave, t, "block outputs (fwd)"))
        out.append(Traffic("tp", "all_reduce", x * prec.comm_bwd, bwd, t, "block input grads (bwd)"))
        if first:
            out.append(Traffic("tp", "all_reduce", x * prec.comm_embed, mb, t, "vocab-parallel embedding (fwd)"))
        if last:
            out.append(Traffic("tp", "all_reduce", x * prec.comm_bwd, mb, t, "head input grad (bwd)"))
    else:
        out.append(Traffic("tp", "all_gather", x * prec.comm_fwd, enter, t, "sequence → full (fwd)"))
        out.append(Traffic("tp", "reduce_scatter", x * prec.comm_fwd, leave, t, "full → sequence (fwd)"))
        out.append(Traffic("tp", "reduce_scatter", x * prec.comm_bwd, bwd, t, "grads of gathers (bwd)"))
        out.append(Traffic("tp", "all_gather", x * prec.comm_bwd, bwd, t, "grads of scatters (bwd)"))
        if first:
            out.append(Traffic("tp", "reduce_scatter", x * prec.comm_embed, mb, t, "embedding (fwd)"))
            out.append(Traffic("tp", "all_gather", x * prec.comm_bwd, mb, t, "embedding grad (bwd)"))
        if last:
            out.append(Traffic("tp", "all_gather", x * prec.comm_fwd, mb, t, "head input (fwd)"))
            out.append(Traffic("tp", "reduce_scatter", x * prec.comm_bwd, mb, t, "head input grad (bwd)"))
        _, n_sp = plan.buckets(stage)
        out.append(Traffic("tp", "all_reduce", n_sp * FP32, 1, t, "sequence-parallel param grads (fp32)", "step"))
    if last:
        out.append(Traffic("tp", "all_reduce", cfg.micro_batch * cfg.seq * FP32, 3 * mb, t,
                           "vocab-parallel cross-entropy (fwd)"))
    return out


def pp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg = plan.cfg
    if cfg.pp == 1:
        return []
    m, prec = cfg.model_config, precision(cfg.dtype, mixed_state)
    msg = cfg.micro_batch * cfg.seq * m.hidden * prec.comm_pp / (cfg.tp if cfg.sequence_parallel else 1)
    mine = plan.ranks[stage].chunks
    fwd = sum(1 for c in mine if c < plan.n_chunks - 1)
    bwd = sum(1 for c in mine if c > 0)
    mb, out = cfg.micro_batches, []
    if fwd:
        out.append(Traffic("pp", "send", msg, fwd * mb, 2, "activations to next stage"))
    if bwd:
        out.append(Traffic("pp", "send", msg, bwd * mb, 2, "grads to previous stage"))
    # the counter sees each receive as an op of 0 bytes
    out.append(Traffic("pp", "recv", 0, (fwd + bwd) * mb, 2, "receives (counted as ops)"))
    if cfg.backend == "deepspeed":  # its pipeline engine's bookkeeping, as measured: loss, and with a ZeRO
        # optimizer (stage ≥ 1) its overflow flag (ZeRO-0: 5 pp ops measured for tiny at pp 2, not 6)
        if cfg.zero:
            out.append(Traffic("pp", "all_reduce", FP32, 1, cfg.pp, "overflow check", "step"))
        out.append(Traffic("pp", "broadcast", 2 * FP32, 1, cfg.pp, "loss from the last stage", "step"))
    return out


def dp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg = plan.cfg
    if cfg.dp == 1:
        return []
    grad_b, param_b = _bytes_per_param(cfg, mixed_state)
    if cfg.backend == "native":
        return _native_dp(plan, stage)
    if cfg.backend == "fsdp":
        return _fsdp_dp(plan, stage, grad_b, param_b)
    n = plan.ranks[stage].params
    grads, params = n * grad_b, n * param_b
    what = plan.sharding
    if what == "none":  # ddp, deepspeed ZeRO-0
        return [Traffic("dp", "all_reduce", grads, 1, cfg.dp, "gradients", "step")]
    if cfg.backend == "deepspeed" and what in ("optimizer", "grads"):
        # DeepSpeed ZeRO-1/2 as measured: gradients all-reduced (ZeRO-1 once per step at the
        # accumulation boundary, ZeRO-2 after every micro-batch), a 4-byte overflow check, the
        # updated partitions all-gathered.
        times = cfg.micro_batches if what == "grads" else 1
        out = [Traffic("dp", "all_reduce", grads, times, cfg.dp, "gradients", "step"),
               Traffic("dp", "all_reduce", FP32, 1, cfg.dp, "overflow check", "step"),
               Traffic("dp", "all_gather", params, 1, cfg.dp, "updated parameters", "step")]
        if cfg.pp > 1 and stage == cfg.pp - 1:  # the pipeline engine averages the loss over dp
            out.append(Traffic("dp", "all_reduce", FP32, 1, cfg.dp, "loss", "step"))
        return out
    if what in ("optimizer", "grads"):  # ZeRO-1/2 (ZeRO paper §7: the same volume as an all-reduce)
        return [Traffic("dp", "reduce_scatter", grads, 1, cfg.dp, "gradients", "step"),
                Traffic("dp", "all_gather", params, 1, cfg.dp, "updated parameters", "step")]
    if cfg.backend == "deepspeed":
        return _deepspeed_zero3(plan, stage, grad_b, param_b)
    blocks = plan.ranks[stage].layers * block_params_local(cfg.model_config, cfg.tp)
    mb = cfg.micro_batches  # ZeRO-3: parameters gathered forward and backward every micro-batch
    return [Traffic("dp", "all_gather", (n + blocks) * param_b, mb, cfg.dp, "parameters"),
            Traffic("dp", "reduce_scatter", grads, mb, cfg.dp, "gradients")]


DS_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (elements)


def _deepspeed_zero3(plan, stage: int, grad_b: int, param_b: int) -> list[Traffic]:
    """DeepSpeed ZeRO-3: parameters below the persistence threshold stay whole on every rank and
    are all-gathered one by one after the optimizer step; the others are gathered for forward and
    again for backward every micro-batch; gradients reduce-scattered every micro-batch; an 8-byte
    overflow check. (Verified on the tiny model, whose parameters are all persistent.)"""
    cfg, threshold = plan.cfg, DS_PERSISTENCE_THRESHOLD
    for entry in getattr(cfg, "ds_set", ()):
        key, _, value = entry.partition("=")
        if key.strip() == "zero_optimization.stage3_param_persistence_threshold":
            threshold = float(value)
    params = plan.param_sizes(stage)
    kept = [n for n in params if n < threshold]
    parted = sum(params) - sum(kept)
    mb, out = cfg.micro_batches, []
    if kept:
        out.append(Traffic("dp", "all_gather", sum(kept) * param_b / len(kept), len(kept), cfg.dp,
                           "persistent parameters", "step"))
    if parted:  # gathered module by module: one group per block (+ the rest)
        groups = plan.ranks[stage].layers + 1
        out.append(Traffic("dp", "all_gather", parted * param_b / groups, 2 * mb * groups, cfg.dp,
                           "partitioned parameters"))
    out += [Traffic("dp", "reduce_scatter", sum(params) * grad_b, mb, cfg.dp, "gradients"),
            Traffic("dp", "all_reduce", 2 * FP32, 1, cfg.dp, "overflow check", "step")]
    return out


def _native_dp(plan, stage: int) -> list[Traffic]:
    """bench.native: one flat fp32 buffer per bucket (+ the sequence-parallel bucket), reduced once
    per step; ZeRO-1 pads each bucket to a multiple of dp, reduce-scatters it and all-gathers it."""
    cfg, (buckets, n_sp) = plan.cfg, plan.buckets(stage)
    sizes = [b for b in (*buckets, n_sp) if b]
    if not cfg.zero:
        return [Traffic("dp", "all_reduce", FP32 * sum(sizes) / len(sizes), len(sizes), cfg.dp, "gradient buckets",
                        "step")]
    padded = sum(-(-b // cfg.dp) * cfg.dp for b in sizes) * FP32 / len(sizes)
    return [Traffic("dp", "reduce_scatter", padded, len(sizes), cfg.dp, "gradient buckets", "step"),
            Traffic("dp", "all_gather", padded, len(sizes), cfg.dp, "updated parameters", "step")]


def _fsdp_gathers(kind: str, mode: str, mb: int, pp: int) -> int:
    """All-gathers per step of one FSDP2 group. Without a pipeline every micro-batch gathers in
    forward, and blocks that reshard after forward (full) gather again in backward. Under
    torch.distributed.pipelining the stage keeps parameters unsharded after every backward but the
    last, so blocks gather once per forward plus once for the first backward, the root once."""
    if pp > 1:
        return 1 if kind == "root" or mode == "grad-op" else mb + 1
    return mb * (2 if kind == "block" and mode != "grad-op" else 1)


def _fsdp_dp(plan, stage: int, grad_b: int, param_b: int) -> list[Traffic]:
    """FSDP2, one communication group per block and one root per chunk; parameters padded on dim 0
    to a multiple of the shard count. Micro-batches before the last skip the gradient sync, so the
    reduce-scatter (and HSDP's all-reduce) runs once per step; the all-gathers: `_fsdp_gathers`."""
    cfg = plan.cfg
    mode, mb = cfg.fsdp or "full", cfg.micro_batches
    if mode == "none":  # FSDP2 replicate: one gradient all-reduce per group
        groups = plan.fsdp_groups(stage, 1)
        total = sum(n for _, n in groups) * grad_b
        return [Traffic("dp", "all_reduce", total / len(groups), len(groups), cfg.dp, "gradients", "step")]
    shard = plan.shard  # dp, or HSDP's shard group
    sizes = plan.fsdp_groups(stage, shard)
    groups = sizes
    counts = [_fsdp_gathers(kind, mode, mb, cfg.pp) for kind, _ in sizes]
    gathered = sum(n * c for (_, n), c in zip(sizes, counts))
    total = sum(n for _, n in sizes)
    out = [Traffic("dp", "all_gather", gathered * param_b / sum(counts), sum(counts), shard, "parameters"),
           Traffic("dp", "reduce_scatter", total * grad_b / len(groups), len(groups), shard, "gradients", "step")]
    if shard < cfg.dp:  # HSDP: each shard's reduced gradients all-reduced across the replicas
        out.append(Traffic("dp", "all_reduce", total * grad_b / shard / len(groups), len(groups),
                           cfg.dp // shard, "gradient shards across replicas", "step"))
    return out


def stage_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    """Everything one rank of pipeline stage `stage` sends (plan: bench.analysis.stage_plan)."""
    return tp_traffic(plan, stage, mixed_state) + pp_traffic(plan, stage, mixed_state) + \
        dp_traffic(plan, stage, mixed_state)


def comm_summary(plan, mixed_state: str = "zero") -> dict:
    """Row columns like the worker's, averaged over ranks (every stage has tp·dp ranks)."""
    cfg = plan.cfg
    out: dict[str, float] = defaultdict(float, dict.fromkeys(comm_columns(), 0.0))
    for stage in range(cfg.pp):
        for tr in stage_traffic(plan, stage, mixed_state):
            out[comm_column("bytes", tr.dim)] += tr.total / cfg.pp
            out[comm_column("wire_bytes", tr.dim)] += tr.wire / cfg.pp
            out[comm_column("ops", tr.dim)] += tr.ops / cfg.pp
            out[comm_op_column(tr.dim, tr.kind, "bytes")] += tr.total / cfg.pp
            out[comm_op_column(tr.dim, tr.kind, "ops")] += tr.ops / cfg.pp
    return dict(out)
