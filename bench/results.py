"""Result rows that carry no measurement: failed, hung, out-of-memory, cancelled or skipped runs."""
from __future__ import annotations

from bench.config import RunConfig
from bench.environment import environment


def failure_row(cfg: RunConfig, status: str, error: str, failed_rank: int | None = None) -> dict:
    """A row for a run that produced no measurement; it keeps every config column."""
    return {**cfg.to_row(), "status": status, "error": error, "failed_rank": failed_rank, **environment()}


def classify_error(text: str) -> str:
    """oom for out-of-memory errors (CUDA or host), failed for anything else."""
    lowered = text.lower()
    return "oom" if ("out of memory" in lowered or "memoryerror" in lowered) else "failed"
