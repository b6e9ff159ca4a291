"""Every column of a result row, declared once: name, type, unit, meaning, kind, how the ranks'
values become one, and how `bench compare` judges it.

The store's schema check, compare's exact and noisy sets, the report's units and docs/row-schema.md's table
all read `COLUMNS`. Config columns come from RunConfig's fields (their `help` is the meaning);
columns with a suffix per parallel dimension (`comm_bytes_{tp,pp,dp}`) come from one `Family`.
Pure Python: no torch, no pandas.
"""
from __future__ import annotations

import enum
import typing
from dataclasses import dataclass, fields, replace

from bench.config import RunConfig, help_text
from bench.layout import DIMS

SCHEMA_VERSION = 1
"""Bumped whenever a column changes meaning, name or type; every row carries it."""


class Status(enum.StrEnum):
    """How a run ended; the order is the report's (successes first)."""

    OK = "ok"
    FAILED = "failed"
    OOM = "oom"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


PROBLEMS = (Status.FAILED, Status.OOM, Status.TIMEOUT, Status.CANCELLED)
"""Statuses of a run that was launched and produced no measurement (--retry-failed reruns them)."""


class Kind(enum.StrEnum):
    IDENTITY = "identity"  # which run this row is
    OUTCOME = "outcome"  # how it ended
    CONFIG = "config"  # what was asked for (RunConfig) or what the backend made of it
    EXACT = "measured-exact"  # deterministic for a config: any change is a change of behaviour
    NOISY = "measured-noisy"  # varies from run to run (timing, allocator)
    PREDICTED = "predicted"  # the analytic model's value for the config (bench/analysis)
    ENVIRONMENT = "environment"  # where and with what it ran


class Compare(enum.StrEnum):
    EXACT = "exact"  # must be equal
    LOWER = "noisy lower-better"  # regresses when higher by more than threshold and noise
    HIGHER = "noisy higher-better"
    IGNORED = "ignored"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    """str | int | float | bool (str for JSON lists)."""
    meaning: str
    kind: Kind
    unit: str = ""
    ranks: str = "-"
    """How the ranks' values become one: max, mean, slowest (per step, then the statistic), rank0,
    replicas (mean over the ranks that compute a loss), per-rank (JSON list), sweep (the sweep process)."""
    compare: Compare = Compare.IGNORED
    floor: float = 0.0
    """Noisy columns: a change smaller than this (in `unit`) never counts (page-sized RSS steps; a bubble
    of 0.4 % vs 0.9 % is no pipeline regression)."""
    always: bool = True
    """Every row has it (NaN/None when it does not apply); else only rows of the backend that makes it."""
    rel_tol: float = 1e-9
    """Exact columns: a relative difference up to this still counts as equal."""
    exact_dtypes: tuple = ()
    """Exact columns: compared only on runs of these dtypes (empty: every run)."""


@dataclass(frozen=True)
class Family:
    """Columns that differ only by a suffix or infix, e.g. comm_bytes_{dim} for dim in tp, pp, dp."""

    template: str
    """A name with `{placeholders}`, filled from `values`."""
    values: dict
    column: Column
    """Its name is ignored; its meaning may use the placeholders too."""

    def columns(self) -> list[Column]:
        keys = list(self.values)
        combos = [{}]
        for key in keys:
            combos = [{**c, key: v} for c in combos for v in self.values[key]]
        return [replace(self.column, name=self.template.format(**c), meaning=self.column.meaning.format(**c))
                for c in combos]

    @property
    def pattern(self) -> str:
        """The family as one name: comm_bytes_{tp,pp,dp} (docs/row-schema.md's spelling; long lists stay `{op}`)."""
        return self.template.format(**{k: "{" + ",".join(v) + "}" if len(v) <= 5 else "{" + k + "}"
                                       for k, v in self.values.items()})


COMM_WHAT = {"bytes": ("bytes", "payload bytes per optimizer step (all-reduce input, all-gather output, "
                                "reduce-scatter input, P2P sent)"),
             "wire_bytes": ("bytes", "bytes per optimizer step as a ring moves them (all-reduce 2(n−1)/n, "
                                     "all-gather and reduce-scatter (n−1)/n)"),
             "ops": ("ops", "collective and P2P ops per optimizer step")}
COMM_DIMS = (*DIMS, "ep")
"""The groups a row's comm columns count: the layout's dimensions and the ep group (its dispatch and combine
all-to-alls; the expert-gradient reduction over edp is dp's, data-parallel traffic)."""
COMM_GROUPS = ("world", "other")
"""Groups outside the layout's dimensions: the whole world (DeepSpeed's), or one that matches no dimension."""
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
            "scatter", "send", "recv")


COMM = "comm_{what}_{dim}"
COMM_OP = "comm_{dim}_{op}_{what}"


def comm_column(what: str, dim: str) -> str:
    """comm_bytes_tp, comm_wire_bytes_dp, comm_ops_pp: one group's traffic per optimizer step."""
    assert what in COMM_WHAT, what
    return COMM.format(what=what, dim=dim)


def comm_op_column(dim: str, op: str, what: str) -> str:
    """comm_dp_all_reduce_bytes, comm_pp_send_ops: one kind of op in one group."""
    assert what in ("bytes", "ops"), what
    return COMM_OP.format(dim=dim, op=op, what=what)


def comm_columns(what=tuple(COMM_WHAT), dims=COMM_DIMS) -> list[str]:
    return [comm_column(w, d) for w in what for d in dims]


# --- the declaration --------------------------------------------------------------------------------------


def _config_type(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if typing.get_origin(hint) is typing.Literal:  # a choice field: the type of its values
        args = [type(args[0])]
    return {bool: "bool", int: "int", float: "float"}.get(args[0], "str")


def _config_columns() -> list[Column]:
    hints = typing.get_type_hints(RunConfig)  # real types, not annotation strings
    return [Column(f.name, _config_type(hints[f.name]), help_text(f.name), Kind.CONFIG) for f in fields(RunConfig)]


def _measured(name, type_, unit, meaning, ranks, compare=Compare.IGNORED, kind=None, **kw) -> Column:
    kind = kind or (Kind.EXACT if compare == Compare.EXACT else Kind.NOISY)
    return Column(name, type_, meaning, kind, unit, ranks, compare, **kw)


_COMM = [Family(COMM.format(what=what, dim="{dim}"), {"dim": COMM_DIMS},
                _measured("", "float", unit, meaning + " in the {dim} groups", "mean", Compare.EXACT))
         for what, (unit, meaning) in COMM_WHAT.items()]
_COMM_OUTSIDE = [Family(COMM.format(what=what, dim="{group}"), {"group": COMM_GROUPS},
                        _measured("", "float", unit, meaning + " in the {group} group", "mean", Compare.EXACT,
                                  always=False))
                 for what, (unit, meaning) in COMM_WHAT.items()]
_COMM_PER_OP = [Family(COMM_OP.format(dim="{group}", op="{op}", what=what),
                       {"group": COMM_DIMS + COMM_GROUPS, "op": COMM_OPS},
                       _measured("", "float", unit, f"{what} per optimizer step of one op ({', '.join(COMM_OPS)}) in "
                                 f"one group (the breakdown of comm_{what}_*)", "mean", kind=Kind.EXACT, always=False))
                for what, unit in (("bytes", "bytes"), ("ops", "ops"))]
PRED_STATE = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")

# --- predicted time (bench.analysis.time_model): the step's terms, each its own column ---
_PRED_TIME = [
    Column("pred_hardware", "str", "the name of the hardware profile the time is predicted on", Kind.PREDICTED,
           always=False),
    Column("pred_profile", "str", "which profile that is: \"calibrated on HOST at TIME (…)\" (by the sweep itself "
           "or `bench calibrate`), \"built-in NAME\", or \"NAME from FILE\"", Kind.PREDICTED, always=False),
    Column("pred_step_time_s", "float", "predicted step time: the sum of the pred_*_s terms", Kind.PREDICTED, "s",
           always=False),
    Column("pred_tokens_per_s", "float", "predicted global tokens per second", Kind.PREDICTED, "tokens/s",
           always=False),
    Column("pred_mfu", "float", "predicted model FLOPs utilisation", Kind.PREDICTED, "fraction", always=False),
    Column("pred_compute_s", "float", "predicted compute of the busiest pipeline rank: matmuls at the rate their "
           "shape gets, memory-bound work, recomputation", Kind.PREDICTED, "s", always=False),
    Column("pred_overhead_s", "float", "predicted per-op dispatch overhead (ops × calibrated cost)", Kind.PREDICTED,
           "s", always=False),
    Column("pred_comm_exposed_s", "float", "predicted communication not hidden behind compute, all groups",
           Kind.PREDICTED, "s", always=False),
    Family("pred_comm_exposed_{dim}_s", {"dim": COMM_DIMS},
           Column("", "float", "predicted exposed communication of the {dim} groups", Kind.PREDICTED, "s",
                  always=False)),
    Column("pred_bubble_s", "float", "predicted pipeline bubble (idle time of the simulated schedule)",
           Kind.PREDICTED, "s", always=False),
    Column("pred_optimizer_s", "float", "predicted optimizer step", Kind.PREDICTED, "s", always=False),
    Column("pred_step_time_error", "float", "pred_step_time_s / step_time_s − 1 (signed)", Kind.PREDICTED,
           "fraction", always=False),
    Column("pred_step_time_abs_error", "float", "|pred_step_time_s / step_time_s − 1|: how well the time model "
           "predicts this config (noisy: it follows the measurement)", Kind.NOISY, "fraction", "-", Compare.LOWER,
           floor=0.05, always=False),
]

DECLARED: list[Column | Family] = [
    Column("SCHEMA_VERSION", "int", "version of this schema", Kind.IDENTITY),
    Column("run_id", "str", "hash of the run's canonical config: the key for resume and baselines", Kind.IDENTITY),
    Column("config_id", "str", "like run_id but equal for every repeat of a config", Kind.IDENTITY),
    Column("sweep", "str", "sweep name (the sweep file's `name`)", Kind.IDENTITY),
    Column("status", "str", ", ".join(Status), Kind.OUTCOME),
    Column("error", "str", "why the run produced no measurement: the failing rank's traceback tail, the timeout, "
                           "the Slurm state, or (skipped) the reason it cannot run", Kind.OUTCOME),
    Column("failed_rank", "int", "global rank that failed first, when known", Kind.OUTCOME),
    Column("launcher", "str", "local, slurm or debug", Kind.ENVIRONMENT),
    _measured("wall_s", "float", "s", "seconds from launching the run to its row, seen by the sweep "
              "(includes process start-up or Slurm queueing)", "sweep"),
    *_config_columns(),
    Column("global_batch", "int", "sequences per optimizer step (micro_batch × micro_batches × dp)", Kind.CONFIG),
    _measured("params", "float", "", "model parameters", "-", Compare.EXACT),
    _measured("step_time_s", "float", "s", "median timed step (slowest rank per step; warm-up excluded; "
              "CUDA events on GPU, wall clock on CPU)", "slowest", Compare.LOWER),
    _measured("step_time_p10_s", "float", "s", "10th percentile step time", "slowest"),
    _measured("step_time_p90_s", "float", "s", "90th percentile step time", "slowest"),
    _measured("tokens_per_s", "float", "tokens/s", "global tokens per step / median step time", "slowest",
              Compare.HIGHER),
    _measured("tflops_per_device", "float", "TFLOP/s", "model FLOPs (convention in models/config.py) per second "
              "per device", "slowest"),
    _measured("mfu", "float", "fraction", "tflops_per_device over peak_flops", "slowest"),
    Column("peak_flops", "float", "the declared peak FLOP/s of one device (MFU's denominator)", Kind.ENVIRONMENT,
           "FLOP/s", "rank0"),
    _measured("peak_mem_bytes", "float", "bytes", "live tensor bytes a step adds at its peak (CUDA: the "
              "allocator over the timed steps; CPU: torch.profiler's allocation records over one extra step)",
              "max", Compare.LOWER, floor=2.0**20),
    _measured("peak_mem_reserved_bytes", "float", "bytes", "CUDA: the caching allocator's reserved-memory peak "
              "during the timed steps (absolute, not added); None on CPU", "max"),
    _measured("alloc_retries", "float", "", "CUDA: allocator retries (cudaMalloc failed, cache flushed) during the "
              "timed steps; None on CPU", "max"),
    _measured("host_syncs_per_step", "float", "", "operations that made the host wait for the device (.item(), "
              "device→host copies, …) in one train step, counted on an extra untimed step", "max", Compare.EXACT),
    _measured("cuda_syncs_per_step", "float", "", "CUDA: torch's own synchronisation warnings in that step (a "
              "second opinion); None on CPU", "max"),
    _measured("persistent_bytes", "float", "bytes", "local params + grads + optimizer state (shards, not full "
              "tensors)", "max", Compare.EXACT),
    _measured("params_bytes", "float", "bytes", "local parameter bytes", "max", Compare.EXACT),
    _measured("grads_bytes", "float", "bytes", "local gradient bytes", "max", Compare.EXACT),
    _measured("optimizer_bytes", "float", "bytes", "local optimizer-state bytes", "max", Compare.EXACT),
    *_COMM,
    # fp32 losses are deterministic for a config here (same kernels, same reduction order): a change
    # beyond float noise is a change of numerics. Mixed precision (and CUDA atomics) are not gated.
    *[_measured(f"loss_{which}", "float", "", f"global mean loss of the {which} step; exact within 1e-6 "
                "relative on fp32 runs", "replicas", Compare.EXACT, rel_tol=1e-6, exact_dtypes=("fp32",))
      for which in ("first", "last")],
    Column("device_name", "str", "device the run used (cpu or the CUDA device name)", Kind.ENVIRONMENT,
           ranks="rank0"),
    Column("time", "str", "UTC time the row was made (ISO 8601)", Kind.ENVIRONMENT, ranks="rank0"),
    Column("git_sha", "str", "commit of the code that ran", Kind.ENVIRONMENT, ranks="rank0"),
    Column("hostname", "str", "host of rank 0 (or of the sweep process for rows without a measurement)",
           Kind.ENVIRONMENT, ranks="rank0"),
    Column("torch_version", "str", "torch version", Kind.ENVIRONMENT, ranks="rank0"),
    Column("deepspeed_version", "str", "deepspeed version", Kind.ENVIRONMENT, ranks="rank0"),
    Column("submitit_version", "str", "submitit version", Kind.ENVIRONMENT, ranks="rank0"),
    Column("cpu_model", "str", "CPU model of rank 0's host", Kind.ENVIRONMENT, ranks="rank0"),
    Column("device_count", "int", "devices visible to rank 0 (CUDA devices; 0 on CPU)", Kind.ENVIRONMENT,
           ranks="rank0"),
    Column("cuda_version", "str", "CUDA version torch was built with (None on CPU)", Kind.ENVIRONMENT, ranks="rank0"),
    Column("nccl_version", "str", "NCCL version (None on CPU)", Kind.ENVIRONMENT, ranks="rank0"),
    Column("driver_version", "str", "NVIDIA driver version (None on CPU)", Kind.ENVIRONMENT, ranks="rank0"),
    Column("python_version", "str", "Python version", Kind.ENVIRONMENT, ranks="rank0"),
    Column("slurm_job_id", "str", "Slurm job id (array jobs: ARRAYID_INDEX)", Kind.ENVIRONMENT, ranks="rank0"),
    Column("slurm_array_task_id", "str", "index within the Slurm job array", Kind.ENVIRONMENT, ranks="rank0"),
    Column("slurm_attempts", "int", "Slurm: how many times the job started (1 + its requeues: preemption with "
           "`requeue: true`)", Kind.ENVIRONMENT, ranks="rank0", always=False),
    Column("node_per_rank", "str", "node each rank ran on, by global rank (JSON list; SLURMD_NODENAME in a Slurm "
           "task, else the host name)", Kind.ENVIRONMENT, ranks="per-rank", always=False),
    # ok rows only: per-rank lists and the loss curve
    _measured("peak_mem_bytes_per_rank", "str", "bytes", "peak_mem_bytes of each rank (JSON list)", "per-rank",
              always=False),
    _measured("persistent_bytes_per_rank", "str", "bytes", "persistent_bytes of each rank (JSON list)", "per-rank",
              kind=Kind.EXACT, always=False),
    _measured("step_time_s_per_rank", "str", "s", "each rank's median timed step (JSON list); on CPU every timed "
              "step starts at a barrier, so a rank's time excludes waiting for a slower one before the step",
              "per-rank", always=False),
    _measured("step_time_spread", "float", "ratio", "the slowest rank's median step / the median rank's (1: no "
              "straggler; `bench compare` and the report flag one above 1.5, bench/report/compare.py "
              "STRAGGLER_SPREAD)", "per-rank", always=False),
    _measured("slowest_rank", "int", "", "global rank with the longest median step", "per-rank", always=False),
    _measured("losses", "str", "", "global mean loss of every step, warm-up included (JSON list)", "replicas",
              always=False),
    Column("peak_flops_source", "str", "where peak_flops comes from (device table or CPU measurement)",
           Kind.ENVIRONMENT, ranks="rank0", always=False),
    *_COMM_OUTSIDE,
    *_COMM_PER_OP,
    # backend extras (Trainer.extras)
    _measured("bubble_fraction", "float", "fraction", "native pipeline: idle / (busy + idle) on one extra metered step",
              "mean", Compare.LOWER, floor=0.02, always=False),
    _measured("compile_s", "float", "s", "compile: seconds the warm-up steps took beyond the median timed step "
              "(torch.compile of each block; never inside a timed step)", "max", always=False),
    _measured("skipped_steps", "float", "", "fp16-mixed: optimizer steps the dynamic loss scaler skipped (inf/NaN "
              "gradients), warm-up and every extra step included", "max", always=False),
    Column("stage_layers", "str", "native: layers of each pipeline stage, in pipeline order (JSON list)",
           Kind.CONFIG, ranks="rank0", always=False),
    Column("dp_buckets", "float", "native: gradient buckets of the data-parallel all-reduce", Kind.CONFIG,
           ranks="mean", always=False),
    Column("tp_impl", "str", "what implements tensor parallelism", Kind.CONFIG, ranks="rank0", always=False),
    Column("pp_impl", "str", "what implements pipeline parallelism", Kind.CONFIG, ranks="rank0", always=False),
    Column("cp_impl", "str", "what implements context parallelism (its attention over the sequence)", Kind.CONFIG,
           ranks="rank0", always=False),
    Column("dp_impl", "str", "what implements data parallelism", Kind.CONFIG, ranks="rank0", always=False),
    Column("fsdp_replicate", "float", "fsdp: replicas of each shard (HSDP's outer dimension)", Kind.CONFIG,
           ranks="mean", always=False),
    Column("fsdp_shard", "float", "fsdp: ranks one shard group spans", Kind.CONFIG, ranks="mean", always=False),
    Column("ds_config", "str", "deepspeed: the config DeepSpeed ran with (JSON)", Kind.CONFIG, ranks="rank0",
           always=False),
    Column("ds_optimizer", "str", "deepspeed: the optimizer class DeepSpeed chose", Kind.CONFIG, ranks="rank0",
           always=False),
    Column("ds_comms_logger", "str", "deepspeed: the comms logger's record of the last step (JSON), when enabled",
           Kind.ENVIRONMENT, ranks="rank0", always=False),
    # predictions (bench.analysis.estimate.predict_row), beside the measured columns they predict
    *[Column(f"pred_{name}", "float", f"predicted {name} (max over ranks)", Kind.PREDICTED, "bytes",
             compare=Compare.EXACT, always=False) for name in (*PRED_STATE, "total_bytes")],
    Column("pred_peak_mem_bytes", "float", "predicted peak_mem_bytes: the step's activations and transients at its "
           "peak, above the model state (max over ranks)", Kind.PREDICTED, "bytes", compare=Compare.EXACT,
           always=False),
    Column("pred_peak_mem_error", "float", "pred_peak_mem_bytes / peak_mem_bytes − 1 (signed)", Kind.PREDICTED,
           "fraction", always=False),
    Column("pred_bubble_fraction", "float", "predicted pipeline bubble", Kind.PREDICTED, "fraction",
           compare=Compare.EXACT, always=False),
    Column("pred_flops_per_step", "float", "predicted model FLOPs per optimizer step", Kind.PREDICTED, "FLOP",
           compare=Compare.EXACT, always=False),
    *[Family(f"pred_{f.template}", f.values, replace(f.column, kind=Kind.PREDICTED, ranks="-", always=False,
                                                     meaning="predicted " + f.column.meaning))
      for f in _COMM],
    Column("trace_dir", "str", "profiled runs: folder of the extra, untimed profiled step's torch.profiler traces "
           "(trace_rank<r>.json, Chrome/Perfetto) and per-op tables (ops_rank<r>.md)", Kind.ENVIRONMENT, ranks="rank0",
           always=False),
    Column("pred_error", "str", "why the row has no prediction", Kind.PREDICTED, always=False),
    *_PRED_TIME,
]


def _expand(declared) -> dict[str, Column]:
    out = {}
    for item in declared:
        for col in (item.columns() if isinstance(item, Family) else [item]):
            assert col.name not in out, f"column {col.name} declared twice"
            out[col.name] = col
    return out


COLUMNS: dict[str, Column] = _expand(DECLARED)
"""Every declared column by name, in declaration order."""
ALWAYS = tuple(name for name, c in COLUMNS.items() if c.always)
"""The columns of every row: the store adds the missing ones as None."""
EXACT = tuple(name for name, c in COLUMNS.items() if c.compare == Compare.EXACT)
NOISY = {name: c for name, c in COLUMNS.items() if c.compare in (Compare.LOWER, Compare.HIGHER)}


def unit(name: str) -> str:
    col = COLUMNS.get(name)
    return col.unit if col else ""


def label(name: str) -> str:
    """`step_time_s (s)`: a column with its unit, for axes and tables."""
    u = unit(name)
    return f"{name} ({u})" if u and u != "fraction" else name


RUN_FIELDS = {f.name for f in fields(RunConfig)}


def markdown_table() -> str:
    """docs/row-schema.md's table of every column that is not a RunConfig field (those are `bench run --help`)."""
    lines = ["| column | unit | kind | over ranks | compare | meaning |", "|---|---|---|---|---|---|",
             "| every `RunConfig` field, `global_batch` | | config | | ignored | `bench run --help` |"]
    for item in DECLARED:
        col = item.column if isinstance(item, Family) else item
        name = item.pattern if isinstance(item, Family) else item.name
        if col.kind == Kind.CONFIG and (name in RUN_FIELDS or name == "global_batch"):
            continue
        meaning = col.meaning.format(**{k: "/".join(v) for k, v in item.values.items()}) \
            if isinstance(item, Family) else col.meaning
        meaning = meaning.replace("|", "\\|")  # a pipe would end the cell
        lines.append(f"| `{name}` | {col.unit} | {col.kind} | {col.ranks} | {col.compare} | {meaning} |")
    return "\n".join(lines)
