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
- cp (context parallel, issue 24), per layer and micro-batch, on a rank holding s/cp tokens of each
  sequence, KV_r = 2·b·(s/cp)·(kv_heads/t)·head_dim elements, β the compute dtype's bytes:
  ring (bench.context_parallel; native, fsdp): forward cp−1 passes of K/V (KV_r·β each), backward cp−1
  passes of K/V and cp of dK/dV in fp32 (KV_r·4), each pass one send and one recv; Ulysses
  (deepspeed.sequence.layer.DistributedAttention; deepspeed): one all-to-all each of q, k, v and the
  output forward and of their gradients backward (payload: the input). Recomputing the attention core
  (selective, full) runs the forward traffic again. The other dimensions see s/cp tokens (tp, pp), and
  the gradient reduction and state sharding run over dp·cp ranks (`params.data_ranks`), counted as dp.
- pp, per micro-batch and boundary: X (÷ t with sequence parallel) forward and the same backward,
  over p−1 boundaries (p·v−1 with the interleaved schedule); averaged over the p ranks.
- dp, per step: one all-reduce of the local gradients (native, ddp, deepspeed ZeRO-0); ZeRO-1/2:
  reduce-scatter of the gradients + all-gather of the parameters; ZeRO-3 / FSDP full, per
  micro-batch: all-gather of the root parameters (embeddings, head) once and of each block twice
  (forward, and re-gathered for backward) + reduce-scatter of all gradients; FSDP grad-op: one
  all-gather of all parameters + reduce-scatter per micro-batch.
- DeepSpeed (0.19, as measured and read in its source): its own rules, each term with its reason in
  `_deepspeed_tp`, `_deepspeed_pp`, `_deepspeed_dp`, `_deepspeed_zero3` and `_deepspeed_scalars`:
  the pipeline splits what it sends over tp, ZeRO-1/2 all-reduce (not reduce-scatter) in reduce
  buckets, ZeRO-3 gathers what its coordinator fetches, prefetches and, once the live-parameter budget
  or the reuse distance freed a parameter, gathers again in backward (`params.zero3_gathers`), and the
  optimizer reduces a few scalars per step over dp and over its model-parallel group.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from bench.analysis.memory import block_params_local, precision, rank_tokens
from bench.analysis.params import (
    data_ranks,
    deepspeed_bf16_optimizer,
    deepspeed_settings,
    deepspeed_zero3_split,
    padded_total,
    zero3_padded_sums,
    zero3_gathers,
)
from bench.capabilities import engine
from bench.conventions import wire_bytes
from bench.results.schema import comm_column, comm_columns, comm_op_column

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
    behind: str = ""  # "forward" / "backward": each op is a ring pass posted before one ring step of the
    # attention core's forward / backward and waited after it (hidden behind that step); "": not overlapped

    @property
    def total(self) -> float:
        return self.payload * self.ops

    @property
    def wire(self) -> float:
        return wire_bytes(self.kind, self.payload, self.group) * self.ops


def _bytes_per_param(cfg, mixed_state: str) -> tuple[int, int]:
    """(gradient reduction, parameter all-gather) element bytes for the backend."""
    prec, eng = precision(cfg.dtype, mixed_state), engine(cfg)
    if eng.mixed_comm_bytes and cfg.dtype != "fp32":  # e.g. FSDP2's MixedPrecisionPolicy: bf16 gathers, fp32 reduce
        return eng.mixed_comm_bytes
    if cfg.cp > 1 and eng.cp_grad_comm_bytes:
        return eng.cp_grad_comm_bytes, prec.param_comm
    return prec.grad_comm, prec.param_comm


def tp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg, rank, eng = plan.cfg, plan.ranks[stage], engine(plan.cfg)
    m, prec, t = cfg.model_config, precision(cfg.dtype, mixed_state), cfg.tp
    if t == 1:
        return []
    layers, first, last = rank.layers, rank.first, rank.last
    x, mb = rank_tokens(cfg) * m.hidden, cfg.micro_batches
    # Full recomputation (torch.utils.checkpoint per block over the native layers) re-runs each block's forward in
    # backward, collectives included, up to the last saved tensor: the attention region's exit and
    # both region entries again, not the MLP's exit (checkpoint stops once everything is recomputed).
    again = layers * mb if cfg.recompute == "full" and eng.recompute_reruns_tp else 0
    enter, leave, bwd = 2 * layers * mb + 2 * again, 2 * layers * mb + again, 2 * layers * mb
    if not eng.vocab_parallel:  # e.g. DTensor Colwise/Rowwise on the blocks only; embedding and head replicated
        return [Traffic("tp", "all_reduce", x * prec.comm_fwd, leave, t, "block outputs (fwd)"),
                Traffic("tp", "all_reduce", x * prec.comm_bwd, bwd, t, "block input grads (bwd)")]
    out = []
    if eng.data_parallel == "zero-partitions":
        out += _deepspeed_tp(plan, stage)
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
        out.append(Traffic("tp", "all_reduce", rank_tokens(cfg) * FP32, 3 * mb, t,
                           "vocab-parallel cross-entropy (fwd)"))
    return out


def pp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg = plan.cfg
    if cfg.pp == 1:
        return []
    m, prec = cfg.model_config, precision(cfg.dtype, mixed_state)
    msg = rank_tokens(cfg) * m.hidden * prec.comm_pp / (cfg.tp if cfg.sequence_parallel else 1)
    mine = plan.ranks[stage].chunks
    fwd = sum(1 for c in mine if c < plan.n_chunks - 1)
    bwd = sum(1 for c in mine if c > 0)
    if engine(cfg).pipeline == "pipe-engine":
        return _deepspeed_pp(plan, msg, fwd, bwd)
    mb, out = cfg.micro_batches, []
    if fwd:
        out.append(Traffic("pp", "send", msg, fwd * mb, 2, "activations to next stage"))
    if bwd:
        out.append(Traffic("pp", "send", msg, bwd * mb, 2, "grads to previous stage"))
    # the counter sees each receive as an op of 0 bytes
    out.append(Traffic("pp", "recv", 0, (fwd + bwd) * mb, 2, "receives (counted as ops)"))
    return out


def cp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    """Context parallel's attention core, per layer and micro-batch (module docstring): the ring's
    passes of K/V (and dK/dV) or Ulysses' all-to-alls. Recomputation that re-runs the core (full; selective
    where the engine recomputes around its cp traffic) runs its forward traffic again in backward."""
    cfg = plan.cfg
    c = cfg.cp
    if c == 1:
        return []
    m, e = cfg.model_config, precision(cfg.dtype, mixed_state).act  # q, k, v reach the core in the compute dtype
    tokens, t = rank_tokens(cfg), cfg.tp
    kv = 2 * tokens * (m.num_kv_heads // t) * m.head_dim  # KV_r: this rank's K and V elements
    passes = plan.ranks[stage].layers * cfg.micro_batches
    reruns = cfg.recompute == "full" or (cfg.recompute == "selective" and engine(cfg).selective_reruns_cp)
    rerun = passes if reruns else 0
    if cfg.cp_comm == "ulysses":  # one all-to-all per q, k, v and the output, each way
        q = tokens * (m.heads // t) * m.head_dim
        out = []
        for what, calls in (("forward", passes), ("recomputed forward", rerun), ("backward (their gradients)", passes)):
            if calls:
                out += [Traffic("cp", "all_to_all", q * e, 2 * calls, c, f"queries and outputs, {what}"),
                        Traffic("cp", "all_to_all", kv / 2 * e, 2 * calls, c, f"keys and values, {what}")]
        return out
    # each pass is one send and one recv of a flat buffer to the next / from the previous cp rank
    # the forward prefetches the next K/V behind the block in hand; the backward's dK/dV are ready only
    # after their block, so its passes wait
    sends = [Traffic("cp", "send", kv * e, (c - 1) * calls, c, what, behind=behind) for what, calls, behind in
             (("K/V round the ring (fwd)", passes, "forward"),
              ("K/V round the ring (recomputed fwd)", rerun, "forward"),
              ("K/V round the ring again (bwd)", passes, "")) if calls]
    sends.append(Traffic("cp", "send", kv * FP32, c * passes, c, "dK/dV partial sums, fp32, the last pass home (bwd)"))
    return sends + [Traffic("cp", "recv", 0, sum(tr.ops for tr in sends), c, "receives (counted as ops)")]


def ep_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    """Expert parallel's token dispatch (bench.expert_parallel), per MoE layer and micro-batch on a rank
    routing N = tokens · top-k rows of width h: the count exchange (E int64), the rows out and the
    results back forward, and both again backward. Dropless routing: every assignment travels (with a
    capacity factor fewer do, as many as the data keeps: this counts them all, an upper bound)."""
    cfg = plan.cfg
    if cfg.ep == 1:
        return []
    m = cfg.model_config
    calls = sum(m.moe_layer(i) for ids in plan.ranks[stage].layer_ids for i in ids) * cfg.micro_batches
    if not calls:
        return []
    rows = rank_tokens(cfg) * m.moe_top_k * m.hidden  # elements of the routed rows
    e = FP32 if cfg.dtype == "fp32" else precision(cfg.dtype, mixed_state).act
    return [Traffic("ep", "all_to_all", 8 * m.experts, calls, cfg.ep, "tokens per expert (int64), forward"),
            Traffic("ep", "all_to_all", rows * FP32, calls, cfg.ep, "routed rows out, forward (the norm's fp32 output)"),
            Traffic("ep", "all_to_all", rows * e, calls, cfg.ep, "expert outputs back, forward"),
            Traffic("ep", "all_to_all", rows * e, calls, cfg.ep, "their gradients out, backward"),
            Traffic("ep", "all_to_all", rows * FP32, calls, cfg.ep, "the rows' gradients back, backward")]


def dp_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    cfg = plan.cfg
    n_dp = data_ranks(cfg)
    if n_dp == 1:
        return []
    grad_b, param_b = _bytes_per_param(cfg, mixed_state)
    layout = engine(cfg).data_parallel
    if layout == "flat-buckets":
        return _native_dp(plan, stage)
    if layout == "dim0-shards":
        return _fsdp_dp(plan, stage, grad_b, param_b)
    if layout == "zero-partitions":
        return _deepspeed_dp(plan, stage, grad_b, param_b)
    n = plan.ranks[stage].params
    grads, params = n * grad_b, n * param_b
    what = plan.sharding
    if what == "none":  # ddp
        return [Traffic("dp", "all_reduce", grads, 1, n_dp, "gradients", "step")]
    if what in ("optimizer", "grads"):  # ZeRO-1/2 (ZeRO paper §7: the same volume as an all-reduce)
        return [Traffic("dp", "reduce_scatter", grads, 1, n_dp, "gradients", "step"),
                Traffic("dp", "all_gather", params, 1, n_dp, "updated parameters", "step")]
    blocks = plan.ranks[stage].layers * block_params_local(cfg.model_config, cfg.tp)
    mb = cfg.micro_batches  # ZeRO-3: parameters gathered forward and backward every micro-batch
    return [Traffic("dp", "all_gather", (n + blocks) * param_b, mb, n_dp, "parameters"),
            Traffic("dp", "reduce_scatter", grads, mb, n_dp, "gradients")]


def _deepspeed_dp(plan, stage: int, grad_b: int, param_b: int) -> list[Traffic]:
    """DeepSpeed over dp, as measured. ZeRO-0: the gradients all-reduced once per step (at the
    accumulation boundary). ZeRO-1/2 (and the bf16 optimizer its pipeline uses at ZeRO-0, which
    partitions the fp32 master the same way): gradients all-reduced (ZeRO-2 after every
    micro-batch), the per-step scalars, the updated partitions all-gathered. ZeRO-3:
    `_deepspeed_zero3`. The pipeline engine also averages the loss over dp on the last stage."""
    cfg, n_dp = plan.cfg, data_ranks(plan.cfg)
    if cfg.zero == 3:
        return _deepspeed_zero3(plan, stage, grad_b, param_b)
    n = plan.ranks[stage].params
    rounds = cfg.micro_batches if cfg.zero == 2 else 1  # ZeRO-2 reduces after every micro-batch
    buckets = 1  # ZeRO-0: one all-reduce of the flat gradients
    if cfg.zero:  # ZeRO-1/2: through the ipg bucket (reduce_bucket_size), flushed before it would overflow
        buckets = _greedy_buckets(tuple(plan.param_sizes(stage)[::-1]), deepspeed_settings(cfg)["reduce_bucket_size"])
    out = [Traffic("dp", "all_reduce", n * grad_b / buckets, rounds * buckets, n_dp, "gradients", "step")]
    if cfg.zero or deepspeed_bf16_optimizer(cfg):
        out += [*_deepspeed_scalars(cfg, "dp", n_dp),
                Traffic("dp", "all_gather", n * param_b, 1, n_dp, "updated parameters", "step")]
    if cfg.pp > 1 and stage == cfg.pp - 1:
        out.append(Traffic("dp", "all_reduce", FP32, 1, n_dp, "loss", "step"))
    return out


def _deepspeed_zero3(plan, stage: int, grad_b: int, param_b: int) -> list[Traffic]:
    """DeepSpeed ZeRO-3 (`deepspeed_zero3_split` says which parameters stay whole; `bench.analysis.zero3`
    derives its gathers, every micro-batch the same)."""
    cfg, mb, n_dp = plan.cfg, plan.cfg.micro_batches, data_ranks(plan.cfg)
    kept, _ = deepspeed_zero3_split(plan, stage)
    kept_padded, parted_padded = zero3_padded_sums(plan, stage)
    ds = deepspeed_settings(cfg)
    out = []
    if kept:  # persistent parameters: whole on every rank, re-gathered one by one after the step
        out.append(Traffic("dp", "all_gather", sum(kept) * param_b / len(kept), len(kept), n_dp,
                           "persistent parameters", "step"))
    gathers = zero3_gathers(plan, stage)  # its coordinator replayed: fetches, prefetches, backward re-gathers
    for what, sizes in (("forward", gathers.forward), ("backward", gathers.backward)):
        if sizes:
            out.append(Traffic("dp", "all_gather", sum(sizes) * param_b / len(sizes), len(sizes) * mb, n_dp,
                               f"partitioned parameters ({what})"))
    # every gradient, persistent or not, is reduce-scattered during each micro-batch's backward
    # through the ipg bucket, which is flushed before a gradient that would overflow it
    grads = kept_padded + parted_padded
    per_mb = _greedy_buckets(tuple(plan.param_sizes(stage)[::-1]), ds["reduce_bucket_size"])
    out += [Traffic("dp", "reduce_scatter", grads * grad_b / per_mb, per_mb * mb, n_dp, "gradients"),
            # the overflow / gradient-norm check: one fp64 scalar
            *_deepspeed_scalars(cfg, "dp", n_dp)]
    return out


@lru_cache(maxsize=65536)
def _greedy_buckets(sizes: tuple[int, ...], cap: float) -> int:
    """Buckets filled in arrival order (backward: reverse registration), a new one whenever the next
    tensor would pass `cap` (a tensor bigger than `cap` gets a bucket of its own)."""
    count, filled = 0, 0
    for n in sizes:
        if filled and filled + n > cap:
            count, filled = count + 1, 0
        filled += n
    return count + (filled > 0)


def _deepspeed_tp(plan, stage: int) -> list[Traffic]:
    """What DeepSpeed adds on tp. Its ZeRO optimizer (stage ≥ 1) reduces the gradient norm and the
    overflow flag over the model-parallel group, which is tp only without a pipeline (with one it is
    tp × pp, a group of neither dimension); ZeRO-3's norm is fp64. The pipeline engine splits the
    activation (and gradient) it sends over tp (`pipe_partitioned`, `grad_partitioned`) and
    all-gathers the parts where it needs the whole tensor: a stage that receives activations (not
    the first) once per micro-batch, a stage that sends them (not the last) to restore its output
    for backward and, with partitioned gradients, to rebuild the gradient it received."""
    cfg, rank = plan.cfg, plan.ranks[stage]
    t, mb, out = cfg.tp, cfg.micro_batches, []
    if cfg.pp == 1:
        out += _deepspeed_scalars(cfg, "tp", t, model_parallel=True)
    ds = deepspeed_settings(cfg)
    if cfg.pp > 1 and ds["pipe_partitioned"]:
        numel = rank_tokens(cfg) * cfg.model_config.hidden
        gathers = (not rank.first) + (not rank.last) * (1 + ds["grad_partitioned"])
        if gathers:
            out += _partitioned_full(numel, precision(cfg.dtype).comm_pp, gathers * mb, t)
    return out


def _deepspeed_scalars(cfg, dim: str, n: int, model_parallel: bool = False) -> list[Traffic]:
    """The scalars DeepSpeed's optimizer all-reduces once per step, over dp and over its model-parallel
    group (tp without a pipeline, pp without tp, else a group of neither): the gradient norm (fp32;
    ZeRO-3's is fp64) and, with low-precision weights, the overflow flag (1 byte; ZeRO-3 folds it
    into the norm). ZeRO-0 reduces none over dp, and over model parallel only under mixed precision
    (its fp16/bf16 optimizer wrapper)."""
    mixed = cfg.dtype != "fp32"
    if deepspeed_bf16_optimizer(cfg):  # the norm over model parallel only, no flag
        sizes = [FP32] if model_parallel else []
    elif cfg.zero == 0:
        sizes = [FP32, 1] if mixed and model_parallel else []
    elif cfg.zero == 3:
        sizes = [2 * FP32]
    else:
        sizes = [FP32, 1] if mixed else [FP32]
    names = {FP32: "gradient norm (fp32)", 2 * FP32: "gradient norm (fp64)", 1: "overflow flag"}
    return [Traffic(dim, "all_reduce", b, 1, n, names[b], "step") for b in sizes]


def _partitioned_full(numel: int, elem: int, times: int, t: int) -> list[Traffic]:
    """PartitionedTensor.full(): one all-gather when the tensor's elements split evenly over tp, else
    one broadcast per part (the parts together are the tensor)."""
    if numel % t == 0:
        return [Traffic("tp", "all_gather", numel * elem, times, t, "pipeline tensor from its tp parts")]
    return [Traffic("tp", "broadcast", numel * elem / t, times * t, t, "pipeline tensor from its tp parts")]


def _deepspeed_pp(plan, msg: float, fwd: int, bwd: int) -> list[Traffic]:
    """DeepSpeed's PipelineEngine. With tp > 1 and `pipe_partitioned` (default) each activation goes
    as two messages: the PartitionedTensor meta (int64: ndim, shape, parts, rank, t + 1 offsets) and
    this rank's 1/t part; gradients the same with `grad_partitioned`. Per step: the loss broadcast
    from the last stage (2 fp32: this dp group's and the dp mean), and the optimizer's scalars over
    the model-parallel group, which is the pp group only when tp = 1 (`_deepspeed_scalars`)."""
    cfg, mb, t = plan.cfg, plan.cfg.micro_batches, plan.cfg.tp
    ds = deepspeed_settings(cfg)
    meta = 8 * (3 + 3 + t + 1)  # activations are (micro_batch, seq, hidden)
    split_act = t > 1 and ds["pipe_partitioned"]
    split_grad = split_act and ds["grad_partitioned"]
    out = []
    for n, split, what in ((fwd, split_act, "activations to next stage"), (bwd, split_grad, "grads to previous stage")):
        if not n:
            continue
        if split:
            out += [Traffic("pp", "send", meta, n * mb, 2, f"{what}: partition meta"),
                    Traffic("pp", "send", msg / t, n * mb, 2, f"{what}: this rank's 1/t part")]
        else:
            out.append(Traffic("pp", "send", msg, n * mb, 2, what))
    # one receive per message: a stage that sends activations receives gradients, and vice versa
    recvs = fwd * mb * (1 + split_grad) + bwd * mb * (1 + split_act)
    out.append(Traffic("pp", "recv", 0, recvs, 2, "receives (counted as ops)"))
    if t == 1:
        out += _deepspeed_scalars(cfg, "pp", cfg.pp, model_parallel=True)
    out.append(Traffic("pp", "broadcast", 2 * FP32, 1, cfg.pp, "loss from the last stage", "step"))
    return out


def _native_dp(plan, stage: int) -> list[Traffic]:
    """bench.native: one flat fp32 buffer per bucket (+ the sequence-parallel bucket), reduced once
    per step; ZeRO-1 pads each bucket to a multiple of dp, reduce-scatters it and all-gathers it. At
    ep > 1 the expert weights' buckets reduce over the expert-data-parallel ranks (dp·cp/ep), as dp."""
    cfg, (buckets, n_sp), n_dp = plan.cfg, plan.buckets(stage), data_ranks(plan.cfg)
    out = _bucket_reductions([b for b in (*buckets, n_sp) if b], n_dp, cfg.zero, "")
    edp = n_dp // cfg.ep
    if edp > 1:
        out += _bucket_reductions(list(plan.expert_buckets(stage)), edp, cfg.zero, "expert ")
    return out


def _bucket_reductions(sizes: list[int], n: int, zero: int, kind: str) -> list[Traffic]:
    """Flat fp32 buckets of `sizes` elements over `n` ranks: all-reduced, or (ZeRO-1) padded to a multiple
    of n, reduce-scattered and all-gathered. `kind`: "" or "expert ", for the labels."""
    if not sizes:
        return []
    if not zero:
        return [Traffic("dp", "all_reduce", FP32 * sum(sizes) / len(sizes), len(sizes), n, f"{kind}gradient buckets", "step")]
    padded = padded_total(sizes, n) * FP32 / len(sizes)
    return [Traffic("dp", "reduce_scatter", padded, len(sizes), n, f"{kind}gradient buckets", "step"),
            Traffic("dp", "all_gather", padded, len(sizes), n, f"updated {kind}parameters", "step")]


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
    mode, mb = cfg.fsdp, cfg.micro_batches
    if mode == "none":  # FSDP2 replicate: one gradient all-reduce per group
        groups = plan.fsdp_groups(stage, 1)
        total = sum(n for _, n in groups) * grad_b
        return [Traffic("dp", "all_reduce", total / len(groups), len(groups), data_ranks(cfg), "gradients", "step")]
    shard = plan.shard  # dp, or HSDP's shard group
    sizes = plan.fsdp_groups(stage, shard)
    groups = sizes
    counts = [_fsdp_gathers(kind, mode, mb, cfg.pp) for kind, _ in sizes]
    gathered = sum(n * c for (_, n), c in zip(sizes, counts))
    total = sum(n for _, n in sizes)
    out = [Traffic("dp", "all_gather", gathered * param_b / sum(counts), sum(counts), shard, "parameters"),
           Traffic("dp", "reduce_scatter", total * grad_b / len(groups), len(groups), shard, "gradients", "step")]
    if shard < data_ranks(cfg):  # HSDP: each shard's reduced gradients all-reduced across the replicas
        out.append(Traffic("dp", "all_reduce", total * grad_b / shard / len(groups), len(groups),
                           data_ranks(cfg) // shard, "gradient shards across replicas", "step"))
    return out


def stage_traffic(plan, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    """Everything one rank of pipeline stage `stage` sends (plan: bench.analysis.stage_plan)."""
    return tp_traffic(plan, stage, mixed_state) + cp_traffic(plan, stage, mixed_state) + \
        ep_traffic(plan, stage, mixed_state) + pp_traffic(plan, stage, mixed_state) + dp_traffic(plan, stage, mixed_state)


def comm_summary(plan, mixed_state: str = "zero") -> dict:
    """Row columns like the worker's, averaged over ranks (every stage has tp·cp·dp ranks)."""
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
