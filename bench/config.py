"""RunConfig: one benchmark run, validated before any process starts.

Field names are the vocabulary of the whole suite: a field `micro_batches` is the CLI flag
`--micro-batches`, the YAML key `micro_batches` and the dataframe column `micro_batches`.
RunConfig is a frozen, keyword-only pydantic dataclass: each field's type says its bounds
(`Annotated[int, Field(ge=1)]`) or choices (`Literal[...]`), and the docstring under it is its help
text (`help_text`); the CLI's options (bench/cli/options.py) and the sweep file's keys
(bench/sweep/spec.py) are typed by the same annotations. Strict: '8' is no integer, 1 no boolean.

Validation has two layers. This module checks what holds for any engine: field types and choices,
the world size, the model's divisibility and the pipeline's shape and schedule (`structural_reason`,
which the planner also applies to its candidates). bench/capabilities.py declares what each backend
supports and says why a backend cannot run a config. A RunConfig raises ConfigError with the first
reason of either (one line naming the field and the fix), so a config that exists can run.
`RunConfig.unchecked` builds one without any check (the planner's candidates).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import typing
from dataclasses import MISSING, asdict, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, WrapValidator, model_validator
from pydantic.dataclasses import dataclass

from bench.capabilities import CAPABILITIES, unsupported_reason
from bench.choices import BACKENDS, CP_COMMS, DEVICES, DTYPES, FSDP_MODES, RECOMPUTE, ZERO_STAGES
from bench.conventions import DEEPSPEED_DEFAULTS
from bench.layout import ORDERS, Layout, ep_split_reason, layout_product, seq_split_reason
from bench.schedule import SCHEDULES
from models.config import GPTConfig, get_preset


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the fields and the fix."""


# Sane ranges: beyond them a value is a typo, and would run for days or overflow a column (int64).
MAX_RANKS = 1_000_000
MAX_STEPS = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _as_written(value, handler):
    """Checked as a number but kept as written: 25 stays an int (the canonical form, hence the run id,
    prints 25, not 25.0)."""
    handler(value)
    return value


def _as_tuple(value):
    """A list field as callers give it: a tuple, a list, one KEY=VALUE string or a mapping."""
    if isinstance(value, dict):
        return tuple(f"{k}={v}" for k, v in value.items())
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


Ranks = Annotated[int, Field(ge=1, le=MAX_RANKS)]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Size = Annotated[int, Field(ge=1, le=1 << 20)]
Numel = Annotated[int, Field(ge=0, le=1 << 62)]
Number = lambda **bounds: Annotated[float, Field(**bounds), WrapValidator(_as_written)]  # noqa: E731
Items = Annotated[tuple, BeforeValidator(_as_tuple)]
Backend = Literal[BACKENDS]  # typing expands a tuple inside Literal into its values
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
"""The field docstrings are read by `_field_docs`, not by pydantic's use_attribute_docstrings (which finds
the class's source through `inspect`: ~50 ms of every start-up)."""


def _raises_config_error(cls):
    """RunConfig(...) raises ConfigError with one line (the first mistake), not pydantic's report."""
    validated_init = cls.__init__

    @functools.wraps(validated_init)
    def __init__(self, *args, **kwargs):
        try:
            validated_init(self, *args, **kwargs)
        except ValidationError as e:
            raise ConfigError(config_problem(e.errors()[0])) from None
    cls.__init__ = __init__
    return cls


@_raises_config_error
@dataclass(frozen=True, kw_only=True, config=STRICT)
class RunConfig:
    model: str = "tiny"
    """model preset (models.PRESETS)"""
    model_overrides: Items = ()
    """preset fields to override, as KEY=VALUE (e.g. layers=8)"""
    backend: Backend = "native"
    """training backend"""
    tp: Ranks = 1
    """tensor-parallel size"""
    cp: Ranks = 1
    """context-parallel size: the sequence split over cp ranks (zig-zag chunks), attention by cp_comm"""
    cp_comm: Literal[CP_COMMS] | None = None
    """context-parallel attention: ring (K/V passed round the cp group) or ulysses (all-to-all of heads); default: the backend's"""
    ep: Ranks = 1
    """expert-parallel size (MoE models): the experts split over ep ranks carved from the dp × cp ranks (ep divides dp × cp; not part of the world size)"""
    pp: Ranks = 1
    """pipeline-parallel size (stages)"""
    dp: Ranks = 1
    """data-parallel size (replicas)"""
    order: Literal[ORDERS] = "tp-pp-dp"
    """rank order, fastest dimension first"""
    zero: Literal[ZERO_STAGES] = 0
    """ZeRO stage: native 0-1, deepspeed 0-3"""
    fsdp: Literal[FSDP_MODES] | None = None
    """FSDP sharding (backend fsdp only; default full)"""
    schedule: Literal[SCHEDULES] = "1f1b"
    """pipeline schedule"""
    virtual_stages: Annotated[int, Field(ge=1, le=1024)] = 1
    """model chunks per pipeline rank (interleaved schedule)"""
    micro_batch: Size = 2
    """sequences per micro-batch"""
    micro_batches: Size = 1
    """micro-batches per step and pipeline (gradient accumulation when pp = 1)"""
    seq: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    """sequence length (default: the model's seq_len)"""
    dtype: Literal[DTYPES] = "fp32"
    """training precision"""
    sequence_parallel: bool = False
    """shard norm/dropout regions along the sequence (needs tp > 1)"""
    recompute: Literal[RECOMPUTE] = "none"
    """activation recomputation"""
    compile: bool = False
    """torch.compile each block (native, fsdp, ddp); the first warm-up step compiles (column compile_s), never a timed one"""
    bucket_mb: Number(gt=0, le=1 << 20) = 25.0
    """gradient all-reduce bucket size in MiB"""
    steps: Steps = 5
    """timed optimizer steps"""
    warmup: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 2
    """untimed optimizer steps before timing"""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    """seed of weights and data"""
    device: Literal[DEVICES] = "auto"
    """device (auto = cuda when available, else cpu)"""
    zero3_param_persistence_threshold: Numel = DEEPSPEED_DEFAULTS["stage3_param_persistence_threshold"]
    """ZeRO-3 (deepspeed): parameters of at most this many elements stay whole on every rank (stage3_param_persistence_threshold)"""
    zero3_max_live_parameters: Numel = DEEPSPEED_DEFAULTS["stage3_max_live_parameters"]
    """ZeRO-3 (deepspeed): elements gathered at once beyond which its prefetcher waits (stage3_max_live_parameters)"""
    zero3_max_reuse_distance: Numel = DEEPSPEED_DEFAULTS["stage3_max_reuse_distance"]
    """ZeRO-3 (deepspeed): a parameter reused within this many elements of the trace stays gathered, else it is freed and gathered again (stage3_max_reuse_distance)"""
    zero3_prefetch_bucket_size: Numel | None = None
    """ZeRO-3 (deepspeed): elements its prefetcher gathers ahead per op (stage3_prefetch_bucket_size; default: bucket_mb's)"""
    ds_set: Items = ()
    """DeepSpeed config override KEY=VALUE with a dotted key (repeatable)"""
    world_size: Ranks | None = None
    """expected world size; must equal tp × cp × pp × dp when given"""
    repeat: Annotated[int, Field(ge=0, le=10_000)] = 0
    """repeat index of the same config (noise estimation)"""
    fault: str = "none"
    """test-only fault injection, comma-separated: raise | hang | oom | oom_real on the last rank; sleep:MS per step; slow_rank:MS at the end of each step of the last rank (a straggler); stage_sleep:MS per pipeline compute section (native); grad_scale:K, lr_scale:K, sgd:LR at every optimizer step"""
    timeout_s: Number(gt=0, le=MAX_TIMEOUT_S) = 600.0
    """wall-clock limit of the run in seconds"""
    profile: bool = False
    """trace one extra, untimed step per rank with torch.profiler (Chrome JSON + op table)"""

    @functools.cached_property
    def model_config(self) -> GPTConfig:
        """The preset with its overrides, looked up once per config (the cost model reads it dozens of times
        per planner candidate)."""
        return model_config(self.model, self.model_overrides)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, order=self.order, cp=self.cp, ep=self.ep)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    @model_validator(mode="after")
    def _normalized_and_possible(self):
        _normalize(self)
        _validate(self)
        return self

    @classmethod
    def unchecked(cls, **values) -> "RunConfig":
        """A RunConfig of `values` over the defaults, the derived defaults filled (seq, fsdp), with no
        check: the planner's ~20,000 candidates, which it checks itself (structural_reason,
        unsupported_reason), cost microseconds instead of a validation each."""
        cfg = object.__new__(cls)
        object.__setattr__(cfg, "__dict__", {**DEFAULTS, **values})
        _normalize(cfg)
        return cfg

    @property
    def run_id(self) -> str:
        """Short hash of the canonical form: the key for resume, de-duplication and baselines."""
        return _digest(self.canonical())

    @property
    def config_id(self) -> str:
        """Like run_id but equal for every repeat of a config (groups repeats for statistics)."""
        return _digest({k: v for k, v in self.canonical().items() if k != "repeat"})

    def canonical(self) -> dict[str, Any]:
        """Fields that identify the run: those off their defaults, plus the layout and backend.

        Leaving defaults out keeps run ids stable when a new field with a default is added."""
        out = {}
        for f in fields(self):
            if f.name in NOT_IN_ID:
                continue
            value = getattr(self, f.name)
            if f.name in ("model", "backend", "tp", "pp", "dp") or value != DEFAULTS[f.name]:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_row(self) -> dict[str, Any]:
        """Flat columns for the results dataframe (tuples become JSON strings)."""
        row = {k: (json.dumps(list(v)) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        row.update(world_size=self.world, global_batch=self.global_batch, run_id=self.run_id,
                   config_id=self.config_id)
        return row

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()})

    def replace(self, **changes) -> "RunConfig":
        return replace(self, **changes)


NOT_IN_ID = ("timeout_s", "profile")
"""Limits and extra, untimed work: the measurement, hence the run id, is the same with any value."""
FIELDS = {f.name: f for f in fields(RunConfig)}
DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
"""Every RunConfig field's default (None for the ones derived from others, e.g. seq)."""
assert MISSING not in DEFAULTS.values(), "every RunConfig field has a default"
LIST_FIELDS = tuple(name for name, info in RunConfig.__pydantic_fields__.items() if info.annotation is tuple)
"""The fields that hold a list of KEY=VALUE strings (a tuple): model_overrides, ds_set."""


def help_text(name: str) -> str:
    """A RunConfig field's help: the docstring under it."""
    return _field_docs()[name]


@lru_cache(maxsize=None)
def _field_docs() -> dict[str, str]:
    """The docstring under each field of RunConfig's class body, cleaned as pydantic's
    use_attribute_docstrings would (tests/test_config.py checks them against pydantic's extraction)."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "RunConfig").body
    return {stmt.target.id: inspect.cleandoc(doc.value.value) for stmt, doc in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


def annotation(name: str):
    """A RunConfig field's type with its bounds (what the CLI and the sweep file check values by)."""
    info = RunConfig.__pydantic_fields__[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


def choices(name: str) -> tuple:
    """A choice field's values (its Literal's), or ()."""
    args = [a for a in typing.get_args(annotation(name)) if a is not type(None)]
    literal = args[0] if args and typing.get_origin(args[0]) is Literal else annotation(name)
    return typing.get_args(literal) if typing.get_origin(literal) is Literal else ()


def bounded(name: str) -> bool:
    """A number field with a lower bound (Field(ge=…) or Field(gt=…))."""
    return any(isinstance(c, (Ge, Gt)) for c in _constraints(annotation(name)))


def _constraints(kind) -> list:
    """The annotated_types constraints anywhere in a type (under Optional, inside a Field)."""
    found = []
    for part in (*getattr(kind, "__metadata__", ()), *typing.get_args(kind)):
        found += [part] if isinstance(part, (Ge, Gt)) else getattr(part, "metadata", None) or _constraints(part)
    return found


@lru_cache(maxsize=None)
def _adapter(kind) -> TypeAdapter:
    return TypeAdapter(kind, config=ConfigDict(strict=True, allow_inf_nan=False))


def value_reason(name: str, kind, value) -> str | None:
    """Why `value` is not of type `kind` (strict, bounds and choices included), worded as RunConfig's
    field `name` would be; None when it is."""
    try:
        _adapter(kind).validate_python(value)
    except ValidationError as e:
        return config_problem({**e.errors()[0], "loc": (name,)})
    return None


def field_reason(name: str, value) -> str | None:
    """Why `value` cannot be RunConfig field `name` by its type, bounds or choices (None: fine).
    A number field's None is its default-to-derive (seq, world_size) or not given."""
    if value is None:
        return None
    return value_reason(name, annotation(name), value)


def check_number(name: str, value, integer: bool, bounds: tuple) -> str | None:
    """Why `value` cannot be `name`, a number in `bounds` = (low, high, low_open) (an integer when
    `integer`), or None: the rules and words of RunConfig's number fields, for numbers outside it
    (the planner's memory fraction, hardware files)."""
    low, high, low_open = bounds
    # annotated_types' constraints compare by value, so `_adapter` builds one adapter per distinct rule
    kind = Annotated[int if integer else float, (Gt if low_open else Ge)(low), Le(high)]
    return value_reason(name, kind, value)


WANTS = {"int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer",
         "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
         "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
         "tuple_type": "a list of KEY=VALUE strings"}


def config_problem(error: dict) -> str:
    """One pydantic error of a RunConfig field as our one line: the field, what it must be, the value."""
    name = next((str(p) for p in reversed(error["loc"]) if isinstance(p, str)), "value")
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind in WANTS:
        return f"{name} must be {WANTS[kind]}, got {value!r}"
    if kind == "greater_than_equal" and ctx["ge"] in (0, 1) and type(value) is int:
        return f"{name} must be a {'positive' if ctx['ge'] else 'non-negative'} integer, got {value!r}"
    for key, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
        if key in ctx and kind.startswith(("greater", "less")):
            return f"{name} must be {sign} {_plain(ctx[key])}, got {value!r}"
    if kind == "literal_error":
        known = choices(name) if name in FIELDS else ()
        return (f"{name} is {value!r}{suggest(str(value), map(str, known))} "
                f"(choose one of {', '.join(map(str, known)) or ctx.get('expected')})")
    if kind == "unexpected_keyword_argument":
        return f"unknown run config field(s) {[name]}{suggest(name, FIELDS)}"
    if kind == "unexpected_positional_argument":
        return f"RunConfig takes keyword arguments only (field=value), got the positional {value!r}"
    if kind == "value_error":  # our own checks: their text as written
        return str(ctx["error"])
    return f"{name}: {error['msg']}"


def _plain(number) -> str:
    return f"{number:,}" if isinstance(number, int) else f"{number:g}"


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def suggest(name, known) -> str:
    """'; did you mean X?' for the closest known name, or ''."""
    import difflib
    close = difflib.get_close_matches(str(name), sorted(str(k) for k in known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def model_config(preset: str, overrides: tuple | dict = ()) -> GPTConfig:
    items = overrides.items() if isinstance(overrides, dict) else overrides
    items = tuple(tuple(i) if isinstance(i, list) else i for i in items)
    try:
        return _model_config(preset, items)
    except TypeError:  # an unhashable value: not cacheable, and the override check below words the mistake
        return _model_config.__wrapped__(preset, items)


@lru_cache(maxsize=1024)
def _model_config(preset: str, items: tuple) -> GPTConfig:
    """Cached: the planner and the cost model ask for the same (frozen) model config thousands of times."""
    parsed = {}
    for item in items:
        key, value = item if isinstance(item, tuple) else _split_kv(item, "model_overrides")
        parsed[key] = value
    try:
        cfg = get_preset(preset)
        if not parsed:
            return cfg
        return cfg.with_overrides(**{k: _override_value(k, v) for k, v in parsed.items()})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _split_kv(item: str, name: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"{name} entry {item!r} must look like KEY=VALUE")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


MODEL_TYPES = typing.get_type_hints(GPTConfig)


def _override_value(key: str, value):
    """An override given as text (KEY=VALUE) as the GPTConfig field's type (pydantic's lax parsing:
    '8' → 8, 'true' → True); none/null for an optional field (kv_heads=none: back to its default)."""
    if not isinstance(value, str) or key not in MODEL_TYPES:
        return value  # an unknown key: with_overrides names it
    if type(None) in typing.get_args(MODEL_TYPES[key]) and value.lower() in ("none", "null"):
        return None
    try:
        return TypeAdapter(MODEL_TYPES[key]).validate_python(value)
    except ValidationError as e:
        wanted = WANTS.get(e.errors()[-1]["type"], e.errors()[-1]["msg"])
        raise ConfigError(f"model_overrides {key}={value}: {key} must be {wanted}") from None


def _normalize(cfg: RunConfig) -> None:
    """Fill the defaults that depend on other fields (frozen: set through object.__setattr__)."""
    if cfg.fsdp is None and cfg.backend in CAPABILITIES:
        object.__setattr__(cfg, "fsdp", CAPABILITIES[cfg.backend].fsdp_default)
    if cfg.seq is None:
        object.__setattr__(cfg, "seq", cfg.model_config.seq_len)
    if cfg.order in CP_NAMED_ORDERS:  # one name per layout, so one run id: tp-cp-dp-pp is tp-dp-pp
        object.__setattr__(cfg, "order", CP_NAMED_ORDERS[cfg.order])
    if cfg.cp == 1:  # no sequence to split: cp_comm means nothing, and cp = 1 run ids stay as they were
        object.__setattr__(cfg, "cp_comm", None)
    elif cfg.cp_comm is None and cfg.backend in CAPABILITIES:
        object.__setattr__(cfg, "cp_comm", (CAPABILITIES[cfg.backend].cp_comms or (None,))[0])


def _validate(cfg: RunConfig) -> None:
    """What types cannot say (the fault list, the world size), then what no engine could run, then what
    this backend cannot run."""
    reason = fault_reason(cfg.fault) or _world_size_reason(cfg) or structural_reason(cfg) or unsupported_reason(cfg)
    if reason:
        raise ConfigError(reason)


def _world_size_reason(cfg: RunConfig) -> str | None:
    if cfg.world_size is not None and cfg.world != cfg.world_size:
        return f"{layout_product(cfg)} = {cfg.world}, but world_size is {cfg.world_size}"
    return None


# Test-only faults: name → whether it takes a number (`sleep:400`). See bench.worker for what each does.
FAULTS = {"raise": False, "hang": False, "oom": False, "oom_real": False, "sleep": True, "slow_rank": True,
          "stage_sleep": True, "grad_scale": True, "lr_scale": True, "sgd": True}
FAULT_LIMIT = 3_600_000
"""No fault number may exceed this (an hour in milliseconds for the sleeps; far above any sane scale)."""


def parse_fault(fault: str) -> dict[str, float | None]:
    """`"sgd:1,grad_scale:2"` → {"sgd": 1.0, "grad_scale": 2.0}; "none" → {}. Raises ConfigError."""
    if fault == "none":
        return {}
    if not isinstance(fault, str):
        raise ConfigError(f"fault is {fault!r}; choose none or a comma-separated list of test-only faults")
    out: dict[str, float | None] = {}
    for part in fault.split(","):
        name, _, number = part.strip().partition(":")
        if name not in FAULTS or FAULTS[name] != bool(number):
            usage = ", ".join(f"{k}:X" if v else k for k, v in FAULTS.items())
            raise ConfigError(f"fault is {fault!r}; choose none or a comma-separated list of {usage}")
        try:
            value = float(number) if number else None
        except ValueError:
            raise ConfigError(f"fault {part!r}: {number!r} is not a number (e.g. sleep:50)") from None
        reason = value is not None and check_number(name, value, False, (0, FAULT_LIMIT, False))
        if reason:
            raise ConfigError(f"fault {part!r}: {reason}")
        out[name] = value
    return out


def fault_reason(fault) -> str | None:
    """Why `fault` is not a valid test-only fault list, or None."""
    try:
        parse_fault(fault)
    except ConfigError as e:
        return str(e)
    return None


def structural_reason(shape) -> str | None:
    """Why no engine could run this shape (model fit, pipeline shape, schedule rules), or None.

    Reads only the layout and batch fields, so the planner's unvalidated candidates use it too; the
    second layer, what one backend supports, is bench.capabilities.unsupported_reason."""
    return _model_fit_reason(shape) or _context_reason(shape) or _expert_reason(shape) or _pipeline_reason(shape)


def _model_fit_reason(cfg) -> str | None:
    m = cfg.model_config
    # kv_heads: tensor parallel splits whole query groups with their K/V head (no K/V replication)
    for what, value in (("heads", m.heads), ("kv_heads", m.num_kv_heads), ("ffn_hidden", m.ffn_hidden),
                        ("vocab", m.vocab)):
        if value % cfg.tp:
            return f"model {what} ({value}) is not divisible by tp ({cfg.tp}); pick tp from the divisors of {value}"
    if cfg.seq > m.seq_len and m.position == "learned":
        return f"seq ({cfg.seq}) exceeds the model's seq_len ({m.seq_len})"
    if cfg.sequence_parallel and cfg.tp == 1:
        return "sequence_parallel needs tp > 1 (it shards along the sequence within a tp group)"
    if cfg.sequence_parallel and cfg.seq % cfg.tp:
        return f"sequence_parallel needs seq ({cfg.seq}) divisible by tp ({cfg.tp})"
    return None


def _context_reason(cfg) -> str | None:
    if cfg.cp == 1:
        return None
    if cfg.cp_comm == "ulysses" and cfg.seq % cfg.cp:  # contiguous chunks (bench.data.sequence_share)
        return f"cp ({cfg.cp}) needs seq ({cfg.seq}) divisible by cp (each rank holds one chunk); pick seq or cp to fit"
    if cfg.cp_comm != "ulysses" and seq_split_reason(cfg.seq, cfg.cp):
        return seq_split_reason(cfg.seq, cfg.cp)
    if cfg.sequence_parallel and (cfg.seq // cfg.cp) % cfg.tp:
        return (f"sequence_parallel with cp ({cfg.cp}) needs seq / cp ({cfg.seq // cfg.cp}) divisible by "
                f"tp ({cfg.tp})")
    m = cfg.model_config
    if cfg.cp_comm == "ulysses":  # all-to-all trades a rank's sequence chunk for cp-th of its heads
        for what, heads in (("heads", m.heads), ("kv_heads", m.num_kv_heads)):
            if heads % (cfg.tp * cfg.cp):
                return (f"cp_comm ulysses needs model {what} ({heads}) divisible by tp × cp = {cfg.tp * cfg.cp}; "
                        f"pick tp × cp dividing it, or cp_comm ring (backend {' or '.join(_ring_backends())})")
    return None


def _expert_reason(cfg) -> str | None:
    if reason := ep_split_reason(cfg.dp, cfg.cp, cfg.ep):
        return reason
    m = cfg.model_config
    experts = m.experts
    if cfg.ep > 1 and not experts:
        return (f"ep ({cfg.ep}) > 1 needs a mixture-of-experts model, but model {cfg.model} is dense (experts = 0); "
                "use ep 1, or an MoE model (model_overrides experts=N)")
    if experts % cfg.ep:
        return f"model experts ({experts}) is not divisible by ep ({cfg.ep}); pick ep from the divisors of {experts}"
    if experts and cfg.cp > 1 and m.moe_capacity_factor is not None:
        return (f"model moe_capacity_factor with cp ({cfg.cp}) > 1 is not supported: capacity is counted per whole "
                "sequence, and cp splits each sequence over ranks; use cp 1, or moe_capacity_factor=none (dropless)")
    return None


CP_NAMED_ORDERS = {"tp-cp-pp-dp": "tp-pp-dp", "tp-cp-dp-pp": "tp-dp-pp"}
"""The ecosystem's names of the orders that place cp next to tp, and the names every order has here."""


def _ring_backends() -> list[str]:
    return [name for name, caps in CAPABILITIES.items() if "ring" in caps.cp_comms]


def _pipeline_reason(cfg) -> str | None:
    m, chunks = cfg.model_config, cfg.pp * cfg.virtual_stages
    if m.layers < chunks:
        return (f"model layers ({m.layers}) < pp ({cfg.pp}) × virtual_stages ({cfg.virtual_stages}) "
                f"= {chunks}: every pipeline stage needs at least one layer")
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        return f"virtual_stages ({cfg.virtual_stages}) > 1 needs schedule interleaved, not {cfg.schedule}"
    if cfg.virtual_stages > 1 and cfg.pp == 1:
        return (f"virtual_stages ({cfg.virtual_stages}) > 1 needs pp > 1 "
                "(interleaving spreads model chunks over pipeline ranks)")
    if cfg.schedule == "interleaved" and cfg.pp > 1:
        if m.layers % chunks:
            return (f"interleaved: model layers ({m.layers}) must be divisible by pp ({cfg.pp}) × "
                    f"virtual_stages ({cfg.virtual_stages}) = {chunks}")
        if cfg.micro_batches % cfg.pp:
            return f"interleaved: micro_batches ({cfg.micro_batches}) must be a multiple of pp ({cfg.pp})"
    return None
