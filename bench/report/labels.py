"""Short human names for configs and columns, shared by the report, compare and history."""
from __future__ import annotations

import json
import math
from dataclasses import fields

import pandas as pd

from bench.config import RunConfig
from bench.layout import named_dims

MiB = 2**20
DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
"""A label names only the options off these."""


def present(value) -> bool:
    """True for a real value (not None/NaN/empty)."""
    if value is None:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    return not (isinstance(value, str) and value == "")


def variant(row) -> str:
    """Backend plus the option that changes what it does: `deepspeed z3`, `fsdp grad-op`, `native`."""
    backend = str(row.get("backend", "?"))
    if backend == "deepspeed" or (backend == "native" and _num(row.get("zero"))):
        return f"{backend} z{int(_num(row.get('zero')))}"
    if backend == "fsdp" and present(row.get("fsdp")):
        return f"fsdp {row['fsdp']}"
    return backend


def layout(row) -> str:
    """`tp2·pp2·dp1`; `tp2·cp2·pp1·dp2` where the row uses context parallel, `tp1·pp1·dp4·ep2` expert parallel."""
    return "·".join(f"{d}{_int(row.get(d))}" for d in named_dims(cp_of(row), ep_of(row)))


def cp_of(row) -> int:
    """A row's cp (1 in a table from before cp existed)."""
    return max(_int(row.get("cp")), 1)


def ep_of(row) -> int:
    """A row's ep (1 in a table from before ep existed)."""
    return max(_int(row.get("ep")), 1)


def largest_cp(df: pd.DataFrame) -> int:
    """The largest cp of a table's rows: whether its figures and tables name cp at all."""
    return max((cp_of(r) for r in df[["cp"]].to_dict("records")), default=1) if "cp" in df else 1


def largest_ep(df: pd.DataFrame) -> int:
    """The largest ep of a table's rows: whether its figures name the ep group at all."""
    return max((ep_of(r) for r in df[["ep"]].to_dict("records")), default=1) if "ep" in df else 1


def config_label(row) -> str:
    """`native tp2·pp2·dp1 1f1b m4`: backend variant, layout (with cp > 1 its attention, `ring` or
    `ulysses`), then only the options off their defaults."""
    parts = [variant(row), layout(row)]
    if cp_of(row) > 1 and present(row.get("cp_comm")):
        parts.append(str(row["cp_comm"]))
    pp, m = _int(row.get("pp")), _int(row.get("micro_batches"))
    if pp > 1:
        vs = _int(row.get("virtual_stages"))
        parts.append(f"{row.get('schedule')}{f' v{vs}' if vs > 1 else ''}")
    if m > 1:
        parts.append(f"m{m}")
    for key, fmt in (("dtype", "{}"), ("recompute", "rc-{}"), ("order", "{}"), ("fault", "fault={}")):
        value = row.get(key)
        if present(value) and value != DEFAULTS[key]:
            parts.append(fmt.format(value))
    if str(row.get("sequence_parallel")).lower() == "true":
        parts.append("sp")
    if str(row.get("compile")).lower() == "true":
        parts.append("compiled")
    parts += _overrides(row.get("model_overrides"))
    bucket = row.get("bucket_mb")
    if present(bucket) and float(bucket) != DEFAULTS["bucket_mb"]:
        parts.append(f"bucket {float(bucket):g} MiB")
    return " ".join(parts)


def _overrides(value) -> list[str]:
    """Model overrides as `key=value` parts (`kv_heads=2`): a row stores them as a JSON list."""
    if not present(value):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return [value]
    return [str(v) for v in value]


def add_labels(df: pd.DataFrame) -> pd.DataFrame:
    """Adds `label`, `variant` and `layout` columns (a copy)."""
    df = df.copy()
    rows = df.to_dict("records")
    df["variant"] = [variant(r) for r in rows]
    df["layout"] = [layout(r) for r in rows]
    df["label"] = [config_label(r) for r in rows]
    return df


def _num(value) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(out) else out


def _int(value) -> int:
    return int(_num(value))
