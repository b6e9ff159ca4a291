"""A model shape read from a source, written the suite's way: the closest preset and the fields it overrides.

Sources give every field of the shape (layers, hidden, …); a sweep file names a preset and its overrides.
The closest preset (fewest differing fields, the first in PRESETS on a tie) keeps the sweep file short and
the run id of a config that is a preset exactly the preset's. `canonical` puts any RunConfig in the same
form, so that import(export(cfg)) == canonical(cfg) is the round trip's test.
"""
from __future__ import annotations

from dataclasses import fields

from models.config import PRESETS, GPTConfig

SHAPE_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name != "name")


def shape(cfg: GPTConfig) -> dict:
    return {name: getattr(cfg, name) for name in SHAPE_FIELDS}


def preset_and_overrides(model: dict) -> tuple[str, tuple[str, ...]]:
    """(preset, ("layers=8", …)): the preset closest to `model` (GPTConfig fields; missing ones at
    GPTConfig's defaults) and the overrides that make it `model`, in GPTConfig's field order."""
    wanted = shape(GPTConfig(**model))

    def differing(preset: GPTConfig) -> list[str]:
        return [k for k in SHAPE_FIELDS if getattr(preset, k) != wanted[k]]
    name = min(PRESETS, key=lambda p: len(differing(PRESETS[p])))
    return name, tuple(f"{k}={_text(wanted[k])}" for k in differing(PRESETS[name]))


def _text(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def canonical(cfg):
    """`cfg` with its model as its closest preset and overrides, world_size set and ds_set sorted: the form an
    import gives."""
    preset, overrides = preset_and_overrides(shape(cfg.model_config))
    return cfg.replace(model=preset, model_overrides=overrides, world_size=cfg.world, ds_set=tuple(sorted(cfg.ds_set)))
