"""Regression gate: compare a current result set with a baseline, config by config.

Statistics live in one pure function, `judge`, so a test can feed it numbers by hand. Everything else
groups rows (repeats of a config share `config_id`) and formats the verdicts.

Which metric is exact, noisy or ignored is declared with the column (bench/results/schema.py):

* exact metrics (parameter counts, state bytes, communication bytes and ops, predictions) are
  deterministic for a config: any difference is a `changed` verdict, a failure;
* noisy metrics (step time, tokens/s, measured peak memory, measured bubble) regress only when the
  current median is worse than the baseline median by more than the threshold (default 5 %) AND by
  more than the noise: the larger spread (max − min) of the two sides' repeats. One run per side has
  no spread, so it compares by the threshold alone. (Measured memory and bubble also have a small
  absolute floor, below which a change is not a regression: the column's `floor`.)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import pandas as pd

from bench.report.labels import config_label
from bench.results import COLUMNS, EXACT, Compare, Status
from bench.results import NOISY as NOISY_COLUMNS

DEFAULT_THRESHOLD = 0.05
STRAGGLER_SPREAD = 1.5
"""A rank whose median step is more than this × the median rank's is a straggler (the row's step_time_spread).
Healthy runs here stay under it: 4 ranks sharing 2 cores, with the machine loaded by other jobs, spread up
to 1.25 (2026-12-02, world-4 ddp/native tiny); a rank slowed by 100 ms a step reads ~3."""

NOISY = {name: (col.compare == Compare.HIGHER, col.floor) for name, col in NOISY_COLUMNS.items()}
"""name: (higher_is_better, floor), from the declaration."""
FAILED_VERDICTS = ("changed", "missing", "regressed", "failed", "straggler")


@dataclass(frozen=True)
class Judgement:
    verdict: str  # exact: equal | changed | missing (gone from current); noisy: ok | regressed | improved; no data
    base: float | None
    current: float | None
    change: float | None  # (current − base) / |base|
    noise: float | None  # larger max − min spread of the repeats, in the metric's unit
    limit: float | None  # how much worse the current may be before it regresses
    base_range: tuple[float, float] | None = None  # (min, max) over the baseline's repeats (noisy, > 1 repeat)
    current_range: tuple[float, float] | None = None  # (min, max) over the current repeats


def judge(base, current, *, exact: bool, higher_is_better: bool = False,
          threshold: float = DEFAULT_THRESHOLD, floor: float = 0.0, rel_tol: float = 1e-9) -> Judgement:
    """Verdict for one metric of one config from the baseline's and the current repeats' values
    (exact: equal within `rel_tol` relative, or 1e-9 absolute)."""
    base = [float(v) for v in base if _finite(v)]
    current = [float(v) for v in current if _finite(v)]
    if not base or not current:
        return Judgement("no data", _median(base), _median(current), None, None, None)
    b, c = statistics.median(base), statistics.median(current)
    change = (c - b) / abs(b) if b else (0.0 if c == b else math.inf)
    if exact:
        same = math.isclose(b, c, rel_tol=rel_tol, abs_tol=1e-9)
        return Judgement("equal" if same else "changed", b, c, change, 0.0, 0.0)
    noise = max(_spread(base), _spread(current))
    limit = max(threshold * abs(b), noise, floor)
    worse_by = (b - c) if higher_is_better else (c - b)  # > 0: current is worse
    verdict = "regressed" if worse_by > limit else "improved" if -worse_by > limit else "ok"
    return Judgement(verdict, b, c, change, noise, limit, _range(base), _range(current))


@dataclass
class Comparison:
    rows: list[dict] = field(default_factory=list)  # one per config × metric
    new: list[dict] = field(default_factory=list)  # configs only in current
    missing: list[dict] = field(default_factory=list)  # configs only in the baseline
    notes: list[str] = field(default_factory=list)
    exact_only: bool = False

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.rows if r["gated"] and r["verdict"] in FAILED_VERDICTS]

    @property
    def regressed(self) -> bool:
        return bool(self.failures)

    def to_dict(self) -> dict:
        return {"regressed": self.regressed, "exact_only": self.exact_only, "failures": len(self.failures),
                "notes": self.notes, "new": self.new, "missing": self.missing, "rows": self.rows}


def compare(base: pd.DataFrame, current: pd.DataFrame, thresholds: dict[str, float] | None = None,
            default_threshold: float = DEFAULT_THRESHOLD, exact_only: bool = False) -> Comparison:
    """Match configs by config_id (repeats aggregated) and judge every metric present on both sides."""
    thresholds = thresholds or {}
    unknown = sorted(set(thresholds) - set(NOISY))
    if unknown:
        raise ValueError(f"threshold for unknown noisy metric(s) {', '.join(unknown)}; "
                         f"noisy metrics are {', '.join(NOISY)}")
    out = Comparison(exact_only=exact_only)
    b_groups, c_groups = _groups(base), _groups(current)
    for cid in sorted(set(c_groups) - set(b_groups)):
        out.new.append(_describe(c_groups[cid]))
    for cid in sorted(set(b_groups) - set(c_groups)):
        out.missing.append(_describe(b_groups[cid]))
    exact_cols = _exact_columns(base, current)
    shared = sorted(set(b_groups) & set(c_groups), key=lambda cid: _describe(c_groups[cid])["label"])
    for cid in shared:
        out.rows.extend(_compare_config(b_groups[cid], c_groups[cid], exact_cols, thresholds,
                                        default_threshold, exact_only))
    return out


def _compare_config(b: pd.DataFrame, c: pd.DataFrame, exact_cols, thresholds, default, exact_only) -> list[dict]:
    info = _describe(c)
    b_ok, c_ok = b[b["status"] == Status.OK], c[c["status"] == Status.OK]
    if b_ok.empty and c_ok.empty:
        return []  # failing or skipped on both sides: nothing measured to compare
    if c_ok.empty or b_ok.empty:
        verdict = "failed" if c_ok.empty else "fixed"
        if c_ok.empty and (c["status"] == Status.SKIPPED).all():
            verdict = "skipped"  # now refused by a support check: less coverage, said, not a failure
        error = _first_error(c if c_ok.empty else b)
        return [{**info, "metric": "status", "kind": "status", "verdict": verdict, "gated": verdict == "failed",
                 "base": _statuses(b), "current": _statuses(c), "change": None, "noise": None, "limit": None,
                 "threshold": None, "error": error}]
    rows = []
    for metric in exact_cols:
        col = COLUMNS[metric]
        if col.exact_dtypes and str(c_ok["dtype"].iloc[0] if "dtype" in c_ok else "") not in col.exact_dtypes:
            continue  # exact only on some dtypes (fp32 losses)
        if metric in b_ok:
            c_ok = c_ok if metric in c_ok else c_ok.assign(**{metric: float("nan")})
            j = judge(b_ok[metric], c_ok[metric], exact=True, rel_tol=col.rel_tol)
            if j.base is None and j.current is None:
                continue  # the metric does not apply to this config (e.g. a prediction it has none of)
            if j.current is None:
                j = Judgement("missing", j.base, None, None, None, None)  # measured before, not any more
            rows.append({**info, "metric": metric, "kind": "exact", "gated": True, "threshold": 0.0, **asdict(j)})
    for metric, (higher, floor) in NOISY.items():
        if metric in b_ok and metric in c_ok:
            threshold = thresholds.get(metric, default)
            j = judge(b_ok[metric], c_ok[metric], exact=False, higher_is_better=higher, threshold=threshold,
                      floor=floor)
            if j.verdict != "no data":
                rows.append({**info, "metric": metric, "kind": "noisy", "gated": not exact_only,
                             "threshold": threshold, **asdict(j)})
    return rows + _new_straggler(b_ok, c_ok, info, exact_only)


def _new_straggler(b: pd.DataFrame, c: pd.DataFrame, info: dict, exact_only: bool) -> list[dict]:
    """A finding when the current runs of a config have a straggler (spread above STRAGGLER_SPREAD in their
    median) and the baseline's had none: timing, so gated like the noisy metrics."""
    current = _median(_finite_values(c, "step_time_spread"))
    if current is None or current <= STRAGGLER_SPREAD:
        return []
    base = _median(_finite_values(b, "step_time_spread"))
    if base is not None and base > STRAGGLER_SPREAD:
        return []  # the baseline had one already: not new
    rank = c["slowest_rank"].mode().iloc[0] if "slowest_rank" in c else None
    return [{**info, "metric": "step_time_spread", "kind": "noisy", "verdict": "straggler", "gated": not exact_only,
             "base": base, "current": current, "change": None, "noise": None, "limit": STRAGGLER_SPREAD,
             "threshold": STRAGGLER_SPREAD, "error": f"rank {int(rank)} is the slowest" if rank is not None else None}]


def _finite_values(df: pd.DataFrame, column: str) -> list[float]:
    return [float(v) for v in df[column] if _finite(v)] if column in df else []


def _exact_columns(base: pd.DataFrame, current: pd.DataFrame) -> list[str]:
    return [c for c in EXACT if c in base.columns or c in current.columns]


def _groups(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(k): g for k, g in df.groupby(df["config_id"].fillna(df["run_id"]), sort=True)}


def _describe(group: pd.DataFrame) -> dict:
    row = group.iloc[0].to_dict()
    return {"config_id": str(row["config_id"]), "run_id": str(row["run_id"]),
            "label": config_label(row), "repeats": int(len(group)), "status": _statuses(group)}


def _statuses(group: pd.DataFrame) -> str:
    counts = group["status"].value_counts()
    return ", ".join(f"{n}×{s}" if n > 1 else str(s) for s, n in counts.items())


def _first_error(group: pd.DataFrame) -> str | None:
    if "error" not in group:
        return None
    for value in group["error"]:
        if isinstance(value, str) and value.strip():
            return value.strip().splitlines()[-1][:200]
    return None


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if len(values) > 1 else 0.0


def _range(values: list[float]) -> tuple[float, float] | None:
    """(min, max) of the repeats: the spread `compare` shows beside the median (None for one run)."""
    return (min(values), max(values)) if len(values) > 1 else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def prediction_mismatches(df: pd.DataFrame) -> list[str]:
    """Where a run's predicted communication differs from what it measured: every `pred_comm_*`
    column of a row with status ok against its `comm_*` column (bytes, wire bytes and ops per
    group). The cost model is exact for communication, so any difference is a failure; one line
    per difference, naming the config."""
    ok = df[df["status"] == Status.OK] if "status" in df else df
    pairs = [(p, p[len("pred_"):]) for p in ok.columns if p.startswith("pred_comm_") and p[len("pred_"):] in ok]
    out = []
    for _, row in ok.iterrows():
        for pred, meas in pairs:
            p, m = row[pred], row[meas]
            if _finite(p) and _finite(m) and not math.isclose(float(p), float(m), rel_tol=1e-9, abs_tol=1e-6):
                out.append(f"{config_label(row.to_dict())}: {pred} = {float(p):g}, {meas} = {float(m):g}")
    return out
