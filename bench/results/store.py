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

Every reader goes through `read_row`: a file that is not a result row (not JSON, not an object, a
required key missing, a declared column holding what its type cannot) is a `CorruptRow` naming the
file; `--resume` moves it aside (`<file>.corrupt`) and reruns its config. So the parquet writer only
ever sees values its columns hold.
"""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from bench.config import DEFAULTS
from bench.results import ALWAYS, COLUMNS, SCHEMA_VERSION, Kind, Status, comm_columns
from bench.results.schema import COMM_DIMS

if TYPE_CHECKING:
    import pandas as pd


class ResultStore:
    def __init__(self, out: str | Path, columns: dict | None = None):
        """`columns`: added to every row written here (a sweep's `sweep` and `launcher`)."""
        self.out = Path(out)
        self.runs = self.out / "runs"
        self.columns = dict(columns or {})

    def statuses(self) -> dict[str, str]:
        """run_id → status of every row already stored (a corrupt file raises CorruptRow: see set_aside)."""
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

    def discard_partial(self, run_id: str) -> None:
        """Remove what a writer killed mid-write left of `run_id`'s row (its temporary file; the row
        itself appears whole or not at all)."""
        for tmp in self.runs.glob(f".{run_id}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        return sorted(self.runs.glob("*.json")) if self.runs.is_dir() else []

    def rows(self) -> list[dict]:
        """Every stored row; the first file that is not a result row raises CorruptRow naming it."""
        out = []
        for path in self.files():
            row, reason = read_row(path)
            if reason:
                raise CorruptRow(path, reason)
            out.append(row)
        return out

    def set_aside(self) -> list[str]:
        """Rename every corrupt row file to `<file>.corrupt` (kept for a look, no longer a row: its run
        is rerun by --resume). Returns one line per file moved."""
        lines = []
        for path in self.files():
            _, reason = read_row(path)
            if reason:
                os.replace(path, path.with_name(path.name + ".corrupt"))
                lines.append(f"{CorruptRow(path, reason)}; moved aside to {path.name}.corrupt, its run is rerun")
        return lines

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


class CorruptRow(ValueError):
    """`OUT/runs/<file>.json: not a result row: <why>`."""

    def __init__(self, path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: not a result row: {reason}")


REQUIRED = {"SCHEMA_VERSION": "int", "run_id": "str", "config_id": "str", "status": "str"}
INT64 = 2**63


def read_row(path: Path) -> tuple[dict | None, str | None]:
    """(row, None), or (None, why the file is not a result row): unreadable, not JSON, not an object with
    the required keys, a status outside Status, a declared column holding a value its type cannot."""
    try:
        row = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e})"
    except RecursionError:
        return None, "not JSON (nested too deeply)"
    reason = row_problem(row)
    return (None, reason) if reason else (row, None)


def row_problem(row) -> str | None:
    """Why `row` (a parsed JSON value) is not a result row, or None. Types come from bench.results.COLUMNS."""
    if not isinstance(row, dict):
        return f"a JSON {_json_kind(row)}, not an object"
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        return f"no {', '.join(missing)} key"
    for name, type_ in REQUIRED.items():  # exactly their type: they are keys and file names
        if type(row[name]) is not {"str": str, "int": int}[type_]:
            return f"{name} is {_short(row[name])}, not {_TYPE_WORDS[type_]}"
    for name in (k for k in row if k in COLUMNS and k not in REQUIRED):
        if not _holds(COLUMNS[name].type, row[name]):
            return f"{name} is {_short(row[name])}, not {_TYPE_WORDS[COLUMNS[name].type]}"
    if row["status"] not in set(Status):
        return f"status is {_short(row['status'])}, not one of {', '.join(Status)}"
    if row["status"] == Status.OK and not _number(row.get("step_time_s")):
        return "status ok without a step_time_s"
    if row["status"] != Status.OK and not isinstance(row.get("error"), str):
        return f"status {row['status']} without an error saying why"
    return None


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _holds(type_: str, value) -> bool:
    """Whether the column type can hold `value` (None: the column is empty in this row)."""
    if value is None or type_ == "str":  # a str column holds any value as its text
        return True
    if type_ == "bool":
        return isinstance(value, bool)
    if not _number(value):
        return False
    if type_ == "int":  # NaN: empty; else a whole number inside int64
        return value != value or (-INT64 <= value < INT64 and float(value).is_integer())
    return not isinstance(value, int) or abs(value) < 1e308


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_kind(value) -> str:
    return {type(None): "null", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "…"


def to_dataframe(rows: list[dict], source: str = "<rows>") -> "pd.DataFrame":
    """Rows → DataFrame with every column of every row (bench.results.ALWAYS), typed as declared, and checked.
    Columns only some rows have (backend extras, predictions) come after them; undeclared ones load as they are."""
    import pandas as pd
    raw = pd.DataFrame.from_records([{**ADDED_LATER, **row} for row in rows])  # an older row lacks the newer fields
    order = list(ALWAYS) + sorted(c for c in raw.columns if c not in ALWAYS)
    missing = pd.Series([None] * len(raw), index=raw.index, dtype=object)
    # built in one go: a frame assigned column by column is fragmented, and its users' assign then warns
    df = pd.DataFrame({name: _typed(raw.get(name, missing), COLUMNS[name].type) if name in COLUMNS
                       else _one_type(raw[name]) for name in order})
    _size_one_moved_nothing(df)
    check(df, source)
    return df.sort_values(["status", "backend", "world_size", "tp", "cp", "pp", "dp", "run_id"],
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


def _one_type(col: "pd.Series") -> "pd.Series":
    """An undeclared column whose values mix types (or hold lists, mappings) as text: parquet holds one
    type per column."""
    if col.dtype != object:
        return col
    values = [v for v in col if v is not None and not (isinstance(v, float) and math.isnan(v))]
    kinds = {type(v) for v in values}
    too_big = kinds == {int} and any(not -INT64 <= v < INT64 for v in values)
    if len(kinds) <= 1 and not kinds & {list, dict} and not too_big:
        return col
    return col.map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else
                   (v if isinstance(v, str) else json.dumps(v, default=str))).astype("object")


ADDED_LATER = {**{k: v for k, v in DEFAULTS.items() if not isinstance(v, tuple)},  # list fields: always there
               **{name: None for name in ALWAYS if COLUMNS[name].kind in (Kind.EXACT, Kind.NOISY, Kind.ENVIRONMENT)}}
"""Every-row columns a reader fills in when an older table of the same schema version lacks them (a new
RunConfig field with its default, a new measurement or environment field empty): adding a column is no
change of meaning (SCHEMA_VERSION's rule)."""


def _size_one_moved_nothing(df: "pd.DataFrame") -> None:
    """A dimension's communication columns (comm_*_cp) that an older table lacks, in a measured row where
    that dimension has size 1: 0, what the counter records for a group of one rank and what a new run of
    the config writes, so `compare` finds it equal (not `no data`). Rows without a measurement stay empty."""
    import pandas as pd
    ok = df["status"] == Status.OK
    for dim in COMM_DIMS:
        size_one = pd.to_numeric(df[dim], errors="coerce") == 1
        for name in comm_columns(dims=(dim,)):
            values = pd.to_numeric(df[name], errors="coerce").astype("float64")
            df[name] = values.mask(values.isna() & ok & size_one, 0.0)


def check(df: "pd.DataFrame", source: str) -> None:
    """The invariants every results table keeps; a ValueError names the first broken one."""
    if df.empty:
        raise ValueError(f"{source}: no result rows")
    if "SCHEMA_VERSION" not in df.columns:
        raise ValueError(f"{source}: not a parabench results table (no SCHEMA_VERSION column)")
    import pandas as pd
    versions = set(pd.to_numeric(df["SCHEMA_VERSION"], errors="coerce").dropna().astype(int))
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
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"{path}: not a readable {what} ({type(e).__name__}: {first})") from None


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
    _check_types(df, path)
    for name, default in ADDED_LATER.items():  # added within this schema version: an older table lacks them
        if name not in df.columns:
            df[name] = default
    _size_one_moved_nothing(df)
    check(df, str(path))
    return df


def _check_types(df: "pd.DataFrame", path) -> None:
    """A parquet file's declared columns hold their declared type (a table written elsewhere may not)."""
    import pandas as pd
    for name in (c for c in df.columns if c in COLUMNS and COLUMNS[c].type != "str"):
        col, type_ = df[name], COLUMNS[name].type
        if type_ == "bool" and pd.api.types.is_bool_dtype(col):
            fine = True
        elif type_ == "bool" or col.dtype == object:  # bool with nulls reads back as objects: look at each
            fine = all(pd.isna(v) or _holds(type_, v.item() if hasattr(v, "item") else v) for v in col)
        else:
            fine = pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col)
        if not fine:
            raise ValueError(f"{path}: column {name} holds {col.dtype} values where {_TYPE_WORDS[type_]} belongs "
                             "(not a table written by `bench results`)")
