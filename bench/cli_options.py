"""Click options generated from RunConfig's fields, shared by every command that takes a config.

Kept apart from bench/cli.py so that command modules can import it without importing the app."""
from __future__ import annotations

import json
from dataclasses import fields

import click

from bench.config import RunConfig, field_types


def config_options(func):
    """One CLI option per RunConfig field, named, typed and documented by the field itself."""
    types = field_types()
    for f in reversed(fields(RunConfig)):
        flag, meta, (kind, _) = "--" + f.name.replace("_", "-"), f.metadata, types[f.name]
        if kind is bool:
            func = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=meta["help"])(func)
        elif kind is tuple:
            func = click.option(flag, f.name, multiple=True, help=meta["help"])(func)
        else:
            kind = click.Choice([str(c) for c in meta["choices"]]) if meta["choices"] else kind
            func = click.option(flag, f.name, type=kind, default=None, help=meta["help"])(func)
    return func


def config_from_options(options: dict) -> RunConfig:
    given = {k: v for k, v in options.items() if v is not None and v != ()}
    if "zero" in given:
        given["zero"] = int(given["zero"])
    return RunConfig(**given)


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, default=str, allow_nan=True))
