"""The result row: its columns (`schema`), and one builder per outcome (`rows`).

How a row is written: the worker measures on every rank and rank 0 calls `measured_row`; a run that
fails, runs out of memory, times out or is cancelled gets `failure_row` from whoever saw it end (the
local rank pool or the Slurm watcher); a combination that cannot run gets `skipped_row` from the sweep
expansion. Each row is then written once, by atomic rename, by `bench.results.store.ResultStore`.
"""
from bench.results.rows import (RankResult, classify_error, failure_row, format_exception, interrupted, measured_row,
                                over_ranks, skipped_row)
from bench.results.schema import (ALWAYS, COLUMNS, EXACT, NOISY, PROBLEMS, SCHEMA_VERSION, Column, Compare, Kind,
                                  Status, comm_column, comm_columns, comm_op_column, label, markdown_table, unit)

__all__ = ["RankResult", "ALWAYS", "COLUMNS", "EXACT", "NOISY", "PROBLEMS", "SCHEMA_VERSION", "Column", "Compare", "Kind", "Status",
           "classify_error", "comm_column", "comm_columns", "comm_op_column", "failure_row", "format_exception",
           "interrupted", "label", "markdown_table", "measured_row", "over_ranks", "skipped_row", "unit"]
