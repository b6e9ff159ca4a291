"""Memory per rank: model state (params, grads, optimizer) and activations. Pure maths.

Model state, bytes per parameter (Rajbhandari et al. 2020, "ZeRO", §3.1: K = 12 for Adam):
- fp32 training:                       params 4 + grads 4 + Adam m, v 8                   = 16
- mixed precision, `zero` convention:  params 2 + grads 2 + fp32 master, m, v 12           = 16
  (the ZeRO paper's and Megatron's: low-precision weights and grads, fp32 copy in the optimizer)
- mixed precision, `autocast` convention: params 4 + grads 4 + Adam 8                      = 16
  (torch.autocast and FSDP2's default: fp32 weights, low precision only inside the matmuls; the
  native, ddp and fsdp backends of this suite train this way)
Sharding over the dp group: ZeRO-1 the optimizer state, ZeRO-2 (FSDP grad-op) + gradients,
ZeRO-3 (FSDP full) + parameters; FSDP hybrid shards within a group of `hybrid_shard` ranks.
ZeRO-3/FSDP additionally hold gathered parameters during the step (`step_peak`: FSDP2 its root and
the blocks in backward, ZeRO-3 every partitioned parameter it fits under its live-parameter limits).

Context parallel (cp): a rank holds s/cp tokens of each sequence, so every per-token activation term,
the logits and the loss divide by cp (Korthikanti's terms and this suite's alike), its ring attention
adds its buffers to a block's backward (`context_parallel_bytes`), and the model state is sharded over
the dp·cp ranks where the engine shards (ZeRO ≥ 1, FSDP: `params.data_ranks`).

Tensor parallel (Megatron's split): qkv and fc1 column-parallel (weights and biases ÷ t), proj
and fc2 row-parallel (weights ÷ t, biases replicated), norms replicated, token embedding and LM
head vocab-parallel (÷ t), learned position table replicated. Stage 0 holds the embeddings, the
last stage the final norm and head (with tied embeddings and pp > 1 the last stage holds a copy).

Activations per layer and micro-batch: Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Table 2, with s = seq, b = micro-batch, h = hidden, a = heads, t = tp:
    no parallelism         s·b·h·(34 + 5·a·s/h)
    tensor parallel        s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel    s·b·h/t·(34 + 5·a·s/h)
    + selective recompute  drops the 5·a·s/h terms (attention scores recomputed)
    full recompute         2·s·b·h (the layer input only; ÷ t with sequence parallel)
The constants assume 2-byte activations, 1-byte dropout masks and a GELU MLP of 4h. This module
derives them term by term from the model (element bytes e, MLP width f, swiglu, and K and V at
their grouped width kv_heads·head_dim under grouped-query attention) so that they
reduce exactly to Table 2 in that case (`KORTHIKANTI`: dropout, unfused attention); the default
`ActivationModel()` describes this suite's GPT (no dropout, fused attention that saves no s×s
matrix). Beyond the layers, the last stage holds the logits and the loss's fp32 softmax for the
micro-batches in flight there. How many layer- and micro-batches each rank holds at its peak is read
off the action lists its backend runs (`bench.analysis.stage_plan`, `bench.schedule`). With the `suite`
model and the `autocast` state convention, the fp32 norm inputs and the per-forward bf16 weight
copies that torch.autocast saves are added (`_autocast_norm_inputs`, `_autocast_weight_copies`).

The step's peak (`step_peak`, the row's `pred_peak_mem_bytes`, measured as `peak_mem_bytes`) is
what the step adds to the model state at its largest moment: the held activations plus what is live
beside them then (the loss's gradients, a block's backward working set, gathered parameters,
DeepSpeed's gradient reduction), less the state the backend frees when the step starts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache, wraps
from operator import attrgetter

from bench.analysis.params import (
    data_ranks,
    deepspeed_bf16_optimizer,
    deepspeed_settings,
    deepspeed_zero3_split,
    padded_total,
    zero3_padded_sums,
    zero3_gathers,
    zero12_padded,
)
from bench.capabilities import FSDP_SHARDS, ZERO_SHARDS, engine
from models.config import GPTConfig, block_matmul_weights, block_params, embedding_params, expert_params

MIXED_STATES = ("zero", "autocast", "megatron")
"""How mixed precision keeps its model state: see the module docstring."""


@dataclass(frozen=True)
class Precision:
    """Bytes per element of every kind of tensor the cost model counts."""

    param: int  # model state, per parameter
    grad: int
    optimizer: int
    act: int  # saved activations
    comm_fwd: int  # tp collectives on row-parallel outputs (forward)
    comm_bwd: int  # tp collectives on gradients of column-parallel inputs (backward)
    comm_embed: int  # the embedding's tp collective
    comm_pp: int  # activations sent between stages
    grad_comm: int  # dp reduction of gradients
    param_comm: int  # dp all-gather of parameters


@lru_cache(maxsize=None)  # one frozen record per convention: the cost model asks for it per rank and candidate
def precision(dtype: str, mixed_state: str = "zero") -> Precision:
    if dtype == "fp32":
        return Precision(4, 4, 8, 4, 4, 4, 4, 4, 4, 4)
    if mixed_state not in MIXED_STATES:
        raise ValueError(f"mixed_state is {mixed_state!r}; choose one of {', '.join(MIXED_STATES)}")
    if mixed_state == "zero":
        return Precision(2, 2, 12, 2, 2, 2, 2, 2, 2, 2)
    if mixed_state == "megatron":  # Megatron-LM: bf16 weights, fp32 main gradients (accumulated and
        # reduced in fp32), fp32 master weights and Adam state: 2 + 4 + 12 = 18 bytes per parameter
        return Precision(2, 4, 12, 2, 2, 2, 2, 2, 4, 2)
    # autocast: weights and gradients stay fp32 (reduced in fp32); the engines cast activations to
    # the low precision before they communicate them (tp collectives, pipeline sends).
    return Precision(4, 4, 8, 2, 2, 2, 2, 2, 4, 4)


# --- model-state parts, memoised ------------------------------------------------------------------
STATE_UNREAD = ("micro_batch", "micro_batches", "seq", "schedule", "recompute", "order")
"""Config fields the model-state parts (`model_state`, `_fsdp_gathered`, the ZeRO gathers and reductions)
do not read: the batch, sequence, schedule and recomputation shape only the activations, and the rank
order reaches the state only through the plan's shard (FSDP hybrid)."""
_PRECISION_FIELDS = attrgetter(*(f.name for f in dataclasses.fields(Precision)))  # a tuple compares faster


def state_memo(part):
    """`part(plan, stage, prec)` cached on every config field but STATE_UNREAD, the plan's sharding, the
    stage and the precision: the planner's candidates that differ only in their batch, schedule,
    recomputation or rank order share one rank's state (tests/test_planner.py checks each part against
    its uncached `__wrapped__`). A cached value is shared: callers copy it before they change it."""
    memo: dict = {}

    @wraps(part)
    def cached(plan, stage: int, prec: Precision):
        key = (_state_fields(type(plan.cfg))(plan.cfg), plan.sharding, plan.shard, stage, _PRECISION_FIELDS(prec))
        hit = memo.get(key)
        if hit is None:
            if len(memo) > 65536:
                memo.clear()
            hit = memo[key] = part(plan, stage, prec)
        return hit
    return cached


@lru_cache(maxsize=None)
def _state_fields(kind: type) -> attrgetter:
    return attrgetter(*(f.name for f in dataclasses.fields(kind) if f.name not in STATE_UNREAD))


# --- parameters ----------------------------------------------------------------------------------
@lru_cache(maxsize=65536)
def block_params_local(m: GPTConfig, tp: int, layer: int | None = None, ep: int = 1) -> float:
    """Parameters of block `layer` (None: the last, an MoE block in an MoE model) on one tp rank
    (row-parallel biases and norms replicated) holding 1/ep of its experts."""
    replicated = (2 * m.hidden if m.bias else 0) + 2 * (m.hidden * (2 if m.norm == "layernorm" else 1))
    layer = m.layers - 1 if layer is None else layer
    experts = m.experts * expert_params(m) * (1 - 1 / ep) if m.moe_layer(layer) else 0  # on the other ep ranks
    return (block_params(m, layer) - experts - replicated) / tp + replicated


def _pos_params(m: GPTConfig) -> int:
    return m.seq_len * m.hidden if m.position == "learned" else 0


def embedding_params_local(m: GPTConfig, tp: int) -> float:
    return (embedding_params(m) - _pos_params(m)) / tp + _pos_params(m)


def head_params_local(m: GPTConfig, tp: int, pp: int) -> float:
    norm = m.hidden * (2 if m.norm == "layernorm" else 1)
    table = m.vocab * m.hidden if (not m.tie_embeddings or pp > 1) else 0
    return table / tp + norm


def rank_params(m: GPTConfig, tp: int, pp: int, layer_ids, first: bool, last: bool, ep: int = 1) -> float:
    """Parameters held by one rank of a pipeline stage with blocks `layer_ids` (its tp shard and 1/ep of
    the experts, before dp sharding); `first`: it holds the embedding, `last`: the final norm and head."""
    n = sum(block_params_local(m, tp, layer, ep) for layer in layer_ids)
    if first:
        n += embedding_params_local(m, tp)
    if last:
        n += head_params_local(m, tp, pp)
    return n


# --- sharding ------------------------------------------------------------------------------------
def sharding(cfg, gpus_per_node: int | None = None) -> tuple[str, int]:
    """(what is sharded over the dp·cp ranks (`data_ranks`): none | optimizer | grads | params, over how
    many ranks)."""
    if engine(cfg).shards_by == "fsdp-mode":
        mode = cfg.fsdp
        what = FSDP_SHARDS[mode]
        if what == "none":
            return "none", 1
        return what, hybrid_shard(cfg, gpus_per_node) if mode == "hybrid" else data_ranks(cfg)
    return ZERO_SHARDS[cfg.zero], (data_ranks(cfg) if cfg.zero else 1)


def hybrid_shard(cfg, gpus_per_node: int | None = None) -> int:
    """FSDP hybrid's shard group (bench.backends.fsdp: `hybrid_shape` over dp, times cp): the cp ranks and
    the largest divisor of dp below it that fits the dp ranks of one node (all of them when
    `gpus_per_node` is None: one machine)."""
    per_node = cfg.dp if gpus_per_node is None else _dp_ranks_per_node(cfg, gpus_per_node)
    return cfg.cp * max((d for d in range(1, cfg.dp) if cfg.dp % d == 0 and d <= per_node), default=1)


def _dp_ranks_per_node(cfg, gpus_per_node: int) -> int:
    """Ranks of one dp group in a node: the cp ranks sit next to the tp ranks (bench.layout), the dp
    neighbours `stride` apart."""
    stride = cfg.tp * cfg.cp * (cfg.pp if cfg.order in ("tp-pp-dp", "tp-cp-pp-dp") else 1)
    return max(1, min(cfg.dp, gpus_per_node // stride))


# --- activations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationModel:
    """`name`: `table2`, Korthikanti et al.'s layers (dropout masks, the logits saved), or `suite`, this
    suite's GPT (no dropout, the loss saving only its softmax). `attention`: the kernel, `flash` (a fused
    flash / SDPA kernel saving only its fp32 log-sum-exp: what every engine here and in use today runs) or
    `unfused` (the a·s² scores, their softmax and dropout saved, as Korthikanti et al.'s Table 2 counts)."""

    name: str = "suite"
    attention: str = "flash"

    @property
    def dropout(self) -> bool:
        return self.name == "table2"

    @property
    def flash(self) -> bool:
        return self.attention == "flash"


KORTHIKANTI = ActivationModel("table2", "unfused")
"""The activations of Korthikanti et al. 2022's Table 2 (Megatron-LM with its unfused attention)."""


@lru_cache(maxsize=65536)
def layer_activation_bytes(m: GPTConfig, b: int, s: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", e: int = 2, act: ActivationModel = ActivationModel(),
                           cp: int = 1) -> float:
    """Bytes one layer saves for backward for one micro-batch on one tp rank (see module docstring).
    Context parallel: the rank holds s/cp of every sequence, so every per-token term divides by cp, and
    its attention is a fused ring (TE's, which Megatron's CP requires, or this suite's): no score matrix
    is saved, only the fp32 log-sum-exp, as a fused kernel's."""
    h, a, f, tokens = m.hidden, m.heads, m.ffn_hidden, s * b // cp
    if recompute == "full":
        return e * tokens * h / (tp if sp else 1)
    mask = 1 if act.dropout else 0  # 1-byte dropout masks
    # norm inputs (2), qkv input, fc1 input, and the two residual dropout masks: not split by tp
    replicated = 4 * e * h + 2 * mask * h
    mlp = e * (4 * f if m.activation == "swiglu" else 2 * f)  # gelu: fc1 out + fc2 in; swiglu: + gate
    kv = m.num_kv_heads * m.head_dim  # = h without grouped-query attention
    split = e * (2 * h + 2 * kv) + mlp  # Q, K, V, proj input, MLP internals
    fused = act.flash or cp > 1
    if recompute == "selective" or fused:
        scores = 4 * a if fused and recompute != "selective" else 0  # fused kernel: fp32 log-sum-exp
    else:
        scores = a * s * (e + mask * (1 + e))  # softmax out, dropout mask, dropout out
    per_token = (replicated / tp if sp else replicated) + split / tp + scores / tp
    return tokens * per_token


def _autocast_norm_inputs(m: GPTConfig, tokens: int, tp: int, sp: bool) -> float:
    """torch.autocast beyond the 2-byte convention, per layer and micro-batch: the two norm inputs
    (the fp32 residual stream) are saved in fp32 (+2 bytes each per element)."""
    return tokens * 2 * 2 * m.hidden / (tp if sp else 1)


def _autocast_weight_copies(m: GPTConfig, tp: int) -> float:
    """The bf16 copy of one layer's matmul weights that torch.autocast saves for backward. Autocast
    caches it for one autocast region: every micro-batch's forward makes its own, except in the native
    engine, which keeps one region for the whole step (`Pipeline._weight_casts_kept`): one per layer."""
    return 2 * block_matmul_weights(m) / tp


@lru_cache(maxsize=65536)
def head_activation_bytes(m: GPTConfig, b: int, s: int, tp: int, sp: bool, e: int,
                          logits_saved: bool = True) -> float:
    """Final norm input, head input and the loss's fp32 softmax per micro-batch, and the logits (e)
    when they are saved (`table2`); this suite's loss saves only its fp32 (log-)softmax: the logits
    die once the loss has read them."""
    tokens = s * b
    return tokens * (2 * e * m.hidden / (tp if sp else 1) + ((e if logits_saved else 0) + 4) * m.vocab / tp)


def loss_backward_bytes(m: GPTConfig, tokens: int, tp: int) -> float:
    """The loss's backward beside its saved softmax: the gradient it receives and the one it returns,
    both fp32 and the (vocab-sharded) logits' size (F.cross_entropy's log-softmax backward; the
    vocab-parallel loss's clone of the softmax and its product with the incoming gradient)."""
    return tokens * 2 * 4 * m.vocab / tp


def rank_tokens(cfg) -> int:
    """Tokens of one micro-batch a rank holds: its 1/cp share of each sequence (two zig-zag chunks)."""
    return cfg.micro_batch * cfg.seq // cfg.cp


def context_parallel_bytes(cfg) -> float:
    """What the attention core holds beside the saved activations in a block's backward under context
    parallel (0 at cp = 1), per tp rank; Q_r, KV_r are the rank's query and K/V elements:
    - ring (`bench.context_parallel.RingAttention.backward`): the K/V in hand and the ones being received
      (2·KV_r·β), the dK/dV partial sums in hand and received (2·KV_r fp32), the fp32 copies of K/V, Q and
      the output's gradient it computes in (when β < 4), the fp32 dQ accumulator, and one half block's
      scores, probabilities and their gradient (3 × b·(heads/t)·chunk² fp32, chunk = s/(2·cp));
    - ulysses (`deepspeed.sequence.layer.DistributedAttention`): each all-to-all's input and output of
      Q, K, V and the core's output, β each."""
    if cfg.cp == 1:
        return 0.0
    m, e, t = cfg.model_config, precision(cfg.dtype).act, cfg.tp
    tokens = rank_tokens(cfg)
    q = tokens * m.heads // t * m.head_dim
    kv = 2 * tokens * m.num_kv_heads // t * m.head_dim
    if cfg.cp_comm == "ulysses":
        return 2 * (2 * q + kv) * e
    copies = 4 if e < 4 else 0  # computed in fp32: a copy unless the inputs are fp32
    chunk = cfg.seq // (2 * cfg.cp)
    block = cfg.micro_batch * m.heads // t * chunk * chunk
    return kv * (2 * e + 2 * 4 + copies) + q * (4 + 2 * copies) + 3 * block * 4


def layer_backward_bytes(m: GPTConfig, tokens: int, tp: int, e: int) -> float:
    """A block's backward working set beside its saved activations, at its largest (the MLP): the
    gradient of the fc2 input and of the fc1 output (twice the width for swiglu's gate and up)."""
    return tokens * e * (m.ffn_hidden + m.fc1_out) / tp


# --- per rank ------------------------------------------------------------------------------------
def stage_memory(plan, stage: int, mixed_state: str = "zero", act: ActivationModel = ActivationModel()) -> dict:
    """Bytes held by one rank of pipeline stage `stage` at its peak (plan: bench.analysis.stage_plan).
    `transient_bytes` is the step peak less the held activations: negative when the backend has freed
    more state before the peak (gradients set to None) than it holds beside the activations."""
    cfg, rank = plan.cfg, plan.ranks[stage]
    m, prec, eng = cfg.model_config, precision(cfg.dtype, mixed_state), engine(cfg)
    per_layer = layer_activation_bytes(m, cfg.micro_batch, cfg.seq, cfg.tp, cfg.sequence_parallel,
                                       cfg.recompute, prec.act, act, cp=cfg.cp)
    # an engine computing in gathered bf16 parameters (FSDP2's MixedPrecisionPolicy) saves no autocast copies
    autocast = act.name == "suite" and mixed_state == "autocast" and cfg.dtype != "fp32" and eng.autocast_copies
    # the bf16 weight copies: per micro-batch in flight, unless the engine holds one for the step
    # (recomputation reuses it too)
    per_step = autocast and eng.casts_weights_once
    if autocast and cfg.recompute != "full":
        per_layer += _autocast_norm_inputs(m, rank_tokens(cfg), cfg.tp, cfg.sequence_parallel)
        per_layer += 0.0 if per_step else _autocast_weight_copies(m, cfg.tp)
    head = head_activation_bytes(m, cfg.micro_batch, cfg.seq // cfg.cp, cfg.tp, cfg.sequence_parallel, prec.act,
                                 logits_saved=act.name == "table2")
    head_copy = 2 * head_params_local(m, cfg.tp, cfg.pp) if autocast else 0.0  # saved for its backward
    head += 0.0 if per_step else head_copy
    held_for_step = (_autocast_weight_copies(m, cfg.tp) * rank.layers + (head_copy if rank.head_in_flight else 0.0)
                     if per_step else 0.0)
    activations = per_layer * rank.layers_in_flight + rank.head_in_flight * head + held_for_step
    state = model_state(plan, stage, prec)
    peak = step_peak(plan, stage, prec, act, activations, head if rank.head_in_flight else 0.0, state)
    out = {**state, "activation_bytes": activations, "activation_bytes_per_layer": per_layer,
           "transient_bytes": peak - activations}
    out["total_bytes"] = sum(out[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                               "activation_bytes", "transient_bytes"))
    out["peak_mem_bytes"] = peak
    return out


def step_peak(plan, stage: int, prec: Precision, act: ActivationModel, held: float, head_held: float,
              state: dict) -> float:
    """Bytes the step adds to the model state at its peak (the measured `peak_mem_bytes`): the largest
    of the moments the step passes through, less the state the backend frees before them.
    - the loss's backward (last stage): every activation held, the loss's gradients;
    - a block's backward: the activations held (the head's freed), the block's working set (full
      recompute: the block's activations recomputed; context parallel: `context_parallel_bytes`), the gradients backward has already made (the
      head's), gathered parameters, ZeRO-1/2's reduction bucket;
    - ZeRO-3, the end of the forward: the gathered parameters and the all-gather's flat buffer;
    - DeepSpeed's gradient reduction after backward (ZeRO-0 at dp > 1, ZeRO-1/2): the gradients and
      their copy in the reduction bucket (activations freed); ZeRO-3's reduce-scatter of them likewise."""
    cfg, rank, m = plan.cfg, plan.ranks[stage], plan.cfg.model_config
    tokens, zero_partitions = rank_tokens(cfg), engine(cfg).data_parallel == "zero-partitions"
    at_loss, in_blocks = _gathered(plan, stage, prec)
    work = layer_backward_bytes(m, tokens, cfg.tp, prec.act) + context_parallel_bytes(cfg)
    if cfg.recompute == "full":
        work += layer_activation_bytes(m, cfg.micro_batch, cfg.seq, cfg.tp, cfg.sequence_parallel, "none",
                                       prec.act, act, cp=cfg.cp)
    made = head_params_local(m, cfg.tp, cfg.pp) * prec.grad if rank.last and _grads_made_by_backward(cfg) else 0
    bucket = _zero12_bucket_bytes(plan, prec) if zero_partitions and cfg.zero in (1, 2) else 0.0
    moments = [held - head_held + work + made + in_blocks + bucket]  # the head's backward freed its activations
    if rank.last:
        moments.append(held + loss_backward_bytes(m, tokens, cfg.tp) + at_loss)
    if zero_partitions and cfg.zero == 3 and data_ranks(cfg) > 1:
        moments += [held - head_held + _zero3_gather_bytes(plan, stage, prec),
                    _zero3_reduction_bytes(plan, stage, prec)]
    if zero_partitions and (cfg.zero in (1, 2) or (cfg.zero == 0 and data_ranks(cfg) > 1)):
        moments.append(_zero12_reduction_bytes(plan, stage, prec))
    return max(0.0, max(moments) - _released(plan, state))


def _grads_made_by_backward(cfg) -> bool:
    """Whether backward allocates the gradients (the native engine accumulates into its persistent
    flat buckets instead)."""
    return engine(cfg).backward_makes_grads


def _released(plan, state: dict) -> float:
    """Model state freed when the step starts and not made again before its peak: torch optimizers'
    `zero_grad(set_to_none=True)` (ddp, fsdp) frees the gradients, which one micro-batch's backward
    makes again only after its peak (with accumulation the later micro-batches' peaks hold them);
    DeepSpeed makes its gradient partition only at the optimizer step (the previous step's is freed
    when the step starts: `bench.backends.deepspeed`)."""
    freed = engine(plan.cfg).grads_freed
    if freed == "step_start" or (freed == "zero_grad" and plan.cfg.micro_batches == 1):
        return state["grads_bytes"]
    return 0.0


def _gathered(plan, stage: int, prec: Precision) -> tuple[float, float]:
    """Unsharded parameters (and gradients) beside the activations, (at the loss's backward, during a
    block's backward). FSDP2: the root (embeddings, final norm, head) stays gathered from forward
    until after backward (`reshard_after_forward=None`), and from the head's backward on its
    gradients unsharded; each block in backward is gathered with the next one prefetched, and its
    unsharded gradients are reduce-scattered after it (grad-op: every block stays gathered).
    ZeRO-3: the gathered parameters stay resident until backward has used them (`_zero3_resident`)."""
    cfg, layout = plan.cfg, engine(plan.cfg).data_parallel
    if layout == "zero-partitions" and cfg.zero == 3 and data_ranks(cfg) > 1:
        resident = _zero3_resident(plan, stage) * prec.param
        return resident, resident
    if layout != "dim0-shards" or plan.sharding != "params":
        return 0.0, 0.0  # most candidates: decided before the memo's key is built
    return _fsdp_gathered(plan, stage, prec)


@state_memo
def _fsdp_gathered(plan, stage: int, prec: Precision) -> tuple[float, float]:
    """`_gathered` of FSDP2 sharding the parameters."""
    cfg = plan.cfg
    gather_b = 2 if cfg.dtype != "fp32" else prec.param  # FSDP2 gathers in the mixed-precision dtype
    groups = plan.fsdp_groups(stage, 1)
    root = sum(n for kind, n in groups if kind == "root") * gather_b
    block = max((n for kind, n in groups if kind == "block"), default=0)
    if cfg.fsdp == "grad-op":  # every block stays gathered until its backward
        everything = root + sum(n for kind, n in groups if kind == "block") * gather_b
        return everything, everything + block * prec.grad
    return root, root + block * (2 * gather_b + prec.grad)


def _zero3_resident(plan, stage: int) -> float:
    """Elements of the partitioned parameters ZeRO-3 holds gathered at once: every one of the stage's
    when they fit stage3_max_live_parameters and stage3_max_reuse_distance (nothing is released
    between a parameter's forward and its backward), else one prefetch bucket's worth."""
    ds = deepspeed_settings(plan.cfg)
    total = zero3_padded_sums(plan, stage)[1]
    if total <= min(ds["stage3_max_live_parameters"], ds["stage3_max_reuse_distance"]):
        return total
    return min(total, ds["stage3_prefetch_bucket_size"])


@state_memo
def _zero3_gather_bytes(plan, stage: int, prec: Precision) -> float:
    """ZeRO-3 at the end of the forward: the resident gathered parameters and the flat output of the
    largest coalesced all-gather (one prefetch bucket at most), from which they were copied."""
    # the forward's gathers as without recomputation, which changes what backward gathers (model state is
    # cached across recompute modes: STATE_UNREAD)
    flat = max(zero3_gathers(plan, stage, recompute="none").forward, default=0)
    resident = _zero3_resident(plan, stage)
    return (resident + min(flat, resident)) * prec.param


@state_memo
def _zero3_reduction_bytes(plan, stage: int, prec: Precision) -> float:
    """ZeRO-3 reduces in its epilogue after backward (every gradient fits one reduce bucket here, else
    bucket by bucket): the gradients, the flat input reduce_scatter_coalesced builds from them and the
    partitions it returns (1/dp of them), all in the gradients' dtype."""
    n = min(plan.ranks[stage].params, deepspeed_settings(plan.cfg)["reduce_bucket_size"])
    return n * (2 + 1 / data_ranks(plan.cfg)) * prec.grad


@state_memo
def _zero12_reduction_bytes(plan, stage: int, prec: Precision) -> float:
    """ZeRO-0/1/2's gradient reduction (overlap_comm off): the gradients not yet reduced and the
    reduction bucket. ZeRO-0 (its engine's bucketed all-reduce) and ZeRO-1 reduce after backward, so
    every gradient backward made is there; ZeRO-2 reduces (and frees) them bucket by bucket as backward
    makes them. The bucket: ZeRO-1/2's contiguous one (`_zero12_bucket_bytes`), ZeRO-0's a flat copy
    of one bucket's worth of gradients."""
    n = plan.ranks[stage].params
    filled = min(n, deepspeed_settings(plan.cfg)["reduce_bucket_size"])
    bucket = _zero12_bucket_bytes(plan, prec) if plan.cfg.zero in (1, 2) else filled * prec.grad
    return (filled if plan.cfg.zero == 2 else n) * prec.grad + bucket


def _zero12_bucket_bytes(plan, prec: Precision) -> float:
    """ZeRO-1/2 with contiguous_gradients: backward starts by allocating the whole reduction bucket
    (reduce_bucket_size elements, however few gradients fill it; freed after the reduction)."""
    return deepspeed_settings(plan.cfg)["reduce_bucket_size"] * prec.grad


@state_memo
def model_state(plan, stage: int, prec: Precision) -> dict:
    """Model-state bytes of one rank of pipeline stage `stage`, by the rule every backend's
    `Trainer.state_tensors` is measured with: every tensor the rank keeps from one step to the next
    for training, each storage counted once, in the first of params, grads, optimizer that holds it
    (so padding inside a flat buffer counts, and an optimizer-owned copy counts as optimizer)."""
    cfg, layout = plan.cfg, engine(plan.cfg).data_parallel
    if layout == "dim0-shards":  # FSDP2 pads dim 0 of every parameter to a multiple of the shard
        shard = plan.shard if plan.sharding != "none" else 1
        n = sum(n for _, n in plan.fsdp_groups(stage, shard)) / shard
        return _state(n, n, n, prec)
    if layout == "zero-partitions":
        return _deepspeed_state(plan, stage, prec)
    n = plan.ranks[stage].params
    if layout == "flat-buckets" and cfg.zero:
        # flat fp32 buckets padded to a multiple of dp: the parameters are views of one, their
        # gradients of another; the optimizer steps on this rank's 1/dp of the parameter buffer in
        # place (no copy: the engine keeps fp32 weights under autocast too), so it owns only Adam's m, v
        padded, edp = plan.padded_buckets(stage), data_ranks(cfg) // cfg.ep
        experts = padded_total(plan.expert_buckets(stage), edp)  # sharded over edp (ep > 1)
        return _state(padded + experts, padded + experts, padded / data_ranks(cfg) + experts / edp, prec)
    dp_, dg, do = plan.state_divisors
    return _state(n / dp_, n / dg, n / do, prec)


def _state(params: float, grads: float, optimizer: float, prec: Precision) -> dict:
    """Bytes from the element counts each kind of state holds."""
    return {"params_bytes": params * prec.param, "grads_bytes": grads * prec.grad,
            "optimizer_bytes": optimizer * prec.optimizer}


def _deepspeed_state(plan, stage: int, prec: Precision) -> dict:
    """DeepSpeed 0.19's own tensors (stage_1_and_2.py, stage3.py), counted by `model_state`'s rule.
    DeepSpeed frees gradients after its optimizer step, so its gradients are the ones its optimizer
    steps on, taken when the wrapped torch optimizer's step runs (`bench.backends.deepspeed`):
    - ZeRO-0: the module's parameters and their gradients, Adam's m and v (plain data parallel);
      under mixed precision an fp32 master copy of every parameter, with an fp32 gradient; but with a
      pipeline in bf16 its BF16_Optimizer partitions the master over dp, as ZeRO-1 does.
    - ZeRO-1/2: the module's parameters are views of one flat low-precision buffer padded to 2·dp
      elements; the optimizer steps on an fp32 copy of this rank's 1/dp of it (a copy even in fp32)
      with an fp32 gradient of that size: params pad(N), grads pad(N)/dp in fp32, optimizer
      pad(N)/dp × (4 master + 8 Adam). The full-size gradients backward produces (and the ipg
      buckets they are reduced through) are freed at the step: step memory, not model state.
    - ZeRO-3: each parameter padded to a multiple of dp and partitioned; those at or below the
      persistence threshold are also kept whole on every rank (at dp = 1 the partition is the
      parameter itself, one copy). The optimizer's fp32 partition copy, its gradient and Adam's
      m, v as at ZeRO-1/2.
    Mixed precision: low-precision parameters (`prec.param`), fp32 master, gradient partition and Adam."""
    cfg, n, dp = plan.cfg, plan.ranks[stage].params, data_ranks(plan.cfg)
    adam, fp32 = 8, 4
    if cfg.zero == 0 and not deepspeed_bf16_optimizer(cfg):  # mixed: whole fp32 masters and grads
        return {"params_bytes": n * prec.param, "grads_bytes": n * fp32, "optimizer_bytes": n * prec.optimizer}
    if cfg.zero < 3:
        params = zero12_padded(int(n), dp)
        part = params / dp
    else:
        kept, _ = deepspeed_zero3_split(plan, stage)
        part = sum(zero3_padded_sums(plan, stage)) / dp
        params = part + (sum(kept) if dp > 1 else 0)  # dp = 1: the partition is the whole parameter
    return {"params_bytes": params * prec.param, "grads_bytes": part * fp32,
            "optimizer_bytes": part * (fp32 + adam)}


def model_state_bytes(params: float, dp: int = 1, zero: int = 0, dtype: str = "bf16-mixed",
                      mixed_state: str = "zero") -> dict:
    """Model-state bytes per device for `params` parameters (ZeRO paper §3.1/§5, `--params` mode)."""
    prec = precision(dtype, mixed_state)
    div = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[zero]
    out = {"params_bytes": params * prec.param / div[0], "grads_bytes": params * prec.grad / div[1],
           "optimizer_bytes": params * prec.optimizer / div[2]}
    out["total_bytes"] = sum(out.values())
    return out
