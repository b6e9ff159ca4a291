"""Results store: one JSON file per run, written by atomic rename the moment the run's outcome is
known, and a pandas DataFrame whose schema (bench.results: columns, types, statuses) is checked
(exported to results.parquet).

Layout of a sweep output folder OUT:
    OUT/runs/<run_id>.json   one row per run (ok, failed, oom, timeout, cancelled or skipped)
    OUT/results.parquet      every row, written at the end of a sweep and by `bench results OUT`
    OUT/sweep.yaml           the sweep file as it was run
    OUT/slurm/               submitit's job folders and logs (slurm launcher only)

A run is written once per attempt; a rerun (--retry-failed) replaces its file, so a sweep killed at
any moment and resumed holds exactly one row per run.
"""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from bench.results import ALWAYS, COLUMNS, SCHEMA_VERSION, Kind, Status

if TYPE_CHECKING:
    import pandas as pd


class ResultStore:
    def __init__(self, out: str | Path, columns: dict | None = None):
        """`columns`: added to every row written here (a sweep's `sweep` and `launcher`)."""
        self.out = Path(out)
        self.runs = self.out / "runs"
        self.columns = dict(columns or {})

    def statuses(self) -> dict[str, str]:
        """run_id → status of every row already stored."""
        return {row["run_id"]: row["status"] for row in self.rows()}

    def write(self, row: dict) -> dict:
        """Write one row atomically: a reader (or a resumed sweep) sees the whole row or none. Returns it as written."""
        row = {**row, **self.columns}
        self.runs.mkdir(parents=True, exist_ok=True)
        path = self.runs / f"{row['run_id']}.json"
        tmp = self.runs / f".{row['run_id']}.{socket.gethostname()}.{os.getpid()}.tmp"  # unique per writer
        with open(tmp, "w") as f:
            json.dump(row, f, default=str, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return row

    def rows(self) -> list[dict]:
        if not self.runs.is_dir():
            return []
        out = []
        for path in sorted(self.runs.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a result row ({e})") from None
        return out

    def dataframe(self) -> "pd.DataFrame":
        rows = self.rows()
        if not rows:
            raise ValueError(f"{self.out}: no results (expected {self.runs}/*.json)")
        return to_dataframe(rows, str(self.out))

    def write_parquet(self) -> "pd.DataFrame":
        df = self.dataframe()
        tmp = self.out / f".results.{os.getpid()}.parquet"
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.out / "results.parquet")
        return df


def to_dataframe(rows: list[dict], source: str = "<rows>") -> "pd.DataFrame":
    """Rows → DataFrame with every column of every row (bench.results.ALWAYS), typed as declared, and checked.
    Columns only some rows have (backend extras, predictions) come after them; undeclared ones load as they are."""
    import pandas as pd
    df = pd.DataFrame.from_records(rows)
    for name in ALWAYS:
        if name not in df.columns:
            df[name] = None
    for name in df.columns:
        if name in COLUMNS:
            df[name] = _typed(df[name], COLUMNS[name].type)
    df = df[list(ALWAYS) + sorted(c for c in df.columns if c not in ALWAYS)]
    check(df, source)
    return df.sort_values(["status", "backend", "world_size", "tp", "pp", "dp", "run_id"],
                          key=lambda s: s.astype(str), ignore_index=True)


def _typed(col: "pd.Series", type_: str) -> "pd.Series":
    import pandas as pd
    if type_ == "float":
        return pd.to_numeric(col, errors="coerce").astype("float64")
    if type_ == "int":
        return pd.to_numeric(col, errors="coerce").astype("Int64")
    if type_ == "bool":
        return col.astype("boolean")
    return col.map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                   ).astype("object")


ADDED_LATER = tuple(name for name in ALWAYS if COLUMNS[name].kind in (Kind.EXACT, Kind.NOISY, Kind.ENVIRONMENT))
"""Every-row columns a reader fills with None when an older table of the same schema version lacks them:
adding a measurement or an environment field is no change of meaning (SCHEMA_VERSION's rule)."""


def check(df: "pd.DataFrame", source: str) -> None:
    """The invariants every results table keeps; a ValueError names the first broken one."""
    if df.empty:
        raise ValueError(f"{source}: no result rows")
    if "SCHEMA_VERSION" not in df.columns:
        raise ValueError(f"{source}: not a parabench results table (no SCHEMA_VERSION column)")
    versions = set(df["SCHEMA_VERSION"].dropna().astype(int))
    if versions != {SCHEMA_VERSION}:
        raise ValueError(f"{source}: results schema version {sorted(versions)}, but this parabench reads "
                         f"version {SCHEMA_VERSION}; rerun `bench results` on the run folder with a matching version")
    missing = [c for c in ALWAYS if c not in df.columns]
    if missing:
        raise ValueError(f"{source}: results table lacks column(s) {missing}")
    bad = sorted(set(df["status"]) - set(Status))
    if bad:
        raise ValueError(f"{source}: unknown status value(s) {bad}; expected {', '.join(Status)}")
    dupes = df["run_id"][df["run_id"].duplicated()].tolist()
    if dupes:
        raise ValueError(f"{source}: duplicated run_id(s) {dupes[:5]}")
    ok = df[df["status"] == Status.OK]
    if ok["step_time_s"].isna().any():
        raise ValueError(f"{source}: rows with status ok but no step_time_s: {ok['run_id'][ok['step_time_s'].isna()].tolist()[:5]}")
    if df.loc[df["status"] != Status.OK, "error"].isna().any():
        raise ValueError(f"{source}: rows without a measurement must say why (error column)")


def read_parquet(path: Path, what: str) -> "pd.DataFrame":
    """`pd.read_parquet`, with a foreign or broken file reported as one ValueError naming `what` it should be."""
    import pandas as pd
    try:
        return pd.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds for a foreign file
        raise ValueError(f"{path}: not a readable {what} ({type(e).__name__}: {e})") from None


def load_results(path: str | Path) -> "pd.DataFrame":
    """A sweep output folder (its runs/*.json, else its results.parquet) or a results parquet file →
    the checked DataFrame. Raises ValueError for an empty or foreign table or another schema version."""
    path = Path(path)
    if path.is_dir():
        store = ResultStore(path)
        if store.rows():
            return store.dataframe()
        if (path / "results.parquet").is_file():
            path = path / "results.parquet"
        else:
            raise ValueError(f"{path}: no results here (expected runs/*.json or results.parquet)")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such results folder or parquet file")
    df = read_parquet(path, "parquet file")
    if df.empty:
        raise ValueError(f"{path}: no result rows")
    if "SCHEMA_VERSION" not in df.columns:
        raise ValueError(f"{path}: not a parabench results table (no SCHEMA_VERSION column)")
    for name in ADDED_LATER:  # columns added within this schema version: a table made before lacks them
        if name not in df.columns:
            df[name] = None
    check(df, str(path))
    return df
