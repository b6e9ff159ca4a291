"""Sweep files: YAML → a validated `SweepSpec` → RunConfigs plus skipped rows (with the reason).

A sweep file (loaded with `yaml.safe_load`; every key is optional except `grid`):

    name: quickstart                 # default: the file's stem; names the output folder results/<name>/
    model: tiny                      # a preset, or {preset: tiny, layers: 8, ...} (GPTConfig overrides)
    world_size: 4                    # an int or a list of ints (then an axis); needed by `dp: auto`
    base: {steps: 3, dtype: fp32}    # RunConfig fields shared by every run
    grid:                            # cartesian product; any RunConfig field is an axis
      backend: [native, ddp, fsdp, deepspeed]
      tp: [1, 2]
      dp: auto                       # world_size / (tp · pp)
    zip:                             # groups of axes that move together (lists of equal length)
      - {micro_batch: [1, 2, 4], micro_batches: [8, 4, 2]}
    backends:                        # options (axes) that apply to one backend only
      deepspeed: {zero: [0, 3]}
    deepspeed: {zero_optimization: {overlap_comm: false}}   # → ds_set of the deepspeed runs (dotted keys)
    exclude:                         # a run matching every key of one rule is left out
      - {backend: fsdp, pp: 2}
    repeats: 1                       # runs per config (noise); the `repeat` field tells them apart
    launcher: local                  # local | debug | slurm | {kind: slurm, profile: local, nodes: 2, ...}
    report: true                     # write the HTML/Markdown report to OUT/report/ after the sweep

Any mistake in the file is a `SweepError` naming the file, the key path and the fix; nothing is
launched. A combination that the file describes correctly but that cannot run (tp does not divide
the heads, a backend without pipeline support, …) is not an error: it becomes a `skipped` row whose
`error` is RunConfig's message.
"""
from __future__ import annotations

import difflib
import itertools
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bench.config import BACKENDS, ConfigError, RunConfig
from bench.results import skipped_row
from models.config import GPTConfig

TOP_KEYS = ("name", "model", "world_size", "base", "grid", "zip", "backends", "deepspeed", "exclude", "repeats",
            "launcher", "report")
LAUNCHERS = ("local", "slurm", "debug")
RUN_FIELDS = {f.name: f for f in fields(RunConfig)}
# Set by the sweep itself, not by the file: `repeats` makes the repeat index; `model` is top-level or an axis.
NOT_SETTABLE = {"repeat": "use the top-level key `repeats: K` instead",
                "model_overrides": "give overrides in the top-level model: {preset: NAME, KEY: VALUE}"}
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name != "name")


class SweepError(ConfigError):
    """A sweep file the user must fix: '<file>: <key path>: <problem>'."""

    def __init__(self, source: str, path: str, problem: str):
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def suggest(name: str, known) -> str:
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class LauncherSpec:
    kind: str = "local"
    profile: str | None = None
    options: dict = field(default_factory=dict)
    """Profile keys the sweep file overrides (validated against the profile by bench.sweep.slurm)."""


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


@dataclass
class Expansion:
    runs: list[RunConfig]
    skipped: list[dict]
    """Rows (status skipped, error = the reason) for combinations that cannot run."""
    excluded: int = 0
    duplicates: int = 0


# --- loading and validation -------------------------------------------------------------------------------


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise SweepError(source, "", "no such sweep file")
    import yaml
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SweepError(source, "", f"malformed YAML: {where}{getattr(e, 'problem', None) or e}") from None
    return parse_sweep(data, source, default_name=path.stem)


def parse_sweep(data: Any, source: str = "<sweep>", default_name: str = "sweep") -> SweepSpec:
    err = lambda key, problem: SweepError(source, key, problem)  # noqa: E731
    if not isinstance(data, dict):
        raise err("", f"the file must be a mapping of keys ({', '.join(TOP_KEYS)}), got {_kind(data)}")
    for key in data:
        if key not in TOP_KEYS:
            raise err(str(key), f"unknown key{suggest(key, TOP_KEYS)} (known: {', '.join(TOP_KEYS)})")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name or "/" in name:
        raise err("name", f"must be a non-empty string without '/', got {name!r}")
    model, overrides = _parse_model(data.get("model", "tiny"), err)
    world_sizes = _parse_world_size(data.get("world_size"), err)
    base = _parse_fields(data.get("base", {}), "base", err, allow_lists=False)
    grid = _parse_grid(data.get("grid"), err)
    zips = _parse_zips(data.get("zip", []), err)
    _no_overlap(base, grid, zips, err)
    backends = _parse_backends(data.get("backends", {}), err)
    ds_set = _parse_deepspeed(data.get("deepspeed", {}), err)
    exclude = _parse_exclude(data.get("exclude", []), err)
    repeats = data.get("repeats", 1)
    if not _is_int(repeats) or repeats < 1:
        raise err("repeats", f"must be a positive integer, got {repeats!r}")
    launcher = _parse_launcher(data.get("launcher", "local"), err, source)
    report = data.get("report", False)
    if not isinstance(report, bool):
        raise err("report", f"must be true or false, got {report!r}")
    uses_auto = grid.get("dp") == "auto" or base.get("dp") == "auto"
    if uses_auto and world_sizes is None and "world_size" not in grid:
        raise err("grid.dp" if grid.get("dp") == "auto" else "base.dp",
                  "dp: auto needs a world size: add a top-level `world_size: N`")
    return SweepSpec(name=name, source=source, model=model, model_overrides=overrides, world_sizes=world_sizes,
                     base=base, grid=grid, zips=zips, backends=backends, ds_set=ds_set, exclude=exclude,
                     repeats=repeats, launcher=launcher, report=report)


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing (empty)",
            bool: "a boolean", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_model(value, err) -> tuple[str, tuple]:
    from models.config import PRESETS
    if isinstance(value, str):
        if value not in PRESETS:
            raise err("model", f"unknown preset {value!r}{suggest(value, PRESETS)} (known: {', '.join(PRESETS)})")
        return value, ()
    if not isinstance(value, dict):
        raise err("model", f"must be a preset name or a mapping {{preset: NAME, KEY: VALUE}}, got {_kind(value)}")
    if "preset" not in value:
        raise err("model.preset", "missing: name the preset to start from, e.g. {preset: tiny, layers: 8}")
    preset, _ = _parse_model(value["preset"], lambda k, p: err("model.preset", p))
    overrides = []
    for key, v in value.items():
        if key == "preset":
            continue
        if key not in MODEL_FIELDS:
            raise err(f"model.{key}", f"unknown model field{suggest(key, MODEL_FIELDS)} "
                                      f"(known: {', '.join(MODEL_FIELDS)})")
        if isinstance(v, (dict, list)) or v is None:
            raise err(f"model.{key}", f"must be a single value, got {_kind(v)}")
        overrides.append(f"{key}={str(v).lower() if isinstance(v, bool) else v}")
    try:
        from bench.config import model_config
        model_config(preset, tuple(overrides))
    except (ConfigError, ValueError) as e:
        raise err("model", str(e)) from None
    return preset, tuple(overrides)


def _parse_world_size(value, err) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(_is_int(v) and v >= 1 for v in values):
        raise err("world_size", f"must be a positive integer or a non-empty list of them, got {value!r}")
    return tuple(values)


def _check_value(name: str, value, key: str, err) -> None:
    """Type and choice check of one RunConfig field value, so the message can name the key path."""
    f = RUN_FIELDS[name]
    type_name, choices = str(f.type), f.metadata["choices"]
    if name == "dp" and value == "auto":
        return
    ok = {
        "int": _is_int(value), "int | None": value is None or _is_int(value),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool), "str": isinstance(value, str),
        "str | None": value is None or isinstance(value, str),
        "tuple": isinstance(value, (list, dict, str)),
    }.get(type_name, True)
    if not ok:
        want = {"int": "an integer", "int | None": "an integer", "float": "a number", "bool": "true or false",
                "str": "a string", "str | None": "a string", "tuple": "a list of KEY=VALUE strings"}[type_name]
        hint = " (or auto)" if name == "dp" else ""
        raise err(key, f"{name} must be {want}{hint}, got {value!r} ({_kind(value)})")
    if choices and value is not None and value not in choices:
        raise err(key, f"{name} {value!r} is not one of {', '.join(map(str, choices))}"
                       f"{suggest(value, choices)}")


def _check_field_name(name, key: str, err) -> None:
    if name in NOT_SETTABLE:
        raise err(key, f"{name} cannot be set here: {NOT_SETTABLE[name]}")
    if name not in RUN_FIELDS:
        raise err(key, f"unknown run config field{suggest(name, RUN_FIELDS)} (`bench run --help` lists them)")


def _parse_fields(block, where: str, err, allow_lists: bool) -> dict:
    """A mapping of RunConfig fields; with allow_lists each value may be a list (an axis)."""
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise err(where, f"must be a mapping of run config fields, got {_kind(block)}")
    out = {}
    for name, value in block.items():
        key = f"{where}.{name}"
        _check_field_name(name, key, err)
        if allow_lists:
            values = value if isinstance(value, list) and RUN_FIELDS[name].type != "tuple" else [value]
            if not values:
                raise err(key, "empty list: an axis needs at least one value")
            for i, v in enumerate(values):
                _check_value(name, v, f"{key}[{i}]" if isinstance(value, list) else key, err)
            out[name] = "auto" if (name == "dp" and value == "auto") else tuple(values)
        else:
            if isinstance(value, list) and RUN_FIELDS[name].type != "tuple":
                raise err(key, f"base values are single values; put the list {value!r} under grid.{name}")
            _check_value(name, value, key, err)
            out[name] = value
    return out


def _parse_grid(grid, err) -> dict:
    if grid is None:
        raise err("grid", "missing: a sweep needs a grid with at least one axis, e.g. grid: {tp: [1, 2]}")
    if not isinstance(grid, dict) or not grid:
        raise err("grid", f"must be a non-empty mapping of axes (field: [values]), got {grid!r}")
    return _parse_fields(grid, "grid", err, allow_lists=True)


def _parse_zips(zips, err) -> tuple[dict, ...]:
    if not isinstance(zips, list):
        raise err("zip", f"must be a list of groups like {{micro_batch: [1, 2], micro_batches: [8, 4]}}, "
                         f"got {_kind(zips)}")
    out = []
    for i, group in enumerate(zips):
        where = f"zip[{i}]"
        if not isinstance(group, dict) or len(group) < 2:
            raise err(where, "a zip group is a mapping of at least two axes whose lists move together")
        for name, values in group.items():
            if not isinstance(values, list):
                raise err(f"{where}.{name}", f"must be a list, got {_kind(values)}")
        parsed = _parse_fields(group, where, err, allow_lists=True)
        lengths = {name: len(v) for name, v in parsed.items()}
        if len(set(lengths.values())) > 1:
            raise err(where, f"lists must have equal lengths, got {lengths}")
        out.append(parsed)
    return tuple(out)


def _no_overlap(base, grid, zips, err) -> None:
    seen = {name: "grid" for name in grid}
    for i, group in enumerate(zips):
        for name in group:
            if name in seen:
                raise err(f"zip[{i}].{name}", f"{name} is already an axis in {seen[name]}; give it once")
            seen[name] = f"zip[{i}]"
    for name in base:
        if name in seen:
            raise err(f"base.{name}", f"{name} is also an axis in {seen[name]}; remove one of them")


def _parse_backends(block, err) -> dict:
    if not isinstance(block, dict):
        raise err("backends", f"must be a mapping backend → options, got {_kind(block)}")
    out = {}
    for backend, options in block.items():
        if backend not in BACKENDS:
            raise err(f"backends.{backend}", f"unknown backend{suggest(backend, BACKENDS)} "
                                             f"(known: {', '.join(BACKENDS)})")
        parsed = _parse_fields(options, f"backends.{backend}", err, allow_lists=True)
        if "backend" in parsed:
            raise err(f"backends.{backend}.backend", "the backend is the block's name; remove this key")
        out[backend] = parsed
    return out


def _parse_deepspeed(block, err) -> tuple:
    if not isinstance(block, dict):
        raise err("deepspeed", f"must be a mapping (a piece of DeepSpeed config), got {_kind(block)}")
    return tuple(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in _flatten(block))


def _flatten(block: dict, prefix: str = ""):
    for key, value in block.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _parse_exclude(rules, err) -> tuple[dict, ...]:
    if not isinstance(rules, list):
        raise err("exclude", f"must be a list of rules like {{backend: ddp, tp: 2}}, got {_kind(rules)}")
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not rule:
            raise err(f"exclude[{i}]", f"a rule is a non-empty mapping field: value(s), got {rule!r}")
        parsed = _parse_fields(rule, f"exclude[{i}]", err, allow_lists=True)
        out.append({k: {_hashable(x) for x in v} if v != "auto" else {"auto"} for k, v in parsed.items()})
    return tuple(out)


def _parse_launcher(value, err, source: str) -> LauncherSpec:
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise err("launcher", f"must be local, debug, slurm or a mapping {{kind: slurm, profile: NAME}}, "
                              f"got {_kind(value)}")
    kind = value.get("kind", "local")
    if kind not in LAUNCHERS:
        raise err("launcher.kind", f"unknown launcher {kind!r}{suggest(kind, LAUNCHERS)} "
                                   f"(known: {', '.join(LAUNCHERS)})")
    options = {k: v for k, v in value.items() if k not in ("kind", "profile")}
    if kind != "slurm" and (options or "profile" in value):
        extra = sorted(set(value) - {"kind"})
        raise err(f"launcher.{extra[0]}", f"only the slurm launcher takes options; launcher {kind} takes none")
    profile = value.get("profile", "local") if kind == "slurm" else None
    if kind == "slurm":
        from bench.sweep.slurm import load_profile
        load_profile(profile, options, source=source)
    return LauncherSpec(kind=kind, profile=profile, options=options)


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
    world, tp, pp = params["world_size"], params.get("tp", 1), params.get("pp", 1)
    if world % (tp * pp):
        return params, (f"dp: auto: world_size ({world}) is not divisible by tp ({tp}) × pp ({pp}) = {tp * pp}")
    return {**params, "dp": world // (tp * pp)}, None


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
