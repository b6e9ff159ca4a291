"""Result sets in, one dataframe out: sweep folders, parquet files or single run JSON files.

The sweep store (`bench.results.store.load_results`) owns the schema and its check; this module only
adds an internal fallback for plain run JSON files and turns every way input can be wrong into a
one-line message that names the path and the fix (the CLI prints it; never a traceback).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from bench.results.store import CorruptRow, load_results, read_row, row_problem, to_dataframe

REQUIRED = ("run_id", "config_id", "status")


def load_many(paths) -> pd.DataFrame:
    """Rows of every result set in `paths`, concatenated. The same row given twice counts once; two
    measurements of one run (same run_id, other time: e.g. two sweeps of one grid) both stay and pool
    as repeats of their config (`config_id`)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no results given; pass sweep output folders or results.parquet files")
    frames = [load_one(p) for p in paths]
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    _check_schema_versions(df, paths)
    key = ["run_id", "time"] if "time" in df.columns else ["run_id"]
    return df.drop_duplicates(key, keep="last").reset_index(drop=True)


def load_one(path: Path) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (give a sweep output folder, "
                                "a results.parquet or a run JSON file)")
    try:
        df = _json_rows(path) if path.suffix == ".json" else load_results(path)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow/JSON errors of a broken file become one line
        raise ValueError(f"{path}: cannot read results ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return check_frame(df, path)


def check_frame(df: pd.DataFrame, path) -> pd.DataFrame:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a parabench result set (missing column(s) {', '.join(missing)}); "
                         "give the folder or results.parquet written by `bench sweep`")
    if df.empty:
        raise ValueError(f"{path}: the result set is empty (no runs); run a sweep into it first")
    return df


def _json_rows(path: Path) -> pd.DataFrame:
    """A run JSON file: one row, or a list of rows; each checked as the store checks its files."""
    if path.is_dir():
        raise ValueError(f"{path}: a folder named .json; give a sweep output folder or a run JSON file")
    data, reason = read_row(path)
    if reason and reason.startswith("a JSON list"):  # a list of rows
        rows = json.loads(path.read_bytes().decode("utf-8"))
        for i, row in enumerate(rows):
            if row_problem(row):
                raise CorruptRow(f"{path}[{i}]", row_problem(row))
        if not rows:
            raise ValueError(f"{path}: an empty list, no result rows")
        return to_dataframe(rows, str(path))
    if reason:
        raise CorruptRow(path, reason)
    return to_dataframe([data], str(path))


def _check_schema_versions(df: pd.DataFrame, paths) -> None:
    if "SCHEMA_VERSION" not in df.columns:
        return
    versions = sorted({str(v) for v in df["SCHEMA_VERSION"].dropna().unique()})
    if len(versions) > 1:
        raise ValueError(f"results of different schema versions ({', '.join(versions)}) in "
                         f"{', '.join(map(str, paths))}; re-run the older sweep or report them separately")
