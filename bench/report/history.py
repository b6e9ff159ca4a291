"""Results over time: `bench history add` appends result rows (stamped with when and at which commit
they were recorded) to results/history.parquet; `bench history show` plots one metric of one config
over time and flags step changes (`step_changes`, pure, so a test can feed it numbers)."""
from __future__ import annotations

import datetime as _dt
import statistics
from pathlib import Path

import pandas as pd

from bench.report.load import check_frame
from bench.results import Status, label
from bench.results.store import read_parquet

DEFAULT_PATH = Path("results/history.parquet")


def add(df: pd.DataFrame, path=DEFAULT_PATH) -> tuple[int, int]:
    """Append `df`'s rows; a row already recorded (same run_id and run time) is not added twice.
    Returns (rows added, rows in the history)."""
    from bench.environment import git_sha
    path = Path(path)
    df = df.copy()  # a caller's frame may be fragmented (built column by column): assign on it would warn
    df = df.assign(recorded_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   recorded_git_sha=git_sha())
    old = read(path) if path.exists() else None
    if old is not None:
        seen = set(zip(old["run_id"].astype(str), old["time"].astype(str)))
        df = df[[(str(r), str(t)) not in seen for r, t in zip(df["run_id"], df["time"])]]
        merged = pd.concat([old, df], ignore_index=True) if not df.empty else old
    else:
        merged = df
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    _parquet_safe(merged).to_parquet(tmp, index=False)
    tmp.replace(path)
    return len(df), len(merged)


def read(path=DEFAULT_PATH) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no history yet; record a sweep with `bench history add RESULTS`")
    df = check_frame(read_parquet(path, "history parquet"), path)
    missing = [c for c in ("time", "SCHEMA_VERSION") if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a history written by `bench history add` (no {', '.join(missing)} column)")
    unknown = sorted({str(s) for s in df["status"]} - set(Status))
    if unknown:
        raise ValueError(f"{path}: unknown status value(s) {unknown[:5]}; expected {', '.join(Status)}")
    return df


def select(df: pd.DataFrame, config: str | None, where: dict[str, str]) -> pd.DataFrame:
    """Rows of one config (a run_id or config_id, or a prefix of one) and/or column filters."""
    if config:
        ids = df["run_id"].astype(str)
        cids = df["config_id"].astype(str)
        df = df[ids.str.startswith(config) | cids.str.startswith(config)]
        if df.empty:
            raise ValueError(f"no history rows for config {config!r}; `bench history show` without --config "
                             "lists the recorded configs")
    for key, value in where.items():
        if key not in df:
            raise ValueError(f"--where {key}=…: no column {key!r} in the history")
        df = df[df[key].astype(str) == value]
    return df


def series(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One point per run time: the metric's median over the repeats recorded then (ok runs only)."""
    if metric not in df:
        raise ValueError(f"no column {metric!r} in the history; try tokens_per_s, step_time_s or peak_mem_bytes")
    ok = df[df["status"] == Status.OK].copy()
    ok[metric] = pd.to_numeric(ok[metric], errors="coerce")
    ok = ok[ok[metric].notna()]
    ok["when"] = pd.to_datetime(ok["time"], utc=True, errors="coerce")
    sha = "git_sha" if "git_sha" in ok else "recorded_git_sha"
    points = ok.groupby(ok["when"].dt.floor("min")).agg(value=(metric, "median"), git_sha=(sha, "first"),
                                                        runs=(metric, "size"))
    return points.reset_index()


def step_changes(values, window: int = 3, threshold: float = 0.10) -> list[int]:
    """Indices where the level of `values` shifts: the median of the `window` points from i on differs
    from the median of the `window` points before i by more than `threshold` (relative), and the two
    windows do not overlap (every point after is above, or below, every point before). Of consecutive
    candidates only the largest shift is kept."""
    values = [float(v) for v in values]
    found: list[tuple[int, float]] = []
    for i in range(1, len(values)):
        before, after = values[max(0, i - window):i], values[i:i + window]
        b, a = statistics.median(before), statistics.median(after)
        shift = abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))
        separated = min(after) > max(before) or max(after) < min(before)
        if shift > threshold and separated:
            if found and i - found[-1][0] < window:
                if shift > found[-1][1]:
                    found[-1] = (i, shift)
                continue
            found.append((i, shift))
    return [i for i, _ in found]


def plot(points: pd.DataFrame, flagged: list[int], metric: str, title: str, out: Path) -> Path:
    from bench.report import figures
    figures.theme()
    plt = figures.plt
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(points["when"], points["value"], marker="o", color=figures.sns.color_palette(figures.PALETTE)[0])
    for i in flagged:
        ax.axvline(points["when"].iloc[i], color=figures.sns.color_palette(figures.PALETTE)[3], linestyle="--")
        ax.annotate(f"step change @ {points['git_sha'].iloc[i]}", (points["when"].iloc[i], points["value"].iloc[i]),
                    textcoords="offset points", xytext=(6, 10), fontsize=8)
    ax.set(title=title, xlabel="run time (UTC)", ylabel=label(metric))
    fig.autofmt_xdate()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def _parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns that mix types (None, numbers, strings across sweeps) are stored as strings."""
    df = df.copy()
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and pd.isna(v))}
            if len(kinds) > 1:
                df[col] = df[col].map(lambda v: None if v is None or (isinstance(v, float) and pd.isna(v)) else str(v))
    return df
