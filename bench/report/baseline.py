"""Committed baselines: a folder with the result rows (results.parquet) and baseline.json saying which
machine kind and schema version produced them, so a comparison can refuse or relax with a reason."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

import pandas as pd

from bench.report.load import check_frame, load_one
from bench.results import SCHEMA_VERSION

META = "baseline.json"


def schema_version() -> int:
    return SCHEMA_VERSION


def machine_kind(df: pd.DataFrame) -> str:
    """`cpu x86_64 2 cores` or `NVIDIA H100 80GB HBM3 x86_64`: what timing depends on.

    The device comes from the rows; the CPU architecture and core count from this machine (a comparison
    runs where the current sweep ran)."""
    devices = sorted({str(d) for d in df.get("device_name", pd.Series(dtype=object)).dropna()}) or ["cpu"]
    device = "+".join(devices)
    if device == "cpu":
        return f"cpu {platform.machine()} {os.cpu_count()} cores"
    return f"{device} {platform.machine()}"


def write_baseline(df: pd.DataFrame, folder) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".results.{os.getpid()}.parquet"
    df.to_parquet(tmp, index=False)
    os.replace(tmp, folder / "results.parquet")
    shas = sorted({str(s) for s in df.get("git_sha", pd.Series(dtype=object)).dropna()})
    meta = {"machine_kind": machine_kind(df), "schema_version": schema_version(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": shas[0] if len(shas) == 1 else shas,  # the code that produced the rows
            "runs": int(len(df)), "configs": int(df["config_id"].nunique()),
            "sweeps": sorted({str(s) for s in df.get("sweep", pd.Series(dtype=object)).dropna()})}
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def load_baseline(path) -> tuple[pd.DataFrame, dict | None]:
    """The baseline's rows and metadata (None for a plain result set used as a baseline)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"baseline {path} not found; create it from a result set with "
                                f"`bench compare {path} RESULTS --update-baseline`")
    meta_path = path / META if path.is_dir() else None
    if not meta_path or not meta_path.exists():
        return load_one(path), None
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{meta_path}: not valid JSON ({type(e).__name__}); regenerate the baseline with "
                         "--update-baseline") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: not a baseline description (a JSON object); regenerate the baseline "
                         "with --update-baseline")
    if meta.get("schema_version") != schema_version():
        raise ValueError(f"baseline {path} has results schema version {meta.get('schema_version')}, this parabench "
                         f"writes version {schema_version()}; regenerate it: `bench compare {path} RESULTS "
                         "--update-baseline`")
    parquet = path / "results.parquet"
    if not parquet.exists():
        raise FileNotFoundError(f"baseline {path} lacks results.parquet; regenerate it with --update-baseline")
    return check_frame(load_one(parquet), path), meta
