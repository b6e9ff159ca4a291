"""Step time of one config on one hardware profile, term by term. Pure maths over a StagePlan.

Per pipeline rank and micro-batch, each chunk's forward and backward cost (per tp rank):
    matmuls     FLOPs of each GEMM / the rate its shape gets: the calibrated curve (FLOP/s by FLOP per
                matrix and dtype; a batched GEMM runs as that many small ones), else peak × large-GEMM
                efficiency × tile and wave quantisation, and never faster than reading and writing
                its operands at the memory bandwidth
    memory      bytes that elementwise and norm kernels read and write / memory bandwidth, and the MLP
                activation's bytes / its own calibrated rate (compute-bound on a CPU)
    gradients   this suite's engines: each fp32 gradient zeroed once a step and accumulated into by
                every micro-batch's backward (native: copied in by the first, added by the others),
                as memory-bound bytes
    casts       mixed precision under torch.autocast: every forward casts the layer's fp32 weights to
                bf16, except in the native engine, which casts them once a step (its cast cache lives
                for the whole step: `bench.native.pipeline`)
    overhead    ops × per-op dispatch cost (calibrated; 0 on GPU, where launches run ahead of the device)
    recompute   full: the layer's forward again in backward; selective: its attention core
    tp          every tp collective of the micro-batch, on the critical path (no overlap)
    cp          context parallel: every GEMM and kernel on the rank's s/cp tokens; the attention core in
                zig-zag half blocks (`context_parallel_core`) or, under Ulysses, the whole sequence on
                heads/cp; ring passes hidden behind a ring step where the step is longer (`cp_exposed`),
                Ulysses' all-to-alls exposed
    pp          one send per chunk boundary crossed, forward and backward, on the critical path
Backward costs twice the forward's matmuls and memory traffic (gradients of inputs and of weights).
Ranks that outnumber the cores slow compute by the calibrated oversubscription factor, ranks that
share one memory slow memory-bound work (and the optimizer) by the calibrated memory contention, and
a calibrated profile's composition factor (a reference block measured / modelled) scales compute.

Per step (the busiest pipeline rank sets the pace):
    busy        m × Σ its chunks' (forward + backward + tp + pp)
    bubble      busy × idle/busy of the shared schedule simulator (bench.schedule) for the schedule run
    dp exposed  per backend, as it runs: once-per-step gradient reductions overlap the last
                micro-batch's backward where the backend buckets them (native, ddp, fsdp) and the last
                bucket is always exposed; DeepSpeed reduces after backward (exposed); per-micro-batch
                ZeRO-3/FSDP gathers are prefetched one layer ahead, exposed where a layer's compute is
                shorter than its gather, and the first gather always. On a CPU whose cores the ranks
                fill, nothing overlaps (gloo runs on the ranks' cores: `can_overlap`)
    optimizer   local optimizer-state parameters × cost per parameter + tensors × cost per tensor
                (calibrated), else Adam's bytes over the memory bandwidth
    step        busy + bubble + dp exposed + optimizer + per-step tp/pp collectives

Implementations (`impl`): "table2" is Megatron-LM as in Korthikanti et al. 2022 (fused softmax and
dropout, bias-dropout-add; the activations of its Table 2), "suite" is this suite's GPT (no dropout,
torch.autocast casts). The attention kernel is a knob of its own (`attention`): "flash", a fused kernel
(flash / SDPA) that skips the causal mask's half and keeps the scores on chip, or "unfused", the scores
materialised (QKᵀ, then softmax, then AV), as Korthikanti et al.'s Megatron-LM ran it; None: the
implementation's own (table2: unfused, suite: flash).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from bench.analysis.comm import Traffic, stage_traffic
from bench.analysis.hardware import Hardware
from bench.analysis.memory import precision, rank_tokens
from bench.analysis.params import data_ranks
from bench.capabilities import engine
from bench.conventions import dtype_key, grad_bytes, wire_bytes
from models.config import block_matmul_weights

TERMS = ("compute_s", "overhead_s", "comm_exposed_tp_s", "comm_exposed_cp_s", "comm_exposed_ep_s", "comm_exposed_pp_s",
         "comm_exposed_dp_s",
         "bubble_s", "optimizer_s")
"""The step's additive terms (step_time_s is their sum)."""

# Aten ops one block of this suite's GPT dispatches (counted under TorchDispatchMode: tests/test_time_model.py).
SUITE_OPS = {"fp32": (33, 61), "bf16": (39, 69), "fp16": (39, 69)}  # (forward, backward): autocast casts to
# either half type through the same ops
# Megatron-LM's fused kernels per layer, forward: 2 layernorms, 4 GEMMs + 2 batched GEMMs, fused
# softmax, dropout, bias-gelu, 2 bias-dropout-adds (backward ≈ twice).
TABLE2_OPS = (12, 24)
# One optimizer step of mixed-precision Adam, bytes per parameter: the gradient norm reads the fp32
# gradient (4); Adam reads weight, gradient, m, v and writes weight, m, v (28); the fp32 weight is cast
# to the low-precision copy (4 + 2); the gradient buffer is zeroed (4).
ADAM_BYTES_PER_PARAM = 42
GPU_SMS = {"a100-80gb": 108, "h100-sxm": 132, "h200": 132}  # streaming multiprocessors (datasheets)
TILE = (128, 256)  # output tile of the large bf16 GEMM kernels cuBLAS picks (M × N)


@dataclass(frozen=True)
class Matmul:
    m: int
    k: int
    n: int
    batch: int = 1
    dtype: str | None = None  # None: the config's; "fp32" for work an implementation does in fp32

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.batch


def matmul_time(mm: Matmul, hw: Hardware, dtype: str, elem: int) -> float:
    if mm.dtype is not None:
        dtype, elem = mm.dtype, 4
    key = dtype_key(dtype)
    cal = hw.calibration
    if cal is not None:  # a batched GEMM runs as `batch` small ones: the rate of one of them
        return mm.flops / cal.matmul_rate(key, mm.flops / mm.batch)
    sms = GPU_SMS.get(hw.name)
    quant = 1.0
    if sms:  # output tiles run in waves of one tile per SM: a partial last wave idles the rest
        tiles = ceil(mm.m / TILE[0]) * ceil(mm.n / TILE[1]) * mm.batch
        quant = tiles / (ceil(tiles / sms) * sms)
        quant *= (mm.m * mm.n) / (ceil(mm.m / TILE[0]) * TILE[0] * ceil(mm.n / TILE[1]) * TILE[1])
    rate = hw.peak(dtype) * hw.large_matmul_efficiency * quant
    compute = mm.flops / rate
    traffic = elem * (mm.m * mm.k + mm.k * mm.n + mm.m * mm.n) * mm.batch
    return max(compute, traffic / hw.memory_bw) if hw.memory_bw else compute


@dataclass(frozen=True)
class Work:
    """One pass of some part of the model on one tp rank: GEMMs, memory-bound bytes, ops, and the bytes
    the MLP activation and the loss's softmax read and write (exp/tanh-bound on a CPU: each at its own
    calibrated rate)."""

    matmuls: tuple[Matmul, ...] = ()
    bytes: float = 0.0
    ops: int = 0
    act_bytes: float = 0.0
    loss_bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.matmuls + other.matmuls, self.bytes + other.bytes, self.ops + other.ops,
                    self.act_bytes + other.act_bytes, self.loss_bytes + other.loss_bytes)


def backward_gemms(mms) -> tuple[Matmul, ...]:
    """Each GEMM (M×K)·(K×N) needs two in backward: the input gradient (M×N)·(N×K) and the weight
    gradient (K×M)·(M×N)."""
    return tuple(g for mm in mms for g in (Matmul(mm.m, mm.n, mm.k, mm.batch, mm.dtype),
                                           Matmul(mm.k, mm.m, mm.n, mm.batch, mm.dtype)))


def layer_work(cfg, impl: str, attention: str | None = None) -> tuple[Work, Work, Work]:
    """(forward, backward, attention core forward) of one transformer layer for one micro-batch on one
    tp rank. Memory-bound bytes count what each kernel reads and writes: forward y = f(x) reads x and
    writes y; backward reads x (or y) and dy and writes dx."""
    attention = attention or own_attention(impl)
    mc, t = cfg.model_config, cfg.tp
    b, s, h, f = cfg.micro_batch, cfg.seq, mc.hidden, mc.ffn_hidden
    bs, hd, heads = rank_tokens(cfg), mc.head_dim, mc.heads // t  # context parallel: s/cp tokens a rank
    e = precision(cfg.dtype).act
    gemms = (Matmul(bs, h, mc.qkv_out // t), Matmul(bs, h // t, h), Matmul(bs, h, mc.fc1_out // t), Matmul(bs, f // t, h))
    x = bs * h / (t if cfg.sequence_parallel else 1)  # norms and residual adds run on sequence shards
    ffn = bs * f / t
    ring = cfg.cp > 1 and cfg.cp_comm == "ring"
    if cfg.cp > 1 and cfg.cp_comm == "ulysses":  # after its all-to-all: the whole sequence, 1/cp of the heads
        heads //= cfg.cp
    fused_core = (Matmul(s, hd, s // 2, b * heads), Matmul(s, s // 2, hd, b * heads))  # causal: half the blocks
    if impl == "table2":  # Megatron-LM: fused kernels, dropout masks of 1 byte
        scores = b * heads * s * s  # unfused: scores materialised (QKᵀ, then AV)
        core = (Matmul(s, hd, s, b * heads), Matmul(s, s, hd, b * heads))
        if attention == "flash":  # the scores never leave the kernel
            core, scores = fused_core, 0
        if ring:  # TE's ring (Megatron's CP needs it): causal, zig-zag balanced, in half blocks, fused (the
            core, scores = context_parallel_core(cfg, impl)[0], 0  # scores never leave the kernel)
        soft_f = 2 * e * scores + (2 * e + 1) * scores  # scale-mask-softmax; dropout
        soft_b = 3 * e * scores + (2 * e + 1) * scores
        fwd = Work(gemms + core, 2 * 2 * e * x + 2 * (3 * e + 1) * x + 2 * e * ffn + soft_f, TABLE2_OPS[0])
        bwd = Work(backward_gemms(gemms + core), 2 * 3 * e * x + 2 * (2 * e + 1) * x + 3 * e * ffn + soft_b,
                   TABLE2_OPS[1])
        return fwd, bwd, Work(core, soft_f)
    # suite: fp32 residual stream and norms, autocast casts of the norm outputs and the weights; flash
    # attention skips the masked half of the score blocks, unfused writes the scores and their softmax
    core, scores = fused_core, 0
    if attention == "unfused":
        core, scores = (Matmul(s, hd, s, b * heads), Matmul(s, s, hd, b * heads)), b * heads * s * s
    core_f = Work(core, 2 * e * scores)  # the softmax reads and writes the scores
    core_b = Work(backward_gemms(core), 3 * e * scores)
    if ring:
        core_f, core_b = ring_core_work(cfg)
    low = dtype_key(cfg.dtype) != "fp32"
    casts = 2 * x * 6 if low else 0  # the norm outputs (read fp32, write bf16), forward; their gradients back
    ops = SUITE_OPS[dtype_key(cfg.dtype)]
    fwd = Work(gemms, 2 * 2 * 4 * x + 2 * 3 * 4 * x + casts, ops[0], act_bytes=2 * e * ffn) + core_f
    bwd = Work(backward_gemms(gemms), 2 * 3 * 4 * x + 2 * 2 * 4 * x + casts + weight_cast_bytes(cfg),
               ops[1], act_bytes=3 * e * ffn) + core_b  # each bf16 weight gradient cast back to fp32
    return fwd, bwd, core_f


RING_BYTES_PER_SCORE = (28, 44)
"""fp32 bytes this suite's ring attention reads and writes per score element of a block beyond its GEMMs
(bench.context_parallel, counted from its code): forward the scale (8), log-sum-exp (4), subtracting it
(8) and exp (8); backward the scale, subtracting the saved log-sum-exp, exp, subtracting rowsum(dO∘O)
(8 each) and the product with the probabilities (12)."""


def ring_core_work(cfg) -> tuple[Work, Work]:
    """(forward, backward) of this suite's ring attention on one rank per micro-batch
    (`context_parallel_core`): its backward recomputes each block's scores (one more QKᵀ) beside the
    four GEMMs of the gradients."""
    core, scores = context_parallel_core(cfg, "suite")
    fwd_b, bwd_b = RING_BYTES_PER_SCORE
    return Work(core, fwd_b * scores), Work(backward_gemms(core) + core[:1], bwd_b * scores)


RING_MATH = "fp32"
"""The dtype this suite's ring attention computes its blocks in (bench.context_parallel: fp32 merges and
GEMMs, whatever the inputs' dtype)."""


def context_parallel_core(cfg, impl: str) -> tuple[tuple[Matmul, Matmul], int]:
    """(QKᵀ and PV GEMMs, score elements) of one rank's attention core under context parallel, per
    micro-batch. The zig-zag layout (Megatron's DualChunkSwap, Llama 3 §3.3.2) cuts the sequence into 2·cp
    chunks and gives rank r chunks r and 2·cp−1−r, so every rank attends the same share of the causal
    triangle; the work runs in half blocks of chunk × chunk (chunk = s / 2cp). TE's kernels (`table2`,
    Megatron's CP) compute 2·cp of them, the diagonal ones causally, in the config's dtype. This suite's
    ring (`suite`, bench.context_parallel) skips the blocks no key of which is visible and computes the
    rest whole: 2 per step off the diagonal, 3 on it, 2·cp + 1 in all, in fp32 (its blocks' math)."""
    m, c = cfg.model_config, cfg.cp
    chunk, hd, rows = cfg.seq // (2 * c), m.head_dim, cfg.micro_batch * (m.heads // cfg.tp)
    blocks, dtype = (2 * c, None) if impl == "table2" else (2 * c + 1, RING_MATH)
    batch = rows * blocks
    return (Matmul(chunk, hd, chunk, batch, dtype), Matmul(chunk, chunk, hd, batch, dtype)), batch * chunk * chunk


def weight_cast_bytes(cfg) -> float:
    """One layer's matmul weights cast between fp32 and bf16 (read 4, write 2 bytes each) on one tp
    rank: under torch.autocast, the weights forward and their gradients backward."""
    if dtype_key(cfg.dtype) == "fp32":
        return 0.0
    return 6 * block_matmul_weights(cfg.model_config) / cfg.tp


def own_attention(impl: str) -> str:
    """The attention kernel an implementation runs unless told: Megatron-LM of Korthikanti et al.'s
    unfused, this suite's SDPA fused."""
    return "unfused" if impl == "table2" else "flash"


def casts_weights_once(cfg, impl: str) -> bool:
    """Whether the engine keeps autocast's weight copies for the step (the native one); the others cast
    every forward."""
    return impl == "suite" and engine(cfg).casts_weights_once


LOSS_BYTES_PER_LOGIT = 3 * 4
"""The cross-entropy's forward, and again its backward, reads and writes the fp32 logits ~3 times."""


def head_work(cfg) -> Work:
    """The last chunk's head GEMM and cross-entropy (forward; the backward moves the same loss bytes)."""
    mc = cfg.model_config
    bs = rank_tokens(cfg)
    return Work((Matmul(bs, mc.hidden, mc.vocab // cfg.tp),), 0.0, 6,
                loss_bytes=LOSS_BYTES_PER_LOGIT * bs * mc.vocab / cfg.tp)


def embed_work(cfg) -> Work:
    bs = rank_tokens(cfg)
    return Work((), 3 * bs * cfg.model_config.hidden * 4, 4)


def embed_backward_work(cfg) -> Work:
    """The embedding's backward: the token rows' gradients scattered into a dense gradient of the whole
    (vocab-parallel) table, which is zero-filled first (4 bytes an entry), and the learned positions'
    likewise."""
    mc = cfg.model_config
    rows = mc.vocab // cfg.tp + (cfg.seq if mc.position == "learned" else 0)
    return Work((), 2 * embed_work(cfg).bytes + 4 * rows * mc.hidden)


class Device:
    """The profile's costs as the time model reads them."""

    def __init__(self, hw: Hardware, cfg):
        self.hw, self.cfg = hw, cfg
        cal = hw.calibration
        self.slow = cal.slowdown(cfg.world) if cal else 1.0
        self.mem_slow = cal.memory_slowdown(cfg.world) if cal else 1.0  # the ranks share one memory
        self.composed = cal.composition if cal else 1.0  # kernels in a step vs alone (bench calibrate)
        self.bw = (cal.memory_bw if cal else hw.memory_bw) or 0.0
        activation = "swiglu" if cfg.model_config.activation == "swiglu" else "gelu"
        self.act_bw = cal.activation_bw.get(activation, self.bw) if cal else self.bw
        self.loss_bw = cal.activation_bw.get("cross_entropy", self.bw) if cal else self.bw
        self.op_s = cal.op_overhead_s if cal else 0.0
        self.elem = precision(cfg.dtype).act

    def compute(self, w: Work) -> float:
        mm = sum(matmul_time(m, self.hw, self.cfg.dtype, self.elem) for m in w.matmuls)
        if not self.bw:
            return mm * self.slow * self.composed
        bound = w.bytes / self.bw * self.mem_slow  # memory-bound: slowed by the ranks sharing the memory
        exps = w.act_bytes / self.act_bw + w.loss_bytes / self.loss_bw  # compute-bound, like the matmuls
        return ((mm + exps) * self.slow + bound) * self.composed

    def overhead(self, w: Work) -> float:
        return w.ops * self.op_s * self.slow


def collective_time(tr: Traffic, hw: Hardware, links: dict, ranks: int) -> float:
    """One op: its time for that payload and group size on the calibrated curve measured with `ranks`
    ranks running (the run's world), else the ring over its dimension's link, links[dim] = (bandwidth,
    latency): latency per hop, 2(n−1) hops for all-reduce, n−1 for gather/scatter, + wire bytes / bw."""
    n = tr.group
    if n <= 1 or tr.kind == "recv":
        return 0.0
    measured = hw.calibration and hw.calibration.collective_seconds(tr.kind, n, tr.payload, ranks)
    if measured:
        return measured
    bw, latency = links[tr.dim]
    hops = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}.get(tr.kind, 1)
    if tr.kind == "all_to_all":  # each rank keeps 1/n of its input and sends the rest, one part per peer
        return hops * latency + (n - 1) / n * tr.payload / bw
    return hops * latency + wire_bytes(tr.kind, tr.payload, n) / bw


def collectives_time(items, hw: Hardware, links: dict, ranks: int) -> float:
    """Seconds of every op of `items` (Traffic), one after another."""
    return sum(collective_time(tr, hw, links, ranks) * tr.ops for tr in items)


@dataclass(frozen=True)
class StageTime:
    """One pipeline rank's costs per step (seconds)."""

    compute: float  # m × its chunks' forward + backward (+ recompute) work
    overhead: float
    tp: float  # per-micro-batch tp collectives, all micro-batches
    pp: float  # sends on the critical path, all micro-batches
    last_backward: float  # one micro-batch's backward of the whole rank (hides the step's reduction)
    traffic: tuple  # its Traffic
    cp: float = 0.0  # context parallel's exposed passes and all-to-alls, all micro-batches

    @property
    def busy(self) -> float:
        return self.compute + self.overhead + self.tp + self.cp + self.pp


@dataclass(frozen=True)
class PartCosts:
    """Seconds of one micro-batch on one tp rank: a layer's forward and backward (with recomputation),
    the embedding's and the head's, and the ops of each (for the overhead)."""

    layer_f: float
    layer_b: float
    layer_ops: int
    embed_f: float
    embed_b: float
    head_f: float
    head_b: float
    head_ops: int
    core_f: float = 0.0  # the attention core's forward and backward, inside layer_f and layer_b
    core_b: float = 0.0


_COSTS: dict = {}


def part_costs(cfg, hw: Hardware, impl: str, attention: str | None = None) -> PartCosts:
    """Cached per (profile, shape of the work): the planner asks for the same layers thousands of times."""
    once = casts_weights_once(cfg, impl)
    attention = attention or own_attention(impl)
    key = (id(hw), cfg.model_config, cfg.tp, cfg.cp, cfg.cp_comm, cfg.micro_batch, cfg.seq, cfg.sequence_parallel,
           cfg.dtype, cfg.recompute, cfg.world, impl, attention, once)
    hit = _COSTS.get(key)
    if hit is not None and hit[0] is hw:  # the profile is held by the entry: its id cannot be reused
        return hit[1]
    dev = Device(hw, cfg)
    fwd, bwd, core = layer_work(cfg, impl, attention)
    if impl == "suite" and not once:
        fwd += Work((), weight_cast_bytes(cfg))
    redo = {"none": Work(), "selective": core, "full": fwd}[cfg.recompute]
    embed, head = embed_work(cfg), head_work(cfg)
    costs = PartCosts(dev.compute(fwd), dev.compute(bwd) + dev.compute(redo), fwd.ops + bwd.ops + redo.ops,
                      dev.compute(embed), dev.compute(embed_backward_work(cfg)), dev.compute(head),
                      dev.compute(Work(backward_gemms(head.matmuls), loss_bytes=head.loss_bytes)), 3 * head.ops,
                      *(_core_seconds(cfg, impl, core, dev) if cfg.cp > 1 else ()))
    if len(_COSTS) > 65536:
        _COSTS.clear()
    _COSTS[key] = (hw, costs)
    return costs


def _core_seconds(cfg, impl: str, core: Work, dev: Device) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's attention core: the windows its ring passes hide behind."""
    ring = impl == "suite" and cfg.cp_comm == "ring"
    backward = ring_core_work(cfg)[1] if ring else Work(backward_gemms(core.matmuls), 2 * core.bytes)
    return dev.compute(core), dev.compute(backward)


def rank_passes(rank, c: PartCosts) -> tuple[float, float, int]:
    """(forward seconds, backward seconds, ops) of one micro-batch through a pipeline rank's chunks."""
    f, b, ops = rank.layers * c.layer_f, rank.layers * c.layer_b, rank.layers * c.layer_ops
    if rank.first:
        f, b, ops = f + c.embed_f, b + c.embed_b, ops + 12
    if rank.last:
        f, b, ops = f + c.head_f, b + c.head_b, ops + c.head_ops
    return f, b, ops


def step_time_floor(plan, hw: Hardware, impl: str = "table2", attention: str | None = None) -> float:
    """A lower bound of `step_terms`' step time without its traffic, optimizer or bubble: the busiest
    planned rank's micro-batch compute (every other term, the once-a-step upkeep and the bubble only add
    to it). The planner times a candidate only when this bound could still reach its top; 1e-9 below,
    so that no rounding can put it above the step time."""
    c, m = part_costs(plan.cfg, hw, impl, attention), plan.cfg.micro_batches
    return max(m * (f + b) for f, b, _ in (rank_passes(rank, c) for rank in plan.ranks.values())) * (1 - 1e-9)


def stage_time(plan, stage: int, hw: Hardware, links: dict, impl: str, mixed_state: str,
               attention: str | None = None) -> StageTime:
    cfg, rank = plan.cfg, plan.ranks[stage]
    m, c = cfg.micro_batches, part_costs(plan.cfg, hw, impl, attention)
    f, b, ops = rank_passes(rank, c)
    traffic = tuple(stage_traffic(plan, stage, mixed_state))
    if impl == "table2":
        traffic = megatron_traffic(cfg, rank, traffic)
    per_mb = [tr for tr in traffic if tr.per == "micro-batch"]
    tp = collectives_time([tr for tr in per_mb if tr.dim == "tp"], hw, links, cfg.world)
    pp = collectives_time([tr for tr in per_mb if tr.dim == "pp"], hw, links, cfg.world)
    cp = cp_exposed(cfg, [tr for tr in per_mb if tr.dim == "cp"], c, hw, links)
    dev = Device(hw, cfg)
    upkeep = dev.compute(step_upkeep(cfg, rank, impl, traffic))
    return StageTime(m * (f + b) + upkeep, m * dev.overhead(Work((), 0, ops)), tp, pp, b, traffic, cp)


def ep_exposed(cfg, st: "StageTime", hw: Hardware, links: dict) -> float:
    """Seconds of expert parallel's all-to-alls (all micro-batches): every one exposed, since the
    dispatch waits for its tokens and the experts for the dispatch (bench.expert_parallel overlaps none)."""
    return collectives_time([tr for tr in st.traffic if tr.dim == "ep"], hw, links, cfg.world)


def cp_exposed(cfg, items, c: PartCosts, hw: Hardware, links: dict) -> float:
    """Seconds of context parallel's traffic (all micro-batches) not hidden behind the attention core.
    A ring pass posted before a ring step and waited after it (`Traffic.behind`) hides behind that step,
    1/cp of the core's forward or backward: exposed where its transfer is longer, i.e. where a step's
    attention is too short (ring attention's overlap condition, Liu et al. 2023, "Ring Attention with
    Blockwise Transformers", §3: a block's compute must outlast its K/V transfer; for a balanced step
    NOTES-cp §2's s/cp ≥ g·β·F/B_cp).
    Every other op (the suite ring's backward passes, Ulysses' all-to-alls) waits in full; on a CPU
    whose cores the ranks fill nothing hides (`can_overlap`)."""
    window = {"forward": c.core_f / cfg.cp, "backward": c.core_b / cfg.cp}
    overlap = can_overlap(cfg, hw)
    exposed = 0.0
    for tr in items:
        each = collective_time(tr, hw, links, cfg.world)
        exposed += tr.ops * (max(0.0, each - window[tr.behind]) if tr.behind and overlap else each)
    return exposed


def step_upkeep(cfg, rank, impl: str, traffic: tuple = ()) -> Work:
    """Memory-bound work once a step, beyond the micro-batches': the gradients' own upkeep and the
    backend's copies around its collectives (`backend_copy_bytes`). Autograd hands the first
    micro-batch's fp32 gradient over as is and adds every later one into it (read both, write: 12
    bytes a parameter); the native engine copies the first into its bucket (8) and adds the others,
    and casts its weights to bf16 once (under mixed precision). Megatron-LM (`table2`) fuses the
    accumulation into the weight-gradient GEMM."""
    if impl != "suite":
        return Work()
    m, n, eng = cfg.micro_batches, rank.params, engine(cfg)
    if not eng.backward_makes_grads:  # accumulated into persistent buckets: the first copied in
        casts = rank.layers * weight_cast_bytes(cfg) if casts_weights_once(cfg, impl) else 0.0
        return Work((), (12 * m - 4) * n + casts)
    # from that ZeRO stage on (DeepSpeed: 2) gradients accumulate into the rank's partition
    partitioned = eng.partition_accumulation_from is not None and cfg.zero >= eng.partition_accumulation_from
    accumulate = (12 / data_ranks(cfg) if partitioned else 12) * (m - 1)
    return Work((), accumulate * n + backend_copy_bytes(cfg, n, traffic))


def shard_copy_factor(n: int) -> float:
    """Bytes copied per byte all-gathered or reduce-scattered over n ranks: the local shard copied in or
    out (read and write 1/n), and the whole buffer copied out to the parameters or in from the
    gradients (read and write 1)."""
    return 2 + 2 / n


def backend_copy_bytes(cfg, params: float, traffic: tuple) -> float:
    """Bytes the backend reads and writes per step copying around its data-parallel collectives (a
    GPU's memory bandwidth, a CPU core's time): FSDP2 around each parameter all-gather and gradient
    reduce-scatter (`shard_copy_factor`); DDP, and FSDP2's replicate, divide each gradient into its
    bucket and copy the reduced bucket back (4 × the bucket); an engine that declares its copies
    (`Engine.copy_bytes`, DeepSpeed's: bench.capabilities.DEEPSPEED_COPY_BYTES) by those."""
    dp = [tr for tr in traffic if tr.dim == "dp"]
    gathers = sum(shard_copy_factor(tr.group) * tr.total for tr in dp
                  if tr.kind == "all_gather" and tr.per == "micro-batch")
    declared = engine(cfg).copy_bytes
    if declared:
        n = data_ranks(cfg)
        if n == 1 and not cfg.zero:
            return 0.0
        a, b, c = declared[cfg.zero]
        rounds = cfg.micro_batches if cfg.zero >= 2 else 1
        per_param = (a + b / n) * rounds * grad_bytes(cfg) / 4 + c / n
        return per_param * params + (gathers if cfg.zero == 3 else 0.0)
    scatters = sum(shard_copy_factor(tr.group) * tr.total for tr in dp if tr.kind == "reduce_scatter")
    buckets = sum(4 * tr.total for tr in dp if tr.kind == "all_reduce" and tr.what == "gradients")
    return gathers + scatters + buckets  # HSDP's all-reduce of its reduced shards runs in place


def megatron_traffic(cfg, rank, traffic: tuple) -> tuple:
    """What Megatron-LM moves beyond this suite's native engine (which counts what it runs itself):
    without sequence parallel its pipeline sends 1/t of each activation and all-gathers it over the
    tp group on arrival (PTD-P §4.1, scatter/gather); with it, backward all-gathers the sequence-sharded
    inputs of the qkv, fc1 and head GEMMs again for their weight gradients (they are not kept gathered); full
    recomputation re-runs every forward collective of the layer."""
    t, out = cfg.tp, []
    for tr in traffic:
        if tr.dim == "pp" and tr.kind == "send" and not cfg.sequence_parallel and t > 1:
            out += [Traffic("pp", "send", tr.payload / t, tr.ops, tr.group, tr.what, tr.per),
                    Traffic("tp", "all_gather", tr.payload, tr.ops, t, "scatter/gather of a pipeline send")]
        else:
            out.append(tr)
    x = rank_tokens(cfg) * cfg.model_config.hidden * precision(cfg.dtype).comm_fwd
    if cfg.sequence_parallel and t > 1:
        gemms = 2 * rank.layers + (1 if rank.last else 0)  # qkv and fc1 of each layer, the head
        out.append(Traffic("tp", "all_gather", x, gemms * cfg.micro_batches, t, "re-gathered GEMM inputs"))
    if cfg.recompute == "full" and t > 1:  # its checkpoint re-runs the whole layer, the MLP's exit collective
        exit_op = "reduce_scatter" if cfg.sequence_parallel else "all_reduce"  # too (the native engine's stops before)
        out.append(Traffic("tp", exit_op, x, rank.layers * cfg.micro_batches, t, "recomputed MLP exit"))
    if cfg.cp > 1 and cfg.cp_comm == "ring":
        out = _te_ring(cfg, rank, out)
    return tuple(out)


def _te_ring(cfg, rank, traffic: list) -> list:
    """Megatron's CP ring (TE `AttnFuncWithCPAndKVP2P`, NOTES-cp §1.1) in place of this suite's: the same
    forward passes, and a backward of cp − 1 passes each carrying K/V and dK/dV in the K/V dtype
    (2(cp−1)·KV_r in all), each posted before a ring step's backward and hidden behind it."""
    ring = [tr for tr in traffic if tr.dim == "cp"]
    kv = next(tr.payload for tr in ring if tr.behind == "forward")  # KV_r·β
    passes = (cfg.cp - 1) * rank.layers * cfg.micro_batches
    te = [tr for tr in ring if tr.behind == "forward"] + [
        Traffic("cp", "send", 2 * kv, passes, cfg.cp, "K/V and dK/dV round the ring (bwd)", behind="backward")]
    return [tr for tr in traffic if tr.dim != "cp"] + te


def can_overlap(cfg, hw: Hardware) -> bool:
    """Communication hides behind compute only where something else runs it: a GPU's copy engines and
    NCCL's own SMs, or a CPU core no rank computes on. Gloo moves the bytes on the ranks' own cores, so
    when the ranks fill the machine's cores the collective takes its time from compute."""
    cal = hw.calibration
    if cal is None or cal.machine.get("device", "cpu") != "cpu":
        return True
    return cfg.world < int(cal.machine.get("cores") or 1)


def dp_exposed(cfg, st: StageTime, hw: Hardware, links: dict) -> float:
    """Data-parallel time not hidden behind compute (see the module docstring)."""
    items = [tr for tr in st.traffic if tr.dim == "dp"]
    gathers = collectives_time([tr for tr in items if tr.per == "micro-batch"], hw, links, cfg.world)
    ops_mb = sum(tr.ops for tr in items if tr.per == "micro-batch")
    exposed = 0.0
    if gathers:  # prefetched one layer ahead: the first is exposed, each other one beyond its layer's compute
        per_gather, behind = gathers / ops_mb, st.compute / ops_mb
        exposed = per_gather + (ops_mb - 1) * max(0.0, per_gather - behind)
    if gathers and not can_overlap(cfg, hw):
        exposed = gathers
    step = [tr for tr in items if tr.per == "step"]
    total = collectives_time(step, hw, links, cfg.world)
    if not total:
        return exposed
    if engine(cfg).reduces_after_backward or not can_overlap(cfg, hw):  # at the accumulation boundary
        return exposed + total
    last = max(collective_time(tr, hw, links, cfg.world) for tr in step)  # the last bucket waits for the last layer
    return exposed + max(last, total - st.last_backward)


def optimizer_tensors(plan, stage: int) -> int:
    """Tensors the rank's optimizer steps: DeepSpeed's ZeRO keeps one flat partition, the native
    engine's ZeRO-1 one shard per gradient bucket, the others one per parameter (FSDP: its shard)."""
    cfg, steps = plan.cfg, engine(plan.cfg).optimizer_steps
    if steps == "partition" and cfg.zero:
        return 1
    if steps == "bucket-shards" and cfg.zero and data_ranks(cfg) > 1:
        buckets, sp = plan.buckets(stage)
        return len(buckets) + bool(sp)
    return len(plan.param_sizes(stage))


def optimizer_time(plan, stage: int, hw: Hardware) -> float:
    rank = plan.ranks[stage]
    n = rank.params / plan.state_divisors[2]
    cal = hw.calibration
    if cal is not None:
        per_tensor = optimizer_tensors(plan, stage) * cal.optimizer_s_per_tensor
        world = plan.cfg.world  # Adam streams its state: memory-bound, its tensors' host cost is compute
        return n * cal.optimizer_s_per_param * cal.memory_slowdown(world) + per_tensor * cal.slowdown(world)
    return n * ADAM_BYTES_PER_PARAM / hw.memory_bw if hw.memory_bw else 0.0


def step_terms(plan, hw: Hardware, links: dict, impl: str = "table2", mixed_state: str = "zero",
               attention: str | None = None) -> dict:
    """Every term of the step (TERMS) for the busiest planned pipeline rank, plus its total."""
    cfg = plan.cfg
    best = None
    for stage in plan.ranks:
        st = stage_time(plan, stage, hw, links, impl, mixed_state, attention)
        per_step = [tr for tr in st.traffic if tr.per == "step" and tr.dim in ("tp", "pp")]
        tp_step = collectives_time([tr for tr in per_step if tr.dim == "tp"], hw, links, cfg.world)
        pp_step = collectives_time([tr for tr in per_step if tr.dim == "pp"], hw, links, cfg.world)
        terms = {"compute_s": st.compute, "overhead_s": st.overhead, "comm_exposed_tp_s": st.tp + tp_step,
                 "comm_exposed_cp_s": st.cp, "comm_exposed_ep_s": ep_exposed(cfg, st, hw, links),
                 "comm_exposed_pp_s": st.pp + pp_step, "comm_exposed_dp_s": dp_exposed(cfg, st, hw, links),
                 "bubble_s": st.busy * plan.step.bubble_over_ideal, "optimizer_s": optimizer_time(plan, stage, hw)}
        total = sum(terms.values())
        if best is None or total > best[0]:
            dp_all = collectives_time([tr for tr in st.traffic if tr.dim == "dp"], hw, links, cfg.world)
            best = (total, terms, stage, dp_all)
    total, terms, stage, dp_all = best
    return {**terms, "step_time_s": total, "time_stage": stage, "comm_dp_total_s": dp_all}
