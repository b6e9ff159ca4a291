"""Click options generated from RunConfig's fields, shared by every command that takes a config.

Kept apart from the app (bench/cli/__init__.py) so that the command modules import it alone."""
from __future__ import annotations

import json
from dataclasses import fields

import click

from bench.config import MAX_RANKS, RunConfig, check_number, field_types


class Number(click.ParamType):
    """A number option checked by the rules RunConfig and the sweep files use (bench.config.check_number):
    an integer where one is meant (no '2.5' → 2), finite, within `bounds` = (low, high, low_open)."""

    def __init__(self, integer: bool, bounds: tuple, label: str | None = None):
        self.integer, self.bounds, self.label = integer, bounds, label
        self.name = "integer" if integer else "number"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip()) if self.integer else float(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.integer else 'a number'}", param, ctx)
        reason = check_number(self.label or (param.name if param else "value"), number, self.integer, self.bounds)
        if reason:
            self.fail(reason, param, ctx)
        return number


def positive_int(high: int = MAX_RANKS) -> Number:
    return Number(True, (1, high, False))


FRACTION = Number(False, (0, 1, True))
"""A share in (0, 1]: --memory-fraction."""


def config_options(func):
    """One CLI option per RunConfig field, named, typed, bounded and documented by the field itself."""
    types = field_types()
    for f in reversed(fields(RunConfig)):
        flag, meta, (kind, _) = "--" + f.name.replace("_", "-"), f.metadata, types[f.name]
        if kind is bool:
            func = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=meta["help"])(func)
        elif kind is tuple:
            func = click.option(flag, f.name, multiple=True, help=meta["help"])(func)
        else:
            if meta["choices"]:
                kind = click.Choice([str(c) for c in meta["choices"]])
            elif meta["bounds"]:
                kind = Number(kind is int, meta["bounds"])
            func = click.option(flag, f.name, type=kind, default=None, help=meta["help"])(func)
    return func


def config_from_options(options: dict) -> RunConfig:
    given = {k: v for k, v in options.items() if v is not None and v != ()}
    if "zero" in given:
        given["zero"] = int(given["zero"])
    return RunConfig(**given)


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, default=str, allow_nan=True))
