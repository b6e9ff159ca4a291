"""One builder per outcome: `measured_row` (ok), `failure_row` (failed, oom, timeout, cancelled) and
`skipped_row` (a combination that cannot run, or that the launcher cannot place).

Every row carries the config columns, `status`, `error` and the environment; the measured row adds
the columns of `schema.COLUMNS`, each made one from every rank's value as the column declares.
"""
from __future__ import annotations

import json
import statistics
import traceback
from dataclasses import dataclass

from bench.config import DEFAULTS, ConfigError, RunConfig, _digest, model_config
from bench.conventions import ZERO3_KNOBS
from bench.environment import environment
from bench.results.schema import COLUMNS, PROBLEMS, SCHEMA_VERSION, Status, comm_columns


def failure_row(cfg: RunConfig, status: str, error: str, failed_rank: int | None = None) -> dict:
    """A run that was launched and produced no measurement; it keeps every config column."""
    assert Status(status) in PROBLEMS, f"{status}: not a failure (skipped runs: skipped_row)"
    return _row(cfg.to_row(), status, error, failed_rank)


def interrupted(row: dict) -> bool:
    """Whether a stored row's run was ended by its scheduler, not by what it ran: a Slurm job cancelled
    (scancel, a preemption it was not requeued after) or killed at its time limit.
    `--resume` reruns such runs."""
    return row.get("launcher") == "slurm" and row["status"] in (Status.CANCELLED, Status.TIMEOUT)


def skipped_row(run: RunConfig | dict, reason: str) -> dict:
    """A combination that cannot run: a RunConfig the launcher cannot place (its own run_id), or sweep
    parameters RunConfig refused (every config column with defaults filled in, and an id hashed from them)."""
    return _row(run.to_row() if isinstance(run, RunConfig) else _refused_config(run), Status.SKIPPED, reason)


def _row(config: dict, status: Status | str, error: str | None, failed_rank: int | None = None) -> dict:
    return {"SCHEMA_VERSION": SCHEMA_VERSION, **config, "status": Status(status).value, "error": error,
            "failed_rank": failed_rank, **environment()}


HASHED_OFF_DEFAULT = {name: DEFAULTS[name] for name in ("compile", "profile", "cp", "cp_comm", "ep", *ZERO3_KNOBS)}
"""RunConfig fields added after the refused configs' ids were fixed → their default (left out of the hash
while at it, so the skipped rows of older sweeps keep their ids, as RunConfig.canonical leaves out every
default)."""


def _refused_config(params: dict) -> dict:
    row = {**DEFAULTS, **params}
    if row.get("seq") is None:
        try:
            row["seq"] = model_config(row["model"], tuple(row.get("model_overrides") or ())).seq_len
        except (ConfigError, ValueError, TypeError):
            pass
    if row.get("dp") == "auto":
        row["dp"] = None  # unresolved: the world size does not divide
    row = {k: (json.dumps(list(v)) if isinstance(v, (tuple, list)) else v) for k, v in row.items()}
    # the whole row (a refused config has no canonical form), less fields added since ids were fixed
    # while they are at their default, so that adding one keeps every existing id
    digest = _digest({k: v for k, v in row.items() if not (k in HASHED_OFF_DEFAULT and v == HASHED_OFF_DEFAULT[k])})
    return {**row, "run_id": digest, "config_id": digest, "global_batch": None}


def classify_error(text: str) -> Status:
    """oom for out-of-memory errors (CUDA, Python, or a host allocator's ENOMEM), failed for anything else."""
    lowered = text.lower()
    oom = ("out of memory", "memoryerror", "cannot allocate memory")  # ENOMEM: "Error code 12 (Cannot allocate memory)"
    return Status.OOM if any(words in lowered for words in oom) else Status.FAILED


def format_exception(exc: BaseException) -> str:
    """The traceback's last 4,000 characters: enough to name the failing line, small enough for a row."""
    return "".join(traceback.format_exception(exc))[-4000:]


# --- the measured row ---------------------------------------------------------------------------------------


@dataclass
class RankResult:
    """What one rank measured in a run (bench/worker.py), gathered on rank 0 into the row."""

    rank: int
    losses: list[float | None]
    """The loss of every step (warm-up first); None on a rank that computes none (not a last stage)."""
    times: list[float]
    """Seconds of every timed step."""
    peak_mem: int
    """Peak allocated bytes of a step beyond what was allocated before it."""
    state: dict[str, int]
    """Bytes of parameters, gradients and optimizer state kept between steps (params, grads, optimizer)."""
    comm: dict[str, float]
    """The communication counter's columns for one step."""
    extras: dict
    """The backend's own columns (Trainer.extras)."""
    device_name: str
    node: str = ""
    """The node it ran on (bench.environment.node_name)."""
    peak_flops: tuple[float, str] | None = None
    """The MFU denominator and its source; rank 0 only."""
    peak_mem_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    host_syncs: int | None = None
    cuda_syncs: int | None = None


def measured_row(cfg: RunConfig, ranks: list[RankResult]) -> dict:
    """The row of a run that finished, from every rank's measurements."""
    from models import count_params, flops_per_token
    timing = step_time_summary([max(r.times[i] for r in ranks) for i in range(len(ranks[0].times))])  # slowest rank
    timing.update(per_rank_step_times([statistics.median(r.times) for r in ranks]))
    step_s = timing["step_time_s"]
    flops_step = flops_per_token(cfg.model_config, cfg.seq) * cfg.tokens_per_step
    peak, peak_src = ranks[0].peak_flops
    losses = _replica_losses(ranks)
    row = {**_row(cfg.to_row(), Status.OK, None), "params": count_params(cfg.model_config), **timing,
           "tokens_per_s": cfg.tokens_per_step / step_s,
           "tflops_per_device": flops_step / step_s / cfg.world / 1e12,
           "peak_flops": peak, "peak_flops_source": peak_src,
           "peak_mem_bytes": over_ranks("peak_mem_bytes", [r.peak_mem for r in ranks]),
           "peak_mem_bytes_per_rank": json.dumps([r.peak_mem for r in ranks]),
           "loss_first": losses[0], "loss_last": losses[-1], "losses": json.dumps(losses),
           "device_name": ranks[0].device_name, "node_per_rank": json.dumps([r.node for r in ranks])}
    row["mfu"] = row["tflops_per_device"] * 1e12 / peak
    for name, key in (("peak_mem_reserved_bytes", "peak_mem_reserved_bytes"), ("alloc_retries", "alloc_retries"),
                      ("host_syncs_per_step", "host_syncs"), ("cuda_syncs_per_step", "cuda_syncs")):
        values = [getattr(r, key) for r in ranks if getattr(r, key) is not None]  # None on CPU: CUDA-only probes
        row[name] = over_ranks(name, values) if values else None
    for kind in ("params", "grads", "optimizer"):
        row[f"{kind}_bytes"] = over_ranks(f"{kind}_bytes", [r.state[kind] for r in ranks])
    persistent = [sum(r.state.values()) for r in ranks]
    row.update(persistent_bytes=over_ranks("persistent_bytes", persistent),
               persistent_bytes_per_rank=json.dumps(persistent))
    for key in sorted({k for r in ranks for k in r.comm} | set(comm_columns())):
        row[key] = over_ranks(key, [r.comm.get(key, 0) for r in ranks])  # a rank without the op sent 0
    row.update(_merge_extras([r.extras for r in ranks]))
    return row  # the pred_* columns are added by whoever receives it, outside the ranks (estimate.with_predictions)


def step_time_summary(times: list[float]) -> dict[str, float]:
    """The step-time columns: median, p10 and p90 of the steps' seconds (none without a step)."""
    if not times:
        return {}
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return {"step_time_s": statistics.median(times), "step_time_p10_s": q[0], "step_time_p90_s": q[-1]}


def per_rank_step_times(medians: list[float]) -> dict:
    """Each rank's median step, the spread (slowest rank's / the median rank's) and the slowest rank: a
    straggler is a rank whose steps take longer than the others' (bench.report flags a spread above
    STRAGGLER_SPREAD)."""
    slowest = max(range(len(medians)), key=medians.__getitem__)
    middle = statistics.median(medians)
    return {"step_time_s_per_rank": json.dumps(medians), "slowest_rank": slowest,
            "step_time_spread": medians[slowest] / middle if middle > 0 else 1.0}


def _replica_losses(ranks: list[RankResult]) -> list[float]:
    """Mean over the ranks that computed a loss: every data-parallel replica reports equally often."""
    out = []
    for i in range(len(ranks[0].losses)):
        values = [r.losses[i] for r in ranks if r.losses[i] is not None]
        out.append(sum(values) / len(values) if values else float("nan"))
    return out


def over_ranks(name: str, values: list):
    """One value from every rank's, as column `name` declares (undeclared: numbers mean, else rank 0's)."""
    col = COLUMNS.get(name)
    how = col.ranks if col else "mean"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if how == "max" and numbers:
        return max(values)
    if how == "mean" and numbers:
        return statistics.fmean(values)
    return values[0]


def _merge_extras(extras: list[dict]) -> dict:
    """Backend extras: the columns rank 0 reports, each over the ranks that report it."""
    return {key: over_ranks(key, [e[key] for e in extras if key in e]) for key in extras[0]}
