"""Backend registry: a name → where its `build(cfg, ctx)` lives and what it supports.

Support checks are pure (no torch import), so a sweep can expand and skip unsupported configs
with a reason before any process starts. `build` imports the backend only inside a rank.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from bench.config import RunConfig


@dataclass(frozen=True)
class Backend:
    name: str
    module: str
    check: Callable[["RunConfig"], str | None]
    """Returns why the backend cannot run a config, or None when it can."""

    def build(self, cfg: "RunConfig", ctx):
        return importlib.import_module(self.module).build(cfg, ctx)


def _common(cfg: "RunConfig", name: str, zero: tuple[int, ...], fsdp_ok: bool = False) -> str | None:
    if cfg.zero not in zero:
        return f"backend {name} supports zero in {list(zero)}, not zero={cfg.zero}"
    if cfg.fsdp is not None and not fsdp_ok:
        return f"fsdp={cfg.fsdp!r} applies to backend fsdp only, not {name}"
    if cfg.ds_set and name != "deepspeed":
        return f"ds_set applies to backend deepspeed only, not {name}"
    if cfg.dtype == "fp16-mixed" and cfg.device == "cpu":
        return f"backend {name}: dtype fp16-mixed is not supported on cpu; use bf16-mixed or fp32"
    return None


def _native(cfg: "RunConfig") -> str | None:
    if cfg.pp > 1 and cfg.model_config.tie_embeddings:
        return "backend native: pp > 1 with tie_embeddings is not supported; untie the embeddings"
    if cfg.virtual_stages > 1 and cfg.pp == 1:
        return (f"backend native: virtual_stages ({cfg.virtual_stages}) > 1 needs pp > 1 "
                "(interleaving spreads model chunks over pipeline ranks)")
    if cfg.recompute == "selective":
        return "backend native: recompute selective is not supported; use none or full"
    return _common(cfg, "native", (0, 1))


def _ddp(cfg: "RunConfig") -> str | None:
    if cfg.tp > 1 or cfg.pp > 1:
        return f"backend ddp is data parallel only: needs tp = pp = 1, got tp={cfg.tp}, pp={cfg.pp}"
    if cfg.recompute == "selective":
        return "backend ddp: recompute selective is not supported; use none or full"
    return _common(cfg, "ddp", (0,))


def _fsdp(cfg: "RunConfig") -> str | None:
    if cfg.recompute == "selective":
        return "backend fsdp: recompute selective is not supported; use none or full"
    if cfg.sequence_parallel:
        return "backend fsdp: sequence_parallel is not supported (native engine only)"
    if cfg.fsdp == "hybrid" and cfg.dp < 2:
        return (f"backend fsdp: fsdp=hybrid needs dp ≥ 2 (replicate × shard), got dp={cfg.dp}; "
                "use fsdp=full, or raise dp")
    if cfg.dtype == "fp16-mixed":
        return "backend fsdp supports dtype fp32 and bf16-mixed, not fp16-mixed (no loss scaling here)"
    if cfg.pp > 1 and cfg.model_config.tie_embeddings:
        return "backend fsdp: pp > 1 with tie_embeddings is not supported; untie the embeddings"
    if cfg.pp == 1 and cfg.virtual_stages > 1:
        return f"backend fsdp: virtual_stages={cfg.virtual_stages} needs pp > 1 (chunks per pipeline rank)"
    if cfg.pp > 1 and cfg.schedule in ("gpipe", "1f1b") and cfg.micro_batches < cfg.pp:
        return (f"backend fsdp: schedule {cfg.schedule} needs micro_batches ≥ pp, got micro_batches="
                f"{cfg.micro_batches} < pp={cfg.pp}")
    return _common(cfg, "fsdp", (0,), fsdp_ok=True)


def _deepspeed(cfg: "RunConfig") -> str | None:
    if cfg.pp > 1 and cfg.zero > 1:
        return (f"backend deepspeed: zero={cfg.zero} is incompatible with pipeline parallel (pp={cfg.pp}); "
                "DeepSpeed's pipeline engine supports zero 0 and 1")
    if cfg.sequence_parallel:
        return "backend deepspeed: sequence_parallel is not supported (native engine only)"
    if cfg.pp > 1 and cfg.schedule != "1f1b":
        return f"backend deepspeed: its pipeline engine runs 1f1b only, not schedule={cfg.schedule}"
    if cfg.recompute == "selective":
        return "backend deepspeed: recompute selective is not supported; use none or full"
    if cfg.tp > 1 and cfg.model_config.tie_embeddings:
        return ("backend deepspeed: tp > 1 with tie_embeddings is not supported (the native TP layers it "
                "uses shard embedding and head separately); untie the embeddings")
    from bench.backends import deepspeed_config  # pure: parses ds_set, no torch
    return deepspeed_config.check(cfg) or _common(cfg, "deepspeed", (0, 1, 2, 3))


REGISTRY: dict[str, Backend] = {
    b.name: b for b in (
        Backend("native", "bench.native", _native),
        Backend("ddp", "bench.backends.ddp", _ddp),
        Backend("fsdp", "bench.backends.fsdp", _fsdp),
        Backend("deepspeed", "bench.backends.deepspeed", _deepspeed),
    )
}


def get_backend(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}") from None


def unsupported_reason(cfg: "RunConfig") -> str | None:
    if cfg.backend not in REGISTRY:
        return f"unknown backend {cfg.backend!r}; known: {', '.join(REGISTRY)}"
    return REGISTRY[cfg.backend].check(cfg)
