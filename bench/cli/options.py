"""Click options generated from RunConfig's fields, shared by every command that takes a config.

Each command takes the groups of fields it reads (`config_options(MODEL_FIELDS, LAYOUT_FIELDS, …)`):
`bench run` all of them, `bench estimate` and `bench layout` none of MEASUREMENT_FIELDS, which only a
measured run reads. An option's type, bounds, choices and help are its field's (bench/config.py).
Kept apart from the app (bench/cli/__init__.py) so that the command modules import it alone."""
from __future__ import annotations

import json
import typing
from typing import Annotated

import click
from pydantic import Field

from bench.config import FIELDS, LIST_FIELDS, MAX_RANKS, RunConfig, annotation, choices, help_text, value_reason

MODEL_FIELDS = ("model", "model_overrides")
"""Which model: a preset and its overrides."""
LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "ep", "order", "world_size")
"""How ranks are arranged (all `bench layout` needs without a model)."""
ENGINE_FIELDS = ("backend", "cp_comm", "zero", "fsdp", "schedule", "virtual_stages", "micro_batch", "micro_batches", "seq",
                 "dtype", "sequence_parallel", "recompute", "bucket_mb", "zero3_param_persistence_threshold",
                 "zero3_max_live_parameters", "zero3_max_reuse_distance", "zero3_prefetch_bucket_size", "ds_set", "device")
"""How the step is trained: what the cost model reads beside the layout."""
MEASUREMENT_FIELDS = ("compile", "steps", "warmup", "seed", "repeat", "fault", "timeout_s", "profile")
"""What only a measured run reads: its steps, seed, compilation, test faults, time limit and profiler."""
ALL_FIELDS = (MODEL_FIELDS, LAYOUT_FIELDS, ENGINE_FIELDS, MEASUREMENT_FIELDS)
assert sorted(sum(ALL_FIELDS, ())) == sorted(FIELDS), "every RunConfig field is in exactly one group"


class Typed(click.ParamType):
    """A number option read as its type says (an integer where one is meant: no '2.5' → 2) and checked by
    that type's pydantic bounds, worded as RunConfig's messages (bench.config.value_reason)."""

    def __init__(self, kind, label: str | None = None):
        self.kind, self.label = kind, label
        self.integer = _base(kind) is int
        self.name = "integer" if self.integer else "number"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip()) if self.integer else float(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.integer else 'a number'}", param, ctx)
        reason = value_reason(self.label or (param.name if param else "value"), self.kind, number)
        if reason:
            self.fail(reason, param, ctx)
        return number


def _base(kind):
    """int or float under Annotated and Optional."""
    while typing.get_args(kind) and kind not in (int, float):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def positive_int(high: int = MAX_RANKS) -> Typed:
    return Typed(Annotated[int, Field(ge=1, le=high)])


def number(label: str, **bounds) -> Typed:
    """A float option in `bounds` (Field's gt, ge, le)."""
    return Typed(Annotated[float, Field(**bounds)], label)


FRACTION = number("memory_fraction", gt=0, le=1)
"""A share in (0, 1]: --memory-fraction."""


def config_options(*groups: tuple[str, ...]):
    """One CLI option per RunConfig field of `groups` (default: every field), named, typed, bounded and
    documented by the field itself, in the field order."""
    wanted = set(sum(groups or ALL_FIELDS, ()))

    def decorate(func):
        for name in reversed([n for n in FIELDS if n in wanted]):
            func = _option(name)(func)
        return func
    return decorate


def _option(name: str):
    flag, kind = "--" + name.replace("_", "-"), _base(annotation(name))
    if kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text(name))
    if name in LIST_FIELDS:
        return click.option(flag, name, multiple=True, help=help_text(name))
    if choices(name):
        return click.option(flag, name, type=click.Choice([str(c) for c in choices(name)]), default=None,
                            help=help_text(name))
    if kind in (int, float):
        return click.option(flag, name, type=Typed(annotation(name)), default=None, help=help_text(name))
    return click.option(flag, name, default=None, help=help_text(name))


def given_options(options: dict) -> dict:
    """The config options given on the command line (not left at None or empty), choices in their type."""
    given = {k: v for k, v in options.items() if v is not None and v != () and k in FIELDS}
    if "zero" in given:
        given["zero"] = int(given["zero"])
    return given


def config_from_options(options: dict) -> RunConfig:
    return RunConfig(**given_options(options))


def refuse_unused(options: dict, used, why: str) -> None:
    """Exit 2 in one line when a config option is given that this use of the command ignores."""
    unused = [k for k in given_options(options) if k not in used]
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise click.UsageError(f"{flags}: not used {why}")


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, default=str, allow_nan=True))


def write_text_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader never sees half a file."""
    import os
    from pathlib import Path
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
