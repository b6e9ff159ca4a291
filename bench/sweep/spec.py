"""Sweep files: YAML → a validated `SweepSpec` → RunConfigs plus skipped rows (with the reason).

A sweep file (loaded with `yaml.safe_load`; every key is optional except `grid`):

    name: quickstart                 # default: the file's stem; names the output folder results/<name>/
    model: tiny                      # a preset, or {preset: tiny, layers: 8, ...} (GPTConfig overrides);
                                     # a list is an axis: {preset: tiny-gqa, kv_heads: [1, 2, 4]}
    world_size: 4                    # an int or a list of ints (then an axis); needed by `dp: auto`
    base: {steps: 3, dtype: fp32}    # RunConfig fields shared by every run
    grid:                            # cartesian product; any RunConfig field is an axis
      backend: [native, ddp, fsdp, deepspeed]
      tp: [1, 2]
      dp: auto                       # world_size / (tp · cp · pp)
    zip:                             # groups of axes that move together (lists of equal length)
      - {micro_batch: [1, 2, 4], micro_batches: [8, 4, 2]}
    backends:                        # options (axes) that apply to one backend only
      deepspeed: {zero: [0, 3]}
    deepspeed: {zero_optimization: {overlap_comm: false}}   # → ds_set of the deepspeed runs (dotted keys)
    runs:                            # explicit configs (each one point, crossed with the grid if any;
      - {tp: 2, pp: 1, dp: 2}        # a sweep needs a grid, runs, or both): what `bench plan --emit-sweep` writes
      - {tp: 1, pp: 2, dp: 2, schedule: gpipe}
    exclude:                         # a run matching every key of one rule is left out
      - {backend: fsdp, pp: 2}
    repeats: 1                       # runs per config (noise); the `repeat` field tells them apart
    repeat_order: interleaved        # interleaved: repeat k of every config before repeat k+1 of any
                                     # (A B C A B C: drift hits every backend alike); blocked: A A B B C C
    launcher: local                  # local | debug | slurm | {kind: slurm, profile: local, nodes: 2, ...}
    report: true                     # write the HTML/Markdown report to OUT/report/ after the sweep
    prune: {fit: true, slower_than_best: 2.0}   # skip, as rows with the predicted figures, configs the
                                     # analytic model predicts not to fit in device memory, or slower per
                                     # token than K × the best predicted config (bench/sweep/prune.py);
                                     # hardware: NAME picks the profile (default: the runs' device's)

The file is read into pydantic v2 models (`SweepFile` below) whose value types are built from
RunConfig's and GPTConfig's own fields, so a new RunConfig field is a sweep key with no edit here;
pydantic because its errors carry the key path, its strict types refuse '8' for an integer, and
DeepSpeed already depends on it (bench/typed_yaml.py turns its errors into our one line).
Any mistake in the file is a `SweepError` naming the file, the key path and the fix; nothing is
launched. A combination that the file describes correctly but that cannot run (tp does not divide
the heads, a backend without pipeline support, …) is not an error: it becomes a `skipped` row whose
`error` is RunConfig's message.
"""
from __future__ import annotations

import itertools
import json
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, WrapValidator,
                      create_model, field_validator, model_validator)

from bench.choices import BACKENDS
from bench.layout import layout_product, named_dims
from bench.config import (LIST_FIELDS, MODEL_TYPES, ConfigError, RunConfig, annotation, check_number, choices, fault_reason,
                          field_reason)
from bench.config import model_config as resolve_model  # `model_config` is pydantic's name for a model's settings
from bench.results import skipped_row
from bench.typed_yaml import FileError, file_error, kind, load_yaml, mistake, suggest
from models.config import PRESETS, GPTConfig

TOP_KEYS = ("name", "model", "world_size", "base", "grid", "runs", "zip", "backends", "deepspeed", "exclude",
            "repeats", "repeat_order", "launcher", "report", "prune")
PRUNE_KEYS = ("fit", "slower_than_best", "hardware")
REPEAT_ORDERS = ("interleaved", "blocked")
LAUNCHERS = ("local", "slurm", "debug")
RUN_FIELDS = {f.name: f for f in fields(RunConfig)}
# Set by the sweep itself, not by the file: `repeats` makes the repeat index; `model` is top-level or an axis.
NOT_SETTABLE = {"repeat": "use the top-level key `repeats: K` instead",
                "model_overrides": "give overrides in the top-level model: {preset: NAME, KEY: VALUE}"}
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name != "name")


SweepError = FileError
"""A sweep file the user must fix: '<file>: <key path>: <problem>'."""


@dataclass(frozen=True)
class LauncherSpec:
    kind: str = "local"
    profile: str | None = None
    options: dict = field(default_factory=dict)
    """Profile keys the sweep file overrides (validated against the profile by bench.sweep.slurm)."""


@dataclass(frozen=True)
class PruneSpec:
    """`prune:` which configs the analytic model may skip before anything launches (bench/sweep/prune.py)."""
    fit: bool = False
    """Skip configs predicted not to fit in the device memory of the hardware profile."""
    slower_than_best: float | None = None
    """Skip configs whose predicted time per token is more than this many times the sweep's best."""
    hardware: str | None = None
    """The profile to predict on; None: the runs' device's (cpu → the `cpu` profile, a local GPU → its own)."""


@dataclass(frozen=True)
class SweepSpec:
    name: str
    source: str
    model: str
    model_overrides: tuple
    world_sizes: tuple[int, ...] | None
    base: dict
    grid: dict
    """axis → tuple of values (or the string 'auto' for dp)."""
    zips: tuple[dict, ...]
    backends: dict
    ds_set: tuple
    exclude: tuple[dict, ...]
    repeats: int
    launcher: LauncherSpec
    report: bool = False
    repeat_order: str = "interleaved"
    """interleaved: every config's repeat k runs before any repeat k+1; blocked: a config's repeats back to back."""
    model_axes: dict = field(default_factory=dict)
    """Model field → tuple of values (`model: {kv_heads: [1, 2]}`): each value one more model override."""
    runs: tuple[dict, ...] = ()
    """Explicit points (`runs: [{tp: 2, dp: 2}, …]`), one factor of the expansion like a zip group."""
    prune: PruneSpec | None = None


@dataclass
class Expansion:
    runs: list[RunConfig]
    skipped: list[dict]
    """Rows (status skipped, error = the reason) for combinations that cannot run."""
    excluded: int = 0
    duplicates: int = 0
    pruned: set = field(default_factory=set)
    """run_ids that `prune:` turned into skipped rows (bench/sweep/prune.py)."""
    predictions: dict = field(default_factory=dict)
    """run_id → bench.sweep.prune.Prediction, filled when the sweep is planned."""
    warnings: list = field(default_factory=list)
    """Lines to show once (e.g. why nothing could be pruned)."""
    profile_note: str | None = None
    """The line saying which profile the predictions use (calibrated now, or cached), when the sweep calibrated."""


# --- the file's schema: pydantic models built from RunConfig and GPTConfig (bench/typed_yaml.py: why) -------

STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def _choice(name: str, choices: tuple) -> AfterValidator:
    def check(value):
        if value not in choices:
            raise mistake(f"{name} {value!r} is not one of {', '.join(map(str, choices))}{suggest(value, choices)}")
        return value
    return AfterValidator(check)


def _no_fault(value):
    reason = fault_reason(value)
    if reason:
        raise mistake(reason)
    return value


def _or_auto(value, handler):
    """dp may be `auto`: world_size / (tp · cp · pp)."""
    if value == "auto":
        return value
    try:
        return handler(value)
    except ValidationError as e:
        if e.errors()[0]["type"] != "int_type":
            raise
        raise mistake(f"dp must be an integer (or auto), got {value!r} ({kind(value)})") from None


def _key_values(value):
    """A tuple field (ds_set) as a file writes it: KEY=VALUE strings in a list, one string, or a mapping."""
    if not isinstance(value, (list, dict, str)):
        raise mistake(f"must be a list of KEY=VALUE strings, got {value!r} ({kind(value)})")
    return value


def _value_type(name: str):
    """The type of one RunConfig field's value: the field's own annotation (bounds, strictness), a choice
    field's values worded as the file's key, and dp's `auto`."""
    if name in LIST_FIELDS:
        return Annotated[Any, BeforeValidator(_key_values)]
    known = choices(name)
    if known:  # the Literal's value type, then the choice in the sweep file's words
        value = Annotated[type(known[0]), _choice(name, known)]
        return Optional[value] if type(None) in typing.get_args(annotation(name)) else value
    value = annotation(name)
    if name == "fault":
        value = Annotated[value, AfterValidator(_no_fault)]
    if name == "dp":
        value = Annotated[value, WrapValidator(_or_auto)]
    return value


def _axis(name: str) -> BeforeValidator:
    """An axis: a list of values, or one value (a tuple field's list is one value)."""
    one_value = name in LIST_FIELDS

    def as_list(value):
        if one_value or not isinstance(value, list):
            return [value]
        if not value:
            raise mistake("empty list: an axis needs at least one value")
        return value
    return BeforeValidator(as_list)


class _SingleValues(BaseModel):
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_lists(cls, data):
        for name, value in (data.items() if isinstance(data, dict) else ()):
            if isinstance(value, list) and name in RUN_FIELDS and name not in LIST_FIELDS:
                raise mistake(f"base values are single values; put the list {value!r} under grid.{name}", name)
        return data


SETTABLE = [name for name in RUN_FIELDS if name not in NOT_SETTABLE]
# Absent fields stay unset (default None, never validated); a null the file writes is checked by the type.
RunValues = create_model("RunValues", __base__=_SingleValues, **{n: (_value_type(n), None) for n in SETTABLE})
RunAxes = create_model("RunAxes", __config__=STRICT,
                       **{n: (Annotated[list[_value_type(n)], _axis(n)], None) for n in SETTABLE})


class _ModelBase(BaseModel):
    model_config = STRICT
    preset: Optional[str] = None

    @model_validator(mode="after")
    def _known_preset(self):
        if self.preset is None:
            raise mistake("missing: name the preset to start from, e.g. {preset: tiny, layers: 8}", "preset")
        if self.preset not in PRESETS:
            raise mistake(f"unknown preset {self.preset!r}{suggest(self.preset, PRESETS)} "
                          f"(known: {', '.join(PRESETS)})", "preset")
        try:
            resolve_model(self.preset, _overrides(self, self.model_fields_set))
        except ConfigError as e:  # the model's own invariants, e.g. hidden divisible by heads
            raise mistake(str(e)) from None
        return self


ModelBlock = create_model("ModelBlock", __base__=_ModelBase,
                          **{n: (t, None) for n, t in MODEL_TYPES.items() if n != "name"})


def _overrides(block: BaseModel, keys) -> tuple:
    """model_overrides in the file's key order (it is part of the run id)."""
    return tuple(_override(k, getattr(block, k)) for k in keys if k != "preset")


def _override(key: str, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"




def _split_model_axes(data: dict, source: str) -> tuple[dict, dict]:
    """`model: {preset: P, kv_heads: [1, 2, 4]}`: a list is an axis over that model field. Each value is
    type-checked here; whether it fits the model (heads % kv_heads, kv_heads % tp) is RunConfig's to say,
    per combination, as a skipped row."""
    from pydantic import TypeAdapter
    model = data.get("model")
    axes = {k: v for k, v in model.items() if isinstance(v, list)} if isinstance(model, dict) else {}
    for key, values in axes.items():
        if key not in MODEL_TYPES or key == "name":
            raise SweepError(source, f"model.{key}", _unknown_key(("model", key)))
        if not values:
            raise SweepError(source, f"model.{key}", "an axis needs at least one value, e.g. [1, 2]")
        adapter = TypeAdapter(MODEL_TYPES[key])
        for i, value in enumerate(values):
            try:
                adapter.validate_python(value, strict=True)
            except ValidationError as e:
                raise SweepError(source, f"model.{key}[{i}]", e.errors()[0]["msg"].lower() + f", got {value!r}") from None
    if not axes:
        return data, {}
    fixed = {k: v for k, v in model.items() if k not in axes}
    return {**data, "model": fixed}, {k: tuple(v) for k, v in axes.items()}


class LauncherBlock(BaseModel):
    """`launcher:` a kind, or {kind: slurm, profile: NAME, KEY: VALUE…} (profile overrides, checked by slurm.py)."""
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    kind: str = "local"
    profile: Optional[str] = None

    @model_validator(mode="after")
    def _options_for_slurm(self):
        if self.kind not in LAUNCHERS:
            raise mistake(f"unknown launcher {self.kind!r}{suggest(self.kind, LAUNCHERS)} "
                          f"(known: {', '.join(LAUNCHERS)})", "kind")
        extra = sorted({*self.model_extra, *({"profile"} & self.model_fields_set)})
        if self.kind != "slurm" and extra:
            raise mistake(f"only the slurm launcher takes options; launcher {self.kind} takes none", extra[0])
        return self


class PruneBlock(BaseModel):
    """`prune: {fit: true, slower_than_best: 2.0, hardware: h100-sxm}`."""
    model_config = STRICT
    fit: bool = False
    slower_than_best: Optional[float] = None
    hardware: Optional[str] = None

    @field_validator("slower_than_best", mode="before")
    @classmethod
    def _factor(cls, value):
        reason = check_number("slower_than_best", value, False, (1, 1e9, False))
        if reason:
            raise mistake(reason.removeprefix("slower_than_best ")
                          + " (a factor ≥ 1: 2.0 skips configs predicted over twice as slow as the best)")
        return float(value)

    @field_validator("hardware", mode="before")
    @classmethod
    def _known_hardware(cls, value):
        from bench.analysis.hardware import get_hardware
        if not isinstance(value, str) or not value:
            raise mistake(f"must be a hardware profile name or YAML file, got {value!r}")
        try:
            get_hardware(value)
        except (ValueError, FileError) as e:
            raise mistake(str(e)) from None
        return value


class SweepFile(BaseModel):
    """The keys of a sweep file (the module docstring shows each)."""
    model_config = STRICT
    name: Optional[str] = None
    model: ModelBlock = ModelBlock(preset="tiny")
    world_size: Optional[list[int]] = None
    base: RunValues = RunValues()
    grid: Optional[RunAxes] = None
    runs: list[RunValues] = []
    zip: list[RunAxes] = []
    backends: dict[str, RunAxes] = {}
    deepspeed: dict = {}
    exclude: list[RunAxes] = []
    repeats: int = 1
    repeat_order: Annotated[str, _choice("repeat_order", REPEAT_ORDERS)] = "interleaved"
    launcher: LauncherBlock = LauncherBlock()
    report: bool = False
    prune: Optional[PruneBlock] = None

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value):
        if not isinstance(value, str) or not value or "/" in value:
            raise mistake(f"must be a non-empty string without '/', got {value!r}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _preset_name(cls, value):
        if isinstance(value, str):
            return {"preset": value}
        if not isinstance(value, dict):
            raise mistake(f"must be a preset name or a mapping {{preset: NAME, KEY: VALUE}}, got {kind(value)}")
        return value

    @field_validator("world_size", mode="before")
    @classmethod
    def _world_sizes(cls, value):
        values = value if isinstance(value, list) else [value]
        if not values or not all(type(v) is int and v >= 1 for v in values):
            raise mistake(f"must be a positive integer or a non-empty list of them, got {value!r}")
        too_big = next((field_reason("world_size", v) for v in values if field_reason("world_size", v)), None)
        if too_big:
            raise mistake(too_big)
        return values

    @field_validator("base", mode="before")
    @classmethod
    def _base(cls, value):
        return {} if value is None else value

    @field_validator("grid", mode="before")
    @classmethod
    def _grid(cls, value):
        if value is None:
            raise mistake(MISSING_GRID)
        if not isinstance(value, dict) or not value:
            raise mistake(f"must be a non-empty mapping of axes (field: [values]), got {value!r}")
        return value

    @field_validator("runs", mode="before")
    @classmethod
    def _run_list(cls, runs):
        if not isinstance(runs, list) or not runs:
            raise mistake(f"must be a non-empty list of configs like {{tp: 2, dp: 2}}, got {runs!r}")
        for i, run in enumerate(runs):
            if not isinstance(run, dict) or not run:
                raise mistake(f"a run is a non-empty mapping field: value, got {run!r}", i)
            for name, value in run.items():
                if isinstance(value, list) and name in RUN_FIELDS and name not in LIST_FIELDS:
                    raise mistake(f"a run holds single values; give each config its own run, or put the list "
                                  f"{value!r} under grid.{name}", i, name)
        return runs

    @field_validator("prune", mode="before")
    @classmethod
    def _prune_block(cls, value):
        if not isinstance(value, dict):
            raise mistake(f"must be a mapping like {{fit: true, slower_than_best: 2.0}}, got {kind(value)}")
        return value

    @field_validator("zip", mode="before")
    @classmethod
    def _zip_groups(cls, groups):
        if not isinstance(groups, list):
            raise mistake(f"must be a list of groups like {{micro_batch: [1, 2], micro_batches: [8, 4]}}, "
                          f"got {kind(groups)}")
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or len(group) < 2:
                raise mistake("a zip group is a mapping of at least two axes whose lists move together", i)
            for name, values in group.items():
                if not isinstance(values, list):
                    raise mistake(f"must be a list, got {kind(values)}", i, name)
            lengths = {name: len(values) for name, values in group.items()}
            if len(set(lengths.values())) > 1:
                raise mistake(f"lists must have equal lengths, got {lengths}", i)
        return groups

    @field_validator("backends", mode="before")
    @classmethod
    def _backend_names(cls, block):
        if not isinstance(block, dict):
            raise mistake(f"must be a mapping backend → options, got {kind(block)}")
        for backend, options in block.items():
            if backend not in BACKENDS:
                raise mistake(f"unknown backend{suggest(backend, BACKENDS)} (known: {', '.join(BACKENDS)})", backend)
            if isinstance(options, dict) and "backend" in options:
                raise mistake("the backend is the block's name; remove this key", backend, "backend")
        return block

    @field_validator("exclude", mode="before")
    @classmethod
    def _rules(cls, rules):
        if not isinstance(rules, list):
            raise mistake(f"must be a list of rules like {{backend: ddp, tp: 2}}, got {kind(rules)}")
        for i, rule in enumerate(rules):
            if not isinstance(rule, dict) or not rule:
                raise mistake(f"a rule is a non-empty mapping field: value(s), got {rule!r}", i)
        return rules

    @field_validator("repeats", mode="before")
    @classmethod
    def _repeats(cls, value):
        reason = check_number("repeats", value, True, (1, MAX_REPEATS, False))
        if reason:
            raise mistake(reason.removeprefix("repeats "))  # the key path names it
        return value

    @field_validator("launcher", mode="before")
    @classmethod
    def _launcher_kind(cls, value):
        if isinstance(value, str):
            return {"kind": value}
        if not isinstance(value, dict):
            raise mistake(f"must be local, debug, slurm or a mapping {{kind: slurm, profile: NAME}}, got {kind(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.grid is None and not self.runs:
            raise mistake(MISSING_GRID, "grid")
        seen = {name: "grid" for name in (self.grid.model_fields_set if self.grid else ())}
        for i, group in enumerate(self.zip):
            for name in group.model_fields_set:
                if name in seen:
                    raise mistake(f"{name} is already an axis in {seen[name]}; give it once", "zip", i, name)
                seen[name] = f"zip[{i}]"
        for name in self.base.model_fields_set:
            if name in seen:
                raise mistake(f"{name} is also an axis in {seen[name]}; remove one of them", "base", name)
        self._check_runs(seen)
        combinations = (math.prod(len(getattr(self.grid, n)) for n in (self.grid.model_fields_set if self.grid else ()))
                        * math.prod(len(getattr(g, next(iter(g.model_fields_set)))) for g in self.zip)
                        * self.repeats * len(self.world_size or [1]) * max(len(self.runs), 1))
        if combinations > MAX_RUNS:
            raise mistake(f"{combinations:,} combinations (axes × repeats): more than {MAX_RUNS:,}, the most a "
                          "sweep expands; split it", "grid")
        grid_dp = self.grid.dp if self.grid else None
        auto_in = "grid" if grid_dp == ["auto"] else "base" if self.base.dp == "auto" else None
        if auto_in and self.world_size is None and "world_size" not in seen:
            raise mistake("dp: auto needs a world size: add a top-level `world_size: N`", auto_in, "dp")
        return self

    def _check_runs(self, axes: dict) -> None:
        """A run's key is not also an axis or a base value (which would win is not obvious); its dp: auto
        needs a world size from somewhere."""
        for i, run in enumerate(self.runs):
            for name in run.model_fields_set:
                if name in axes or name in self.base.model_fields_set:
                    where = axes.get(name, "base")
                    raise mistake(f"{name} is also given in {where}; give it in one place", "runs", i, name)
            world_known = self.world_size is not None or "world_size" in axes or "world_size" in run.model_fields_set
            if run.dp == "auto" and not world_known:
                raise mistake("dp: auto needs a world size: add `world_size: N` to the run or the file", "runs", i, "dp")


MAX_RUNS = 100_000
MAX_REPEATS = 1_000
MISSING_GRID = "missing: a sweep needs a grid with at least one axis, e.g. grid: {tp: [1, 2]}"


def _unknown_key(loc: tuple) -> str:
    key = loc[-1]
    if len(loc) == 1:
        return f"unknown key{suggest(key, TOP_KEYS)} (known: {', '.join(TOP_KEYS)})"
    if loc[0] == "model":
        return f"unknown model field{suggest(key, MODEL_FIELDS)} (known: {', '.join(MODEL_FIELDS)})"
    if loc[0] == "prune":
        return f"unknown prune key{suggest(key, PRUNE_KEYS)} (known: {', '.join(PRUNE_KEYS)})"
    if key in NOT_SETTABLE:
        return f"{key} cannot be set here: {NOT_SETTABLE[key]}"
    return f"unknown run config field{suggest(key, RUN_FIELDS)} (`bench run --help` lists them)"


# --- loading ------------------------------------------------------------------------------------------------


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    return parse_sweep(load_yaml(path, "sweep file"), str(path), default_name=path.stem)


def parse_sweep(data: Any, source: str = "<sweep>", default_name: str = "sweep") -> SweepSpec:
    if not isinstance(data, dict):
        raise SweepError(source, "", f"the file must be a mapping of keys ({', '.join(TOP_KEYS)}), got {kind(data)}")
    data, model_axes = _split_model_axes(data, source)
    try:
        file = SweepFile.model_validate(data)
    except ValidationError as e:
        raise file_error(e, source, unknown=_unknown_key, data=data) from None
    launcher = file.launcher
    options = dict(launcher.model_extra)
    if launcher.kind == "slurm":  # the profile and the file's overrides of it
        from bench.sweep.slurm import load_profile
        load_profile(launcher.profile or "local", options, source=source)
    return SweepSpec(
        name=file.name or default_name, source=source, model=file.model.preset,
        model_overrides=_overrides(file.model, data["model"] if isinstance(data.get("model"), dict) else ()),
        world_sizes=tuple(file.world_size) if file.world_size else None,
        base={k: getattr(file.base, k) for k in data.get("base") or {}},
        grid=_axes(file.grid, data["grid"]) if file.grid else {},
        runs=tuple({k: getattr(run, k) for k in raw} for run, raw in zip(file.runs, data.get("runs", []))),
        zips=tuple(_axes(group, raw) for group, raw in zip(file.zip, data.get("zip", []))),
        backends={b: _axes(block, data["backends"][b]) for b, block in file.backends.items()},
        ds_set=tuple(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in _flatten(file.deepspeed)),
        exclude=tuple({k: {_hashable(x) for x in v} if v != "auto" else {"auto"} for k, v in _axes(rule, raw).items()}
                      for rule, raw in zip(file.exclude, data.get("exclude", []))),
        repeats=file.repeats, repeat_order=file.repeat_order, model_axes=model_axes,
        launcher=LauncherSpec(kind=launcher.kind, profile=(launcher.profile or "local") if launcher.kind == "slurm"
                              else None, options=options),
        report=file.report,
        prune=PruneSpec(**file.prune.model_dump()) if file.prune else None)


def _axes(block: BaseModel, raw: dict) -> dict:
    """Axis → tuple of values, in the file's order (the order of the expansion); `dp: auto` stays 'auto'."""
    return {name: "auto" if name == "dp" and raw[name] == "auto" else tuple(getattr(block, name)) for name in raw}


def _flatten(block: dict, prefix: str = ""):
    for key, value in block.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def describe(cfg: RunConfig | dict) -> str:
    """A run in a few words (progress lines, skip reasons): the layout and what sets it apart."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    text = f"{get('backend')} " + " ".join(f"{d}={get(d)}" for d in named_dims(get("cp") or 1, get("ep") or 1))
    if get("backend") == "deepspeed" or get("zero"):
        text += f" zero={get('zero')}"
    if get("fsdp"):
        text += f" fsdp={get('fsdp')}"
    if get("fault") not in (None, "none"):
        text += f" fault={get('fault')}"
    if get("repeat"):
        text += f" repeat={get('repeat')}"
    return text


# --- expansion --------------------------------------------------------------------------------------------


def expand(spec: SweepSpec) -> Expansion:
    """Every combination of the grid (× backend options × repeats) as a RunConfig or a skipped row."""
    out, seen = Expansion(runs=[], skipped=[]), set()
    for point in _points(spec):
        for backend_point in _backend_points(spec, point):
            for repeat in range(spec.repeats):
                params = {**backend_point, "repeat": repeat}
                params, reason = _resolve(spec, params)
                item = _make(params, reason)
                if _excluded(spec, item):
                    out.excluded += 1
                    continue
                key = item.run_id if isinstance(item, RunConfig) else item["run_id"]
                if key in seen:
                    out.duplicates += 1
                    continue
                seen.add(key)
                (out.runs.append if isinstance(item, RunConfig) else out.skipped.append)(item)
    if spec.repeat_order == "interleaved":
        out.runs.sort(key=lambda cfg: cfg.repeat)  # stable: file order within a repeat
    return out


def _points(spec: SweepSpec):
    factors = []
    if spec.world_sizes is not None and "world_size" not in spec.grid:
        factors.append([{"world_size": w} for w in spec.world_sizes])
    for name, values in spec.grid.items():
        factors.append([{name: "auto"}] if values == "auto" else [{name: v} for v in values])
    for group in spec.zips:
        n = len(next(iter(group.values())))
        factors.append([{name: values[i] for name, values in group.items()} for i in range(n)])
    if spec.runs:
        factors.append([dict(run) for run in spec.runs])
    if spec.model_axes:  # one factor: every combination of the model axes, as the overrides it adds
        names = list(spec.model_axes)
        factors.append([{"model_overrides": spec.model_overrides + tuple(map(_override, names, combo))}
                        for combo in itertools.product(*spec.model_axes.values())])
    common = {"model": spec.model, "model_overrides": spec.model_overrides, **spec.base}
    for combo in itertools.product(*factors):
        point = dict(common)
        for part in combo:
            point.update(part)
        yield point


def _backend_points(spec: SweepSpec, point: dict):
    backend = point.get("backend", RUN_FIELDS["backend"].default)
    options = spec.backends.get(backend, {})
    if backend == "deepspeed" and spec.ds_set:
        point = {**point, "ds_set": tuple(point.get("ds_set", ())) + spec.ds_set}
    names = list(options)
    for values in itertools.product(*(options[n] for n in names)):
        yield {**point, **dict(zip(names, values))}


def _resolve(spec: SweepSpec, params: dict) -> tuple[dict, str | None]:
    """Fill dp: auto from the world size; say why when it does not divide."""
    if params.get("dp") != "auto":
        return params, None
    world = params["world_size"]
    sizes = SimpleNamespace(**{d: params.get(d, 1) for d in ("tp", "cp", "pp")})
    others = sizes.tp * sizes.cp * sizes.pp
    if world % others:
        return params, (f"dp: auto: world_size ({world}) is not divisible by {layout_product(sizes, ('tp', 'cp', 'pp'))} "
                        f"= {others}")
    return {**params, "dp": world // others}, None


def _excluded(spec: SweepSpec, item: RunConfig | dict) -> bool:
    """Rules match the final values (a RunConfig's normalized fields, e.g. fsdp=full by default)."""
    if isinstance(item, RunConfig):
        value = lambda k: item.world if k == "world_size" else getattr(item, k)  # noqa: E731
    else:
        value = lambda k: item.get(k)  # noqa: E731
    return any(all(_hashable(value(k)) in allowed for k, allowed in rule.items()) for rule in spec.exclude)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _make(params: dict, reason: str | None) -> RunConfig | dict:
    if reason is None:
        try:
            return RunConfig(**params)
        except ConfigError as e:
            reason = str(e)
    return skipped_row(params, reason)
