"""What each backend can run, as data, and the one function that answers "can backend B run config C".

Validation has two layers. `RunConfig` (bench/config.py) checks what holds for any engine: the
layout, the model's divisibility, the pipeline's shape and the schedule's rules. This module is the
second layer: each backend declares its capabilities below, and `unsupported_reason(cfg)` compares
a config with them, returning one line that names the field and the fix.

Pure data and integer comparisons: no torch, no import of the backends themselves (where each
backend's `build` lives is bench/backends/registry.py), so a sweep or the planner can ask before any
process starts. The DeepSpeed-specific `ds_set` overrides are parsed by
`bench.backends.deepspeed_config.check`, pure as well, called from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.choices import BACKENDS, DTYPES, FSDP_MODES, RECOMPUTE, ZERO_STAGES  # noqa: F401 - re-exported
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

    def __post_init__(self):
        scaled = set(self.dtypes) & set(NEEDS_LOSS_SCALER)
        assert self.loss_scaler or not scaled, f"{self.name}: {sorted(scaled)} need a loss scaler"


CAPABILITIES: dict[str, Capabilities] = {c.name: c for c in (
    # Megatron-style TP × PP × DP with its own buckets and ZeRO-1 (bench/native).
    # fp16-mixed: bench.loss_scale's dynamic scaler (native, fsdp, ddp).
    Capabilities("native", zero=(0, 1), sequence_parallel=True, tied_embeddings_need_one=("pp",), dtypes=DTYPES,
                 loss_scaler=True),
    # DeepSpeed: ZeRO 0-3; its PipelineEngine (1F1B, ZeRO ≤ 1); the native TP layers, which shard
    # embedding and head separately; its fp16 section scales the loss.
    Capabilities("deepspeed", zero=ZERO_STAGES, pipeline_zero=(0, 1), pipeline_engine="DeepSpeed's pipeline engine",
                 schedules=("1f1b",), virtual_stages=False, dtypes=DTYPES, loss_scaler=True,
                 tied_embeddings_need_one=("tp",), ds_set=True, compile=None,
                 no_compile_why="its engine owns the module's forward (ZeRO-3 parameter hooks, the pipeline "
                                "engine's layers); torch.compile of blocks under it is untested here"),
    # FSDP2 (+ DTensor TP, torch.distributed.pipelining PP).
    Capabilities("fsdp", micro_batches_below_pp=False, tied_embeddings_need_one=("pp",), fsdp_modes=FSDP_MODES,
                 fsdp_default="full", dtypes=DTYPES, loss_scaler=True),
    # torch DistributedDataParallel: data parallel only.
    Capabilities("ddp", tp=False, pp=False, virtual_stages=False, dtypes=DTYPES, loss_scaler=True),
)}
assert tuple(CAPABILITIES) == BACKENDS, "bench/choices.py names every backend, in this order"


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
        from bench.backends import deepspeed_config  # pure: parses ds_set, no torch
        return deepspeed_config.check(cfg)
    return None


def _parallelism(caps: Capabilities, cfg) -> str | None:
    name = caps.name
    if not caps.tp and not caps.pp and (cfg.tp > 1 or cfg.pp > 1):
        return f"backend {name} is data parallel only: needs tp = pp = 1, got tp={cfg.tp}, pp={cfg.pp}"
    if not caps.tp and cfg.tp > 1:
        return f"backend {name} has no tensor parallel: needs tp = 1, got tp={cfg.tp}"
    if not caps.pp and cfg.pp > 1:
        return f"backend {name} has no pipeline parallel: needs pp = 1, got pp={cfg.pp}"
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
    if getattr(cfg, "compile", False):
        if caps.compile is None:
            able = [name for name, c in CAPABILITIES.items() if c.compile]
            return (f"backend {caps.name}: compile is not supported ({caps.no_compile_why}); "
                    f"drop --compile, or use backend {', '.join(able[:-1])} or {able[-1]}")
        if cfg.warmup < 1:  # compilation happens at the first call: it must not land in a timed step
            return "compile needs warmup ≥ 1 (the first step compiles, and is never timed); set --warmup 1 or more"
    return None


def _who(capability: str) -> str:
    """The backends that have a capability, for messages ('native', 'native and fsdp')."""
    return " and ".join(name for name, caps in CAPABILITIES.items() if getattr(caps, capability))
