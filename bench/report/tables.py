"""The report's tables: plain dataframes of display strings (HTML and Markdown render the same ones)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.report.figures import ok_runs, per_config, profiles_used
from bench.report.labels import MiB, add_labels, present
from bench.report.parity import FP32_REL, SIGNAL_SHARE, loss_tolerance, training_signal
from bench.results import Status

PARITY_KEY = ("model", "model_overrides", "seed", "seq", "global_batch", "dtype", "steps", "warmup")


def summary(df: pd.DataFrame) -> dict:
    counts = df["status"].value_counts().to_dict()
    ok = ok_runs(df, "tokens_per_s")
    best = None
    if not ok.empty:
        top = per_config(ok, ["tokens_per_s"]).sort_values("tokens_per_s").iloc[-1]
        best = f"{top['label']}: {top['tokens_per_s']:,.0f} tokens/s"
    return {"runs": len(df), "counts": counts, "configs": df["config_id"].nunique(),
            "best": best, "sweeps": sorted({str(s) for s in df.get("sweep", pd.Series(dtype=object)).dropna()}),
            "profiles": profiles_used(ok) if not ok.empty else None}


def top_configs(df: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    ok = ok_runs(df, "tokens_per_s", "step_time_s")
    if ok.empty:
        return pd.DataFrame()
    key = "config_id"
    spread = ok.groupby(key)["tokens_per_s"].agg(lambda s: s.max() - s.min())
    steps = ok.groupby(key)["step_time_s"]
    metrics = [c for c in ("tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "persistent_bytes") if c in ok]
    cfg = per_config(ok, metrics).sort_values("tokens_per_s", ascending=False).head(n)
    return pd.DataFrame({
        "#": range(1, len(cfg) + 1),
        "config": cfg["label"].values,
        "world": cfg["world_size"].values if "world_size" in cfg else "–",
        "tokens/s": [f"{v:,.0f}" + (f" ± {spread[k] / 2:,.0f}" if r > 1 else "")
                     for v, k, r in zip(cfg["tokens_per_s"], cfg[key], cfg["repeats"])],
        "step (ms)": [f"{v * 1e3:.1f}" for v in cfg["step_time_s"]],
        "step ms: median [min–max]": [_median_range(steps.get_group(k)) for k in cfg[key]],
        "MFU": [f"{v:.2%}" if present(v) else "–" for v in cfg.get("mfu", [math.nan] * len(cfg))],
        "state + step peak (MiB/rank)": [_mib(a, b) for a, b in zip(cfg.get("persistent_bytes", [math.nan] * len(cfg)),
                                                                     cfg.get("peak_mem_bytes", [math.nan] * len(cfg)))],
        "repeats": cfg["repeats"].astype(int).values,
        "run_id": cfg["run_id"].values,
    })


def _median_range(seconds: pd.Series) -> str:
    """Median step time over a config's repeats and, with several, their range (the drift a reader must allow)."""
    ms = seconds.astype(float) * 1e3
    return f"{ms.median():.1f}" + (f" [{ms.min():.1f}–{ms.max():.1f}]" if len(ms) > 1 else "")


def traces(df: pd.DataFrame, report_dir) -> pd.DataFrame:
    """Profiled runs (`profile: true`): a link to each run's trace folder and its rank-0 time split."""
    if "trace_dir" not in df:
        return pd.DataFrame()
    runs = add_labels(df[df["trace_dir"].map(present)])
    rows = []
    for _, run in runs.iterrows():
        folder = Path(str(run["trace_dir"]))
        rows.append({"config": run["label"], "run_id": run["run_id"],
                     "trace": Link(f"{run['run_id']}/trace_rank0.json", _relative(folder / "trace_rank0.json", report_dir)),
                     "op table": Link("ops_rank0.md", _relative(folder / "ops_rank0.md", report_dir)),
                     "rank 0: compute / communication / idle": _split(folder / "ops_rank0.md")})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Link:
    """A table cell that renders as a link (HTML and Markdown); not a str, which pandas would store as text."""
    text: str
    href: str

    def __str__(self) -> str:
        return self.text


def _relative(path: Path, report_dir) -> str:
    return os.path.relpath(path, Path(report_dir).resolve()) if path.is_absolute() else str(path)


def _split(ops_table: Path) -> str:
    """'62 % / 35 % / 3 %' from the op table's first rows (– when it is not there)."""
    try:
        lines = ops_table.read_text().splitlines()
    except OSError:
        return "–"
    shares = [ln.split("|")[3].strip() for ln in lines if ln.startswith(("| compute", "| communication", "| idle"))]
    return " / ".join(shares) if len(shares) == 3 else "–"


def loss_parity(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Each run's losses against the single-process run (world size 1) of the same model, seed and batch."""
    ok = ok_runs(df, "loss_last", "world_size")
    if ok.empty:
        return pd.DataFrame(), "No successful run with a loss: nothing to compare."
    key = [c for c in PARITY_KEY if c in ok]
    refs = ok[ok["world_size"] == 1]
    refs = refs.assign(_other=refs["backend"] != "native").sort_values(["_other", "run_id"])  # prefer native
    if refs.empty:
        return pd.DataFrame(), ("No single-process reference run (world size 1) in these results: add one "
                                "(e.g. backend native, tp = pp = dp = 1, same model, seed and global batch) "
                                "to check loss parity.")
    ref_by_key = {tuple(str(r[k]) for k in key): r for _, r in refs.iloc[::-1].iterrows()}  # first wins
    rows = []
    for _, run in ok[ok["world_size"] > 1].iterrows():
        ref = ref_by_key.get(tuple(str(run[k]) for k in key))
        if ref is None:
            continue
        diff = _max_loss_diff(run, ref)
        tol = loss_tolerance(str(run.get("dtype")), training_signal(_losses(ref)))
        rel = diff / abs(ref["loss_last"]) if ref["loss_last"] else diff
        rows.append({"run": run["label"], "run_id": run["run_id"], "reference": ref["label"],
                     "loss (last step)": f"{run['loss_last']:.6f}", "reference loss": f"{ref['loss_last']:.6f}",
                     "max |Δloss| over steps": f"{diff:.2e}", "parity": "✓" if rel <= tol else f"✗ (> {tol:g} rel)"})
    if not rows:
        return pd.DataFrame(), ("The single-process run(s) here use another model, seed, sequence length or global "
                                "batch than every multi-rank run, so no run has a reference to compare with.")
    note = (f"Reference: the world-size-1 run with the same {', '.join(key)}. Tolerance: {FP32_REL:g} relative "
            f"for fp32; for mixed precision {SIGNAL_SHARE:g} × the reference's own relative loss change over the "
            "run (its training signal), so a run that trains at half speed or not at all fails.")
    return pd.DataFrame(rows), note


def _max_loss_diff(run, ref) -> float:
    a, b = _losses(run), _losses(ref)
    if len(a) == len(b) and a:
        return max(abs(x - y) for x, y in zip(a, b))
    return abs(run["loss_last"] - ref["loss_last"])


def _losses(row) -> list[float]:
    """Every step's loss (the `losses` JSON list), or first and last where the list is missing."""
    try:
        return json.loads(row["losses"])
    except (TypeError, ValueError, KeyError):
        return [row["loss_first"], row["loss_last"]]


def stragglers(df: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the median step of every run whose slowest rank's exceeds the median rank's by more than
    STRAGGLER_SPREAD (bench/report/compare.py); the slowest rank is marked."""
    from bench.report.compare import STRAGGLER_SPREAD
    if "step_time_spread" not in df:
        return pd.DataFrame()
    slow = df[(df["status"] == Status.OK) & (pd.to_numeric(df["step_time_spread"], errors="coerce") > STRAGGLER_SPREAD)]
    if slow.empty:
        return pd.DataFrame()
    slow = add_labels(slow)
    rows = []
    for _, run in slow.iterrows():
        per_rank = json.loads(run["step_time_s_per_rank"])
        cells = {f"rank {r}": f"{t * 1e3:.1f}" + (" ◀ slowest" if r == int(run["slowest_rank"]) else "")
                 for r, t in enumerate(per_rank)}
        rows.append({"config": run["label"], "run_id": run["run_id"], "spread": f"{run['step_time_spread']:.2f}×",
                     "straggler": f"rank {int(run['slowest_rank'])}", **cells})
    return pd.DataFrame(rows).fillna("")


def failures(df: pd.DataFrame) -> pd.DataFrame:
    bad = df[df["status"] != Status.OK]
    if bad.empty:
        return pd.DataFrame()
    bad = add_labels(bad)
    return pd.DataFrame({"status": bad["status"].values, "config": bad["label"].values,
                         "run_id": bad["run_id"].values,
                         "reason": [_reason(e) for e in bad.get("error", [None] * len(bad))]})


def _reason(error) -> str:
    """The line of a traceback that says what went wrong (its last non-empty line), shortened."""
    if not present(error):
        return "(no reason recorded)"
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else str(error))[:300]


ENV_COLUMNS = (("hostname", "host"), ("device_name", "device"), ("torch_version", "torch"),
               ("deepspeed_version", "deepspeed"), ("submitit_version", "submitit"), ("git_sha", "git sha"),
               ("peak_flops_source", "MFU peak source"), ("launcher", "launcher"), ("slurm_job_id", "Slurm job"))


def environment(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for col, name in ENV_COLUMNS:
        if col in df:
            values = sorted({str(v) for v in df[col] if present(v)})
            if values:
                rows.append({"": name, "value": ", ".join(values[:6]) + (" …" if len(values) > 6 else "")})
    if "time" in df:
        times = sorted(str(t) for t in df["time"] if present(t))
        if times:
            rows.append({"": "run time (UTC)", "value": f"{times[0]} … {times[-1]}" if len(times) > 1 else times[0]})
    if "peak_flops" in df:
        peaks = pd.to_numeric(df["peak_flops"], errors="coerce").dropna()
        if not peaks.empty:
            rows.append({"": "peak FLOP/s (MFU denominator)", "value": f"{peaks.median() / 1e12:.3g} TFLOP/s"})
    return pd.DataFrame(rows)


def _mib(state, peak) -> str:
    parts = [v for v in (state, peak) if present(v)]
    return f"{sum(parts) / MiB:.2f}" if parts else "–"
