"""Results store: one JSON file per run, written by atomic rename the moment the run's outcome is
known, and a pandas DataFrame with a checked schema (exported to results.parquet).

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

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 1
"""Bumped whenever a column of COLUMNS changes meaning, name or type; every row carries it."""

STATUSES = ("ok", "failed", "oom", "timeout", "cancelled", "skipped")

# column → (kind, meaning). kind: str | int (nullable) | float | bool. Config columns come from
# RunConfig (`RunConfig.to_row()`); a row may carry more columns (per-op comm counts, backend extras),
# which load as they are.
COLUMNS: dict[str, tuple[str, str]] = {
    "SCHEMA_VERSION": ("int", "version of this schema"),
    # identity and outcome
    "run_id": ("str", "hash of the run's canonical config: the key for resume and baselines"),
    "config_id": ("str", "like run_id but equal for every repeat of a config"),
    "sweep": ("str", "sweep name (the sweep file's `name`)"),
    "status": ("str", "ok | failed | oom | timeout | cancelled | skipped"),
    "error": ("str", "why the run produced no measurement: the failing rank's traceback tail, the timeout, "
                     "the Slurm state, or (skipped) RunConfig's validation message"),
    "failed_rank": ("int", "global rank that failed first, when known"),
    "launcher": ("str", "local | slurm | debug"),
    "wall_s": ("float", "seconds from launching the run to its row, seen by the sweep process "
                        "(includes process start-up or Slurm queueing)"),
    # configuration (RunConfig fields, see bench/config.py; tuples are JSON strings)
    **{f: ("str", "RunConfig field") for f in ("model", "model_overrides", "backend", "order", "fsdp", "schedule",
                                               "dtype", "recompute", "device", "ds_set", "fault")},
    **{f: ("int", "RunConfig field") for f in ("tp", "pp", "dp", "zero", "virtual_stages", "micro_batch",
                                               "micro_batches", "seq", "steps", "warmup", "seed", "repeat",
                                               "world_size", "global_batch")},
    **{f: ("float", "RunConfig field") for f in ("bucket_mb", "timeout_s")},
    "sequence_parallel": ("bool", "RunConfig field"),
    # measurements (NaN unless status is ok)
    "params": ("float", "model parameters"),
    "step_time_s": ("float", "median timed step, slowest rank per step"),
    "step_time_p10_s": ("float", "10th percentile step time"),
    "step_time_p90_s": ("float", "90th percentile step time"),
    "tokens_per_s": ("float", "global tokens per step / median step time"),
    "tflops_per_device": ("float", "model TFLOP/s per device (FLOP convention in models/config.py)"),
    "mfu": ("float", "tflops_per_device over peak_flops"),
    "peak_flops": ("float", "the declared peak FLOP/s of one device"),
    "peak_mem_bytes": ("float", "max over ranks of the memory added at the peak of the timed steps"),
    "persistent_bytes": ("float", "max over ranks of local params + grads + optimizer state"),
    "params_bytes": ("float", "local parameter bytes (max over ranks)"),
    "grads_bytes": ("float", "local gradient bytes (max over ranks)"),
    "optimizer_bytes": ("float", "local optimizer-state bytes (max over ranks)"),
    **{f"comm_{m}_{d}": ("float", f"communication {m.replace('_', ' ')} per step in the {d} groups, mean over ranks")
       for m in ("bytes", "wire_bytes", "ops") for d in ("tp", "pp", "dp")},
    "loss_first": ("float", "global mean loss of the first step"),
    "loss_last": ("float", "global mean loss of the last step"),
    "device_name": ("str", "device the run used (cpu or the CUDA device name)"),
    # environment
    "time": ("str", "UTC time the row was made (ISO 8601)"),
    "git_sha": ("str", "commit of the code that ran"),
    "hostname": ("str", "host of rank 0 (or of the sweep process for rows without a measurement)"),
    "torch_version": ("str", "torch version"),
    "deepspeed_version": ("str", "deepspeed version"),
    "submitit_version": ("str", "submitit version"),
    "slurm_job_id": ("str", "Slurm job id (array jobs: ARRAYID_INDEX)"),
    "slurm_array_task_id": ("str", "index within the Slurm job array"),
}


class ResultStore:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.runs = self.out / "runs"

    def statuses(self) -> dict[str, str]:
        """run_id → status of every row already stored."""
        return {row["run_id"]: row["status"] for row in self.rows()}

    def write(self, row: dict) -> Path:
        """Write one row atomically: a reader (or a resumed sweep) sees the whole row or none."""
        self.runs.mkdir(parents=True, exist_ok=True)
        path = self.runs / f"{row['run_id']}.json"
        tmp = self.runs / f".{row['run_id']}.{socket.gethostname()}.{os.getpid()}.tmp"  # unique per writer
        with open(tmp, "w") as f:
            json.dump({"SCHEMA_VERSION": SCHEMA_VERSION, **row}, f, default=str, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

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
    """Rows → DataFrame with every documented column, typed, and checked."""
    import pandas as pd
    df = pd.DataFrame.from_records(rows)
    for name, (kind, _) in COLUMNS.items():
        if name not in df.columns:
            df[name] = None
        df[name] = _typed(df[name], kind)
    front = list(COLUMNS)
    df = df[front + sorted(c for c in df.columns if c not in COLUMNS)]
    check(df, source)
    return df.sort_values(["status", "backend", "world_size", "tp", "pp", "dp", "run_id"],
                          key=lambda s: s.astype(str), ignore_index=True)


def _typed(col: "pd.Series", kind: str) -> "pd.Series":
    import pandas as pd
    if kind == "float":
        return pd.to_numeric(col, errors="coerce").astype("float64")
    if kind == "int":
        return pd.to_numeric(col, errors="coerce").astype("Int64")
    if kind == "bool":
        return col.astype("boolean")
    return col.map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                   ).astype("object")


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
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{source}: results table lacks column(s) {missing}")
    bad = sorted(set(df["status"]) - set(STATUSES))
    if bad:
        raise ValueError(f"{source}: unknown status value(s) {bad}; expected {', '.join(STATUSES)}")
    dupes = df["run_id"][df["run_id"].duplicated()].tolist()
    if dupes:
        raise ValueError(f"{source}: duplicated run_id(s) {dupes[:5]}")
    ok = df[df["status"] == "ok"]
    if ok["step_time_s"].isna().any():
        raise ValueError(f"{source}: rows with status ok but no step_time_s: {ok['run_id'][ok['step_time_s'].isna()].tolist()[:5]}")
    if df.loc[df["status"] != "ok", "error"].isna().any():
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
    check(df, str(path))
    return df
