"""What each backend can run, as data, and the one function that answers "can backend B run config C".

Validation has two layers. `RunConfig` (bench/config.py) checks what holds for any engine: the
layout, the model's divisibility, the pipeline's shape and the schedule's rules. This module is the
second layer: each backend declares its capabilities below, and `unsupported_reason(cfg)` compares
a config with them, returning one line that names the field and the fix.

Pure data and integer comparisons: no torch, no import of the backends themselves (where each
backend's `build` lives is bench/backends/registry.py), so a sweep or the planner can ask before any
process starts. The DeepSpeed-specific `ds_set` overrides are checked by
`bench.conventions.check_ds_set`, pure as well, called from here.

Beside each backend's `Capabilities` (what it accepts) is its `Engine` record (how it trains, as the
cost model in bench/analysis needs to know it): the state convention, what dp shards, where
gradients live and when they are reduced, the copies around collectives, the schedule it executes.
The cost model switches on these declared properties, never on a backend's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.choices import BACKENDS, DTYPES, FSDP_MODES, RECOMPUTE, ZERO_STAGES  # noqa: F401 - re-exported
from bench.conventions import check_ds_set, zero3_knobs
from bench.schedule import SCHEDULES

if TYPE_CHECKING:
    from bench.config import RunConfig

NEEDS_LOSS_SCALER = ("fp16-mixed",)
"""Precisions whose small gradients underflow unless the loss is scaled (bf16 has fp32's exponent range)."""


@dataclass(frozen=True)
class Capabilities:
    """One backend's support, field by field of RunConfig. Read with `unsupported_reason`."""

    name: str
    zero: tuple[int, ...] = (0,)
    """ZeRO stages (`--zero`)."""
    pipeline_zero: tuple[int, ...] | None = None
    """ZeRO stages allowed together with pp > 1 (None: every stage of `zero`)."""
    pipeline_engine: str = "its pipeline engine"
    """What runs its pipeline, as messages name it."""
    dtypes: tuple[str, ...] = ("fp32", "bf16-mixed")
    """Training precisions. A precision of NEEDS_LOSS_SCALER is listed only when `loss_scaler` is true."""
    loss_scaler: bool = False
    """Scales the loss (dynamically) so fp16 gradients do not underflow."""
    tp: bool = True
    """Tensor parallel (tp > 1)."""
    pp: bool = True
    """Pipeline parallel (pp > 1)."""
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules when pp > 1."""
    virtual_stages: bool = True
    """Several model chunks per pipeline rank (virtual_stages > 1, interleaved schedule)."""
    micro_batches_below_pp: bool = True
    """Runs gpipe / 1f1b with fewer micro-batches than stages (torch.distributed.pipelining does not)."""
    sequence_parallel: bool = False
    cp_comms: tuple[str, ...] = ()
    """Context-parallel attention algorithms (`--cp-comm`, bench.choices.CP_COMMS), the default first;
    empty: no context parallel (cp = 1 only)."""
    cp_with_pp: bool = True
    """Context parallel together with pipeline parallel (cp > 1 and pp > 1)."""
    ep: bool = False
    """Expert parallel (ep > 1) belongs to this backend's design (native, FSDP2's expert mesh, DeepSpeed-MoE)."""
    ep_implemented: bool = False
    """Its engine runs ep > 1 today; False (with `ep`): refused as not implemented yet. The engine that adds
    expert parallel flips this one flag."""
    moe_needs_one: tuple[str, ...] = ()
    """Dimensions that must be 1 for a mixture-of-experts model (what this engine's MoE block does not
    combine with yet)."""
    recompute: tuple[str, ...] = RECOMPUTE
    """Activation recomputation modes (bench.surgery.apply_recompute)."""
    compile: str | None = "torch.compile of each block (bench.surgery.compile_blocks)"
    """How `--compile` is done, or None when it is not supported."""
    no_compile_why: str = ""
    """Why `--compile` is refused, for the message."""
    tied_embeddings_need_one: tuple[str, ...] = ()
    """Dimensions that must be 1 when the model ties its embedding to the head (the tie crosses that cut)."""
    fsdp_modes: tuple[str, ...] = ()
    """FSDP sharding modes (`--fsdp`); empty: the field does not apply."""
    fsdp_default: str | None = None
    """The fsdp mode a run gets when it names none."""
    ds_set: bool = False
    """Takes DeepSpeed config overrides (`--ds-set`)."""
    zero3_knobs: bool = False
    """Runs ZeRO-3's prefetch, live-parameter, reuse and persistence knobs (the `zero3_*` fields) at zero 3."""

    def __post_init__(self):
        scaled = set(self.dtypes) & set(NEEDS_LOSS_SCALER)
        assert self.loss_scaler or not scaled, f"{self.name}: {sorted(scaled)} need a loss scaler"


CAPABILITIES: dict[str, Capabilities] = {c.name: c for c in (
    # Megatron-style TP × PP × DP with its own buckets and ZeRO-1 (bench/native).
    # fp16-mixed: bench.loss_scale's dynamic scaler (native, fsdp, ddp).
    Capabilities("native", zero=(0, 1), sequence_parallel=True, cp_comms=("ring",), tied_embeddings_need_one=("pp",), dtypes=DTYPES,
                 loss_scaler=True, ep=True, ep_implemented=True,
                 # tp: the expert stacks are not cut over tp yet and the router's gradient would be partial per
                 # tp rank; cp: the aux loss's per-sequence sums would be each cp rank's share, not the sequence's
                 moe_needs_one=("tp", "cp")),
    # DeepSpeed: ZeRO 0-3; its PipelineEngine (1F1B, ZeRO ≤ 1); the native TP layers, which shard
    # embedding and head separately; its fp16 section scales the loss.
    Capabilities("deepspeed", zero=ZERO_STAGES, pipeline_zero=(0, 1), pipeline_engine="DeepSpeed's pipeline engine",
                 schedules=("1f1b",), virtual_stages=False, dtypes=DTYPES, loss_scaler=True, cp_comms=("ulysses",),
                 cp_with_pp=False,  # its pipeline engine reduces over its grid's dp group, never dp × cp
                 ep=True,  # DeepSpeed-MoE (deepspeed.moe)
                 tied_embeddings_need_one=("tp",), ds_set=True, zero3_knobs=True, compile=None,
                 no_compile_why="its engine owns the module's forward (ZeRO-3 parameter hooks, the pipeline "
                                "engine's layers); torch.compile of blocks under it is untested here"),
    # FSDP2 (+ DTensor TP, torch.distributed.pipelining PP).
    Capabilities("fsdp", micro_batches_below_pp=False, cp_comms=("ring",), tied_embeddings_need_one=("pp",), fsdp_modes=FSDP_MODES,
                 fsdp_default="full", dtypes=DTYPES, loss_scaler=True, ep=True),
    # torch DistributedDataParallel: data parallel only.
    Capabilities("ddp", tp=False, pp=False, virtual_stages=False, dtypes=DTYPES, loss_scaler=True),
)}
assert tuple(CAPABILITIES) == BACKENDS, "bench/choices.py names every backend, in this order"


# --- how each backend trains, for the cost model ------------------------------------------------
ZERO_SHARDS = {0: "none", 1: "optimizer", 2: "grads", 3: "params"}
"""What ZeRO stage k shards over dp (Rajbhandari et al. 2020 §5): nothing, + optimizer, + grads, + params."""
FSDP_SHARDS = {"none": "none", "grad-op": "params", "full": "params", "hybrid": "params"}
"""What each FSDP2 mode shards: grad-op stores shards too (it gathers them for forward + backward and
keeps them gathered between); hybrid over its shard group (`hybrid_shard`), none replicates."""

# DeepSpeed's own copies, bytes per parameter of the rank at fp32 gradients: (a, b, c) = a + b/n per
# gradient reduction round and c/n per step over n data-parallel ranks, counted under TorchDispatchMode
# at dp 2 and 4 (tests/test_time_model.py). A round flattens the gradients into the reduce bucket and
# averages them, and at ZeRO ≥ 1 copies the rank's slice out to its fp32 partition; the step's work is
# on the partition: the gradient norm's read, the updated partition copied into the gathered
# parameters. ZeRO-0 copies the averaged bucket back to the gradients. ZeRO-3 also copies around each
# parameter all-gather, as FSDP2 does (`bench.analysis.time_model.shard_copy_factor`).
DEEPSPEED_COPY_BYTES = {0: (24, 0, 0), 1: (26, 12, 36), 2: (26, 12, 36), 3: (24, 8, 52)}


@dataclass(frozen=True)
class Engine:
    """How one backend trains, as data the cost model (bench/analysis) reads instead of its name."""

    name: str
    mixed_state: str
    """Its mixed-precision model state convention (bench.analysis.memory.MIXED_STATES): `zero`, low-
    precision weights and grads with an fp32 copy in the optimizer (DeepSpeed casts the module); or
    `autocast`, fp32 weights and grads, low precision only inside torch.autocast's matmuls."""
    shards_by: str
    """What chooses the dp sharding: `zero-stage` (`--zero`, ZERO_SHARDS) or `fsdp-mode` (`--fsdp`,
    FSDP_SHARDS; hybrid shards within `bench.analysis.memory.hybrid_shard` ranks)."""
    data_parallel: str
    """How gradients and state are laid out and reduced over dp: `flat-buckets` (bench.native: flat
    fp32 buckets of bucket_mb, padded to dp under ZeRO-1), `zero-partitions` (DeepSpeed's
    stage_1_and_2.py / stage3.py: flat partitions, ipg reduce buckets of reduce_bucket_size
    elements, ZeRO-3's prefetch coordinator), `dim0-shards` (FSDP2: one group per block and a root,
    dim 0 padded to the shard count) or `reducer` (torch DDP's gradient buckets)."""
    vocab_parallel: bool = True
    """Under tp the token embedding and the head are split over the vocabulary (the native layers,
    which DeepSpeed reuses); False: replicated (the fsdp backend's DTensor plan covers the blocks only)."""
    autocast_copies: bool = True
    """Under the `autocast` convention its low-precision compute copies are torch.autocast's (saved
    weight copies, fp32 norm inputs); False: it computes in gathered low-precision parameters
    (FSDP2's MixedPrecisionPolicy)."""
    casts_weights_once: bool = False
    """Keeps autocast's weight copies for the whole step (one cast per layer a step, bench.native's
    `Pipeline._weight_casts_kept`); False: every micro-batch's forward casts again."""
    mixed_comm_bytes: tuple[int, int] | None = None
    """(gradient reduction, parameter gather) element bytes under mixed precision when the engine fixes
    them (FSDP2's MixedPrecisionPolicy: reduce in fp32, gather in bf16); None: the state convention's."""
    cp_grad_comm_bytes: int | None = None
    """Gradient reduction element bytes when cp > 1, if the engine switches them (DeepSpeed: its
    `seq_parallel_communication_data_type`, fp32 by default, engine.py's sequence-parallel setup);
    None: as at cp = 1."""
    selective_reruns_cp: bool = True
    """Selective recompute re-runs the attention's cp traffic in backward: the ring runs inside the
    recomputed AttentionCore; False: the recomputed part is inside the all-to-alls (DeepSpeed's
    DistributedAttention wraps the core after recompute is applied)."""
    recompute_reruns_tp: bool = False
    """Full recomputation re-runs each block's tp collectives in backward (torch.utils.checkpoint over
    the native tp layers)."""
    backward_makes_grads: bool = True
    """Backward allocates the gradients; False: it accumulates into persistent flat buckets (bench.native)."""
    grads_freed: str = "zero_grad"
    """When the step frees the gradient state before its peak: `zero_grad` (torch's
    zero_grad(set_to_none=True): freed, made again only after one micro-batch's peak), `step_start`
    (DeepSpeed makes its gradient partition only at the optimizer step) or `never` (persistent buckets)."""
    runs_schedule_without_pipeline: bool = False
    """At pp = 1 it still runs its schedule's action lists (bench.native); False: it accumulates one
    micro-batch at a time (1F1B at p = 1)."""
    fills_when_m_is_p: bool = True
    """Its interleaved schedule fills the pipeline when micro_batches = pp (bench.schedule.interleaved);
    torch.distributed.pipelining's does not."""
    pipeline: str = "schedule-lists"
    """What runs its pipeline: `schedule-lists` (bench.schedule's action lists, sends as they come),
    `pipe-engine` (DeepSpeed's PipelineEngine: tensors partitioned over tp, loss broadcast) or
    `torch-pipelining` (torch.distributed.pipelining: FSDP2 keeps blocks unsharded between backwards)."""
    reduces_after_backward: bool = False
    """The once-a-step gradient reduction runs after backward, at the accumulation boundary (DeepSpeed,
    overlap_comm off); False: its buckets overlap the last micro-batch's backward."""
    partition_accumulation_from: int | None = None
    """The ZeRO stage from which gradients accumulate into the rank's 1/dp partition (DeepSpeed: 2)."""
    copy_bytes: dict | None = None
    """Bytes per parameter it copies around its dp collectives, per ZeRO stage (DEEPSPEED_COPY_BYTES);
    None: the copies follow from its traffic (bench.analysis.time_model.backend_copy_bytes)."""
    optimizer_steps: str = "parameters"
    """What its optimizer steps on under ZeRO ≥ 1: `parameters` (one tensor each), `partition` (one flat
    partition: DeepSpeed) or `bucket-shards` (one shard per gradient bucket at dp > 1: bench.native)."""
    bf16_pipeline_optimizer: bool = False
    """At ZeRO-0 with a pipeline in bf16 its optimizer partitions the fp32 master over dp, as ZeRO-1
    (DeepSpeed's BF16_Optimizer, engine._do_optimizer_sanity_check)."""

    def __post_init__(self):
        for name, allowed in ENGINE_CHOICES.items():  # a misspelt value would silently take another branch
            value = getattr(self, name)
            assert value in allowed, f"engine {self.name}: {name}={value!r}, not one of {allowed}"


ENGINE_CHOICES = {"mixed_state": ("zero", "autocast"), "shards_by": ("zero-stage", "fsdp-mode"),
                  "data_parallel": ("flat-buckets", "zero-partitions", "dim0-shards", "reducer"),
                  "grads_freed": ("zero_grad", "step_start", "never"),
                  "pipeline": ("schedule-lists", "pipe-engine", "torch-pipelining"),
                  "optimizer_steps": ("parameters", "partition", "bucket-shards")}
"""The values each of Engine's enumerated fields takes (the cost model switches on them)."""


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("native", "autocast", "zero-stage", "flat-buckets", casts_weights_once=True, recompute_reruns_tp=True,
           backward_makes_grads=False, grads_freed="never", runs_schedule_without_pipeline=True,
           optimizer_steps="bucket-shards"),
    Engine("deepspeed", "zero", "zero-stage", "zero-partitions", grads_freed="step_start", pipeline="pipe-engine",
           reduces_after_backward=True, partition_accumulation_from=2, copy_bytes=DEEPSPEED_COPY_BYTES,
           optimizer_steps="partition", bf16_pipeline_optimizer=True, cp_grad_comm_bytes=4,
           selective_reruns_cp=False),
    Engine("fsdp", "autocast", "fsdp-mode", "dim0-shards", vocab_parallel=False, autocast_copies=False,
           mixed_comm_bytes=(4, 2), fills_when_m_is_p=False, pipeline="torch-pipelining"),
    Engine("ddp", "autocast", "zero-stage", "reducer"),
)}
assert set(ENGINES) == set(CAPABILITIES), "every backend declares both its capabilities and its engine"


def engine(cfg) -> Engine:
    """The Engine record of `cfg`'s backend."""
    return ENGINES[cfg.backend]


def can_run(backend: str, cfg: "RunConfig") -> bool:
    return unsupported_reason(cfg, backend) is None


def unsupported_reason(cfg: "RunConfig", backend: str | None = None) -> str | None:
    """Why `backend` (default: cfg.backend) cannot run `cfg`, in one line naming the field and the fix;
    None when it can. `cfg` is any object with RunConfig's fields and `model_config`."""
    name = backend or cfg.backend
    caps = CAPABILITIES.get(name)
    if caps is None:
        return f"unknown backend {name!r}; known: {', '.join(BACKENDS)}"
    for check in (_parallelism, _pipeline, _precision, _memory_and_sharding, _options):
        reason = check(caps, cfg)
        if reason:
            return reason
    if caps.ds_set:
        return check_ds_set(cfg)
    return None


def _parallelism(caps: Capabilities, cfg) -> str | None:
    name = caps.name
    if not caps.tp and not caps.pp and (cfg.tp > 1 or cfg.pp > 1):
        return f"backend {name} is data parallel only: needs tp = pp = 1, got tp={cfg.tp}, pp={cfg.pp}"
    if not caps.tp and cfg.tp > 1:
        return f"backend {name} has no tensor parallel: needs tp = 1, got tp={cfg.tp}"
    if not caps.pp and cfg.pp > 1:
        return f"backend {name} has no pipeline parallel: needs pp = 1, got pp={cfg.pp}"
    if cfg.cp > 1 and not caps.cp_comms:
        return f"backend {name} has no context parallel: needs cp = 1, got cp={cfg.cp} (backends {_who('cp_comms')} have one)"
    if cfg.cp > 1 and cfg.cp_comm not in caps.cp_comms:
        others = [b for b, c in CAPABILITIES.items() if cfg.cp_comm in c.cp_comms]
        who = f"backend {others[0]} does" if len(others) == 1 else f"backends {' and '.join(others)} do"
        return f"backend {name} runs cp_comm {' and '.join(caps.cp_comms)}, not {cfg.cp_comm}" + (f" ({who})" if others else "")
    if cfg.cp > 1 and cfg.pp > 1 and not caps.cp_with_pp:
        able = " or ".join(b for b, c in CAPABILITIES.items() if c.cp_comms and c.cp_with_pp)
        return (f"backend {name}: cp ({cfg.cp}) with pp ({cfg.pp}) is not supported ({caps.pipeline_engine} "
                f"reduces gradients over its data-parallel group, not dp × cp); use pp = 1, or backend {able}")
    if cfg.ep > 1 and not caps.ep:
        return f"backend {name} has no expert parallel: needs ep = 1, got ep={cfg.ep} (backends {_who('ep')} have one)"
    if cfg.ep > 1 and not caps.ep_implemented:
        return f"expert parallel is not implemented on backend {name} yet: needs ep = 1, got ep={cfg.ep}"
    if cfg.model_config.experts:
        for dim in caps.moe_needs_one:
            if getattr(cfg, dim) > 1:
                return (f"backend {name}: {dim} > 1 with a mixture-of-experts model is not supported yet; "
                        f"use {dim} = 1 (ep and dp split the experts)")
    if cfg.sequence_parallel and not caps.sequence_parallel:
        return f"backend {name}: sequence_parallel is not supported ({_who('sequence_parallel')} engine only)"
    if cfg.model_config.tie_embeddings:
        for dim in caps.tied_embeddings_need_one:
            if getattr(cfg, dim) > 1:
                return f"backend {name}: {dim} > 1 with tie_embeddings is not supported; untie the embeddings"
    return None


def _pipeline(caps: Capabilities, cfg) -> str | None:
    name = caps.name
    if cfg.virtual_stages > 1 and not caps.virtual_stages:
        return (f"backend {name}: virtual_stages ({cfg.virtual_stages}) > 1 is not supported (no interleaved "
                f"pipeline; {_who('virtual_stages')} have one); use virtual_stages 1")
    if cfg.pp == 1:
        return None
    zero = caps.zero if caps.pipeline_zero is None else caps.pipeline_zero
    if cfg.zero not in zero:
        return (f"backend {name}: zero={cfg.zero} is incompatible with pipeline parallel (pp={cfg.pp}); "
                f"{caps.pipeline_engine} supports zero {' and '.join(map(str, zero))}")
    if cfg.schedule not in caps.schedules:
        return f"backend {name}: its pipeline engine runs {' and '.join(caps.schedules)} only, not schedule={cfg.schedule}"
    if not caps.micro_batches_below_pp and cfg.schedule in ("gpipe", "1f1b") and cfg.micro_batches < cfg.pp:
        return (f"backend {name}: schedule {cfg.schedule} needs micro_batches ≥ pp, got micro_batches="
                f"{cfg.micro_batches} < pp={cfg.pp}")
    return None


def _precision(caps: Capabilities, cfg) -> str | None:
    if cfg.dtype in NEEDS_LOSS_SCALER and cfg.device != "cuda":  # the scalers are CUDA's (bench.loss_scale)
        auto = " (device auto may be cpu: fp16 needs an explicit --device cuda)" if cfg.device == "auto" else ""
        return (f"backend {caps.name}: dtype {cfg.dtype} is not supported on cpu{auto}; use bf16-mixed or fp32, "
                "or --device cuda on a GPU host")
    if cfg.dtype not in caps.dtypes:
        why = " (no loss scaling here)" if cfg.dtype in NEEDS_LOSS_SCALER else ""
        return (f"backend {caps.name} supports dtype {' and '.join(caps.dtypes)}, not {cfg.dtype}{why}; "
                f"use {caps.dtypes[-1]}" + (f", or backend {_who('loss_scaler')}" if why else ""))
    return None


def _memory_and_sharding(caps: Capabilities, cfg) -> str | None:
    name = caps.name
    if cfg.recompute not in caps.recompute:
        return (f"backend {name}: recompute {cfg.recompute} is not supported; "
                f"use {' or '.join(caps.recompute)}")
    if cfg.zero not in caps.zero:
        return f"backend {name} supports zero in {list(caps.zero)}, not zero={cfg.zero}"
    if cfg.fsdp is not None and cfg.fsdp not in caps.fsdp_modes:
        return f"fsdp={cfg.fsdp!r} applies to backend {_who('fsdp_modes')} only, not {name}"
    if cfg.fsdp == "hybrid" and cfg.dp < 2:
        return (f"backend {name}: fsdp=hybrid needs dp ≥ 2 (replicate × shard), got dp={cfg.dp}; "
                "use fsdp=full, or raise dp")
    return None


def _options(caps: Capabilities, cfg) -> str | None:
    if cfg.ds_set and not caps.ds_set:
        return f"ds_set applies to backend {_who('ds_set')} only, not {caps.name}"
    changed = [field for (field, value), (_, default) in zip(zero3_knobs(cfg), zero3_knobs(None)) if value != default]
    if changed and not (caps.zero3_knobs and cfg.zero == 3):
        return (f"{changed[0]} applies to backend {_who('zero3_knobs')} at zero=3 only, not backend {caps.name} at "
                f"zero={cfg.zero}; drop it, or use --zero 3 with backend {_who('zero3_knobs')}")
    if getattr(cfg, "compile", False):
        if caps.compile is None:
            able = [name for name, c in CAPABILITIES.items() if c.compile]
            return (f"backend {caps.name}: compile is not supported ({caps.no_compile_why}); "
                    f"drop --compile, or use backend {', '.join(able[:-1])} or {able[-1]}")
        if cfg.warmup < 1:  # compilation happens at the first call: it must not land in a timed step
            return "compile needs warmup ≥ 1 (the first step compiles, and is never timed); set --warmup 1 or more"
    return None


def _who(capability: str) -> str:
    """The backends that have a capability, for messages ('native', 'native and fsdp', 'a, b and c')."""
    names = [name for name, caps in CAPABILITIES.items() if getattr(caps, capability)]
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
