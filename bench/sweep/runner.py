"""Running a sweep: expansion → launcher → results store, with live progress and a summary table.

Every row reaches the store the moment it is known (skipped rows before anything launches), so a
sweep killed at any moment keeps what finished; `resume` skips runs whose row is ok, `retry_failed`
also reruns the failed, oom, timeout and cancelled ones.
"""
from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.config import ConfigError, RunConfig
from bench.layout import named_dims
from bench.results import PROBLEMS, Status, interrupted, skipped_row
from bench.sweep.launcher import Launcher
from bench.sweep.spec import Expansion, SweepError, SweepSpec, describe, expand
from bench.results.store import ResultStore


def make_launcher(spec: SweepSpec, out: Path, kind: str | None = None, profile: str | None = None,
                  exclusive: bool = False, max_parallel: int | None = None, hardware=None) -> Launcher:
    """`hardware`: the profile the local and debug launchers' rows are predicted on (`--hardware`)."""
    kind = kind or spec.launcher.kind
    if kind in ("local", "debug"):
        from bench.sweep.local import DebugLauncher, LocalLauncher
        traces = out / "runs"  # a profiled run's traces: OUT/runs/<run_id>/ beside its row OUT/runs/<run_id>.json
        return (LocalLauncher(log=out / "ranks.log", repeat_order=spec.repeat_order, traces=traces, hardware=hardware)
                if kind == "local" else DebugLauncher(traces=traces, hardware=hardware))
    if hardware is not None:
        raise ValueError("--hardware applies to the local and debug launchers: a Slurm task predicts its row on "
                         "its own host's profile (name one for pruning with `prune: {hardware: NAME}`)")
    from bench.sweep.slurm import SlurmLauncher, load_profile
    options = spec.launcher.options if spec.launcher.kind == "slurm" else {}
    prof = load_profile(profile or spec.launcher.profile or "local", options, source=spec.source,
                        from_cli=profile is not None)
    if exclusive:
        prof = replace(prof, exclusive=True)
    if max_parallel:
        prof = replace(prof, max_parallel=max_parallel)
    return SlurmLauncher(prof, ResultStore(out, sweep_columns(spec, SlurmLauncher.kind)), spec.name)


def sweep_columns(spec: SweepSpec, launcher: str) -> dict:
    """The columns a sweep adds to each of its rows: the store that writes the row adds them."""
    return {"sweep": spec.name, "launcher": launcher}


@dataclass
class SweepOutcome:
    out: Path
    counts: dict[str, int]
    wall_s: float
    rows: list[dict] = field(default_factory=list)
    """The rows written by this invocation."""
    resumed: int = 0
    """Runs not launched because a previous invocation stored them."""


def plan(spec: SweepSpec, launch: Launcher, predict: bool = False, calibrate: bool = False) -> Expansion:
    """Expand the sweep; runs the launcher cannot place become skipped rows too, and so do the runs the
    file's `prune:` rules out (every run is then predicted; `predict` predicts them for a dry run without
    rules). `calibrate`: a pruned sweep measures this machine first when its runs need a profile it has
    not (`calibrate_here`); any other sweep does so in `run_sweep`, after its checks. Raises SweepError
    when nothing at all can run (an impossible layout, say): that is a mistake in the file, not a result."""
    exp = expand(spec)
    if launch.kind == "local":
        _check_local_size(spec, exp)
    runnable = []
    for cfg in exp.runs:
        reason = launch.unsupported(cfg)
        if reason:
            exp.skipped.append(skipped_row(cfg, reason))
        else:
            runnable.append(cfg)
    exp.runs = runnable
    if not exp.runs and exp.skipped:
        first = exp.skipped[0]
        raise SweepError(spec.source, "grid", f"no runnable combination: all {len(exp.skipped)} expanded run(s) "
                                              f"are invalid, e.g. {describe(first)}: {first['error']}")
    if calibrate and spec.prune:
        exp.profile_note = calibrate_here(exp.runs, launch.kind, getattr(launch, "pool", None)) or ""
    if spec.prune or predict:
        from bench.sweep.prune import prune
        exp.warnings += prune(spec, exp, launch)
    return exp


def calibrate_here(runs: list[RunConfig], launcher: str, pool_of=None) -> str | None:
    """Before runs that land on this CPU machine (the local and debug launchers, no GPU here): make sure a
    profile measured here covers their world sizes (bench.calibrate.for_this_machine: cached, or the quick
    calibration now, on `pool_of(world)`'s warm ranks when given: the local launcher's own). Returns the line to print, None when nothing applies (Slurm tasks run elsewhere; a
    GPU's runs are predicted on its datasheet profile)."""
    from bench import device as bench_device
    worlds = tuple(sorted({c.world for c in runs if c.device in ("cpu", "auto")}))
    if launcher not in ("local", "debug") or not worlds or bench_device.accelerator() is not None:
        return None
    from bench.calibrate import for_this_machine
    return for_this_machine(worlds, pool_of)[1]


def local_rank_limit() -> int:
    """Most ranks the local launcher starts at once on this machine: 4 per CPU core, at least 8 (beyond,
    the processes alone exhaust it); PARABENCH_MAX_LOCAL_RANKS sets another limit."""
    import os
    env = os.environ.get("PARABENCH_MAX_LOCAL_RANKS")
    if env is None:
        return max(8, 4 * (os.cpu_count() or 1))
    if not env.strip().isdigit() or int(env) < 1:  # refused, not replaced by the default
        raise ConfigError(f"PARABENCH_MAX_LOCAL_RANKS must be a positive integer, got {env!r}")
    return int(env)


def local_size_reason(world: int, device: str = "cpu") -> str | None:
    """Why the local launcher cannot start `world` ranks on `device` here (None: it can). On a GPU, one
    rank per GPU: two ranks on one GPU would fail NCCL's start-up ("Duplicate GPU detected")."""
    from bench import device as bench_device
    accel = bench_device.accelerator() if device != "cpu" else None
    if device == "cuda" and accel is None:
        return "device cuda: no CUDA device is visible here; use device cpu (or auto)"
    if accel is not None and world > accel.device_count():
        return (f"world size {world} (tp × pp × dp) is more ranks than the {accel.device_count()} GPU(s) here "
                "(the local launcher runs one rank per GPU); use a smaller layout or the slurm launcher")
    limit = local_rank_limit()
    if world <= limit:
        return None
    return (f"world size {world} (tp × pp × dp) is more ranks than the local launcher starts on this machine "
            f"(at most {limit}: 4 per CPU core, or PARABENCH_MAX_LOCAL_RANKS); use the slurm launcher")


def _check_local_size(spec: SweepSpec, exp: Expansion) -> None:
    """Refuse the sweep before anything starts: such a run is a typo, not a result."""
    world, device = max(((c.world, c.device) for c in exp.runs), default=(0, "cpu"))
    reason = local_size_reason(world, device)
    if reason:
        key = "world_size" if spec.world_sizes and world in spec.world_sizes else "grid"
        raise SweepError(spec.source, key, reason)


@dataclass
class PreparedSweep:
    """A sweep decided before anything starts: its file, output folder, launcher and expansion (every run,
    every skipped row, the predictions of a pruned or dry run). `bench sweep` shows or runs this one
    object, so a sweep is expanded once."""

    spec: SweepSpec
    out: Path
    launch: Launcher
    exp: Expansion
    calibrate: bool = False
    """Measure this machine before launching when its runs need a profile it has not (`calibrate_here`)."""


def prepare(spec: SweepSpec, out: str | Path, launcher: str | None = None, profile: str | None = None,
            exclusive: bool = False, max_parallel: int | None = None, predict: bool = False,
            calibrate: bool = False, hardware=None) -> PreparedSweep:
    """Choose the launcher and expand the sweep (`plan`): every error of the inputs is raised here.
    `hardware`: predict every run on this profile (then nothing is calibrated)."""
    out = Path(out)
    launch = make_launcher(spec, out, launcher, profile, exclusive, max_parallel, hardware)
    calibrate = calibrate and hardware is None
    return PreparedSweep(spec, out, launch, plan(spec, launch, predict, calibrate), calibrate)


def run_sweep(sweep: PreparedSweep, resume: bool = False, retry_failed: bool = False,
              progress: bool = True) -> SweepOutcome:
    t_start = time.monotonic()
    spec, out, launch, exp = sweep.spec, sweep.out, sweep.launch, sweep.exp
    check_profile(exp.runs, launch, out)
    store = ResultStore(out, sweep_columns(spec, launch.kind))
    held = store.files()
    if held and not (resume or retry_failed):
        raise ValueError(f"{out} already holds {len(held)} run row(s); add --resume to skip the finished runs "
                         "(--retry-failed to rerun the failed ones too), or choose another --out")
    launch.check_ready(exp.runs)
    for line in store.set_aside():  # a corrupt row is no result: its run is launched again
        print(f"warning: {line}", file=sys.stderr)
    stored = {row["run_id"]: row for row in store.rows()}
    out.mkdir(parents=True, exist_ok=True)
    source = Path(spec.source)
    if source.is_file() and source.resolve() != (out / "sweep.yaml").resolve():
        shutil.copyfile(source, out / "sweep.yaml")
    outcome = SweepOutcome(out=out, counts={s: 0 for s in Status}, wall_s=0.0)

    def record(row: dict, written: bool = False) -> None:
        """Store a row once: `written` when its launcher already stored it (a Slurm task writes its own)."""
        row = row if written else store.write(row)
        outcome.rows.append(row)
        outcome.counts[row["status"]] += 1

    todo = to_launch(exp.runs, stored, retry_failed)
    outcome.resumed += len(exp.runs) - len(todo)
    for row in exp.skipped:
        if row["run_id"] in exp.pruned and stored.get(row["run_id"], {}).get("status") not in (None, Status.SKIPPED):
            outcome.resumed += 1  # a stored outcome outranks a prediction: keep it
            continue
        record(row)
    note = exp.profile_note if exp.profile_note is not None else (
        calibrate_here(todo, launch.kind, getattr(launch, "pool", None)) if sweep.calibrate else None)
    if note:
        print(note, file=sys.stderr)
    bar = SweepProgress(len(todo), outcome.counts, enabled=progress)
    if outcome.resumed:
        bar.log(f"resume: {outcome.resumed} run(s) already stored in {out}/runs, not launched")

    def finished(cfg: RunConfig, row: dict, written: bool = False) -> None:
        record(row, written)
        bar.finished(cfg, row)

    try:
        with bar:
            launch.launch(todo, bar.started, finished)
    finally:
        launch.close()
    store.write_parquet()
    outcome.wall_s = time.monotonic() - t_start
    return outcome


def to_launch(runs: list[RunConfig], stored: dict[str, dict], retry_failed: bool = False) -> list[RunConfig]:
    """The runs a sweep launches, given the rows `stored` by run_id: those without a row, a skipped one
    (pruned, or unplaceable then), or one the scheduler interrupted (`interrupted`); with `retry_failed`
    every row but an ok one too."""
    def done(row: dict | None) -> bool:
        if row is None or row["status"] == Status.SKIPPED or interrupted(row):
            return False
        return row["status"] == Status.OK or not retry_failed
    return [cfg for cfg in runs if not done(stored.get(cfg.run_id))]


def check_profile(runs: list[RunConfig], launch: Launcher, out: Path) -> None:
    """Refuse, before anything starts, a profiled run whose traces could not be written beside its row."""
    if not any(cfg.profile for cfg in runs):
        return
    if launch.kind not in ("local", "debug"):
        raise ValueError(f"profile: the {launch.kind} launcher's tasks may run on hosts without this file system; "
                         "profile with --launcher local or debug")
    from bench.metrics.profile import check_writable
    check_writable(out / "runs")


class SweepProgress:
    """A live bar (done / running / failed / skipped, ETA) on stderr and one log line per finished run."""

    def __init__(self, total: int, counts: dict, enabled: bool = True):
        from rich.console import Console
        self.total, self.counts, self.enabled, self.running = total, counts, enabled, 0
        self.console = Console(stderr=True, highlight=False)
        self.done = 0
        self._progress = None

    def __enter__(self):
        if self.enabled and self.total:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self._progress = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.description}"), TimeElapsedColumn(), TextColumn("ETA"),
                                      TimeRemainingColumn(), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self._text(), total=self.total)
        return self

    def __exit__(self, *exc):
        if self._progress:
            self._progress.stop()

    def _text(self) -> str:
        c = self.counts
        bad = sum(c[s] for s in PROBLEMS)
        return f"ok {c[Status.OK]} · running {self.running} · failed {bad} · skipped {c[Status.SKIPPED]}"

    def log(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, soft_wrap=True)

    def started(self, cfg: RunConfig) -> None:
        self.running += 1
        self._refresh()

    def finished(self, cfg: RunConfig, row: dict) -> None:
        self.running = max(0, self.running - 1)
        self.done += 1
        status = row["status"]
        colour = {Status.OK: "green", Status.SKIPPED: "yellow"}.get(status, "red")
        from rich.markup import escape
        note = "" if status == Status.OK else "  " + escape(first_clause(row.get("error")))
        wall = row.get("wall_s")
        self.log(f"[{self.done}/{self.total}] [{colour}]{status:9}[/] {describe(cfg)}"
                 + (f"  ({wall:.1f} s)" if wall is not None else "") + note)
        self._refresh(advance=1)

    def _refresh(self, advance: int = 0) -> None:
        if self._progress:
            self._progress.update(self._task, advance=advance, description=self._text())


def first_clause(text, width: int = 80) -> str:
    """A row's reason as the terminal shows it, on one line: the line that says it (a failing rank's
    traceback: its last), up to its first `;` (what is wrong; the fix follows), at most `width` characters.
    The whole text stays in the row and the report."""
    if not text:
        return ""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[-1] if lines and lines[0].startswith("rank ") and len(lines) > 1 else (lines[0] if lines else "")
    clause = line.split(";", 1)[0].strip()
    return clause if len(clause) <= width else clause[:width - 1] + "…"


# --- tables -----------------------------------------------------------------------------------------------

def _always(rows: list[dict]) -> list[str]:
    """The columns every table shows: backend, world size and the layout (cp and ep where a row uses them)."""
    largest = {dim: max((r.get(dim) or 1 for r in rows), default=1) for dim in ("cp", "ep")}
    return ["backend", "world_size", *named_dims(largest["cp"], largest["ep"])]


def _varying(rows: list[dict]) -> list[str]:
    """Config columns worth showing: the layout, plus any field that differs between rows."""
    from dataclasses import fields as dc_fields
    always = _always(rows)
    names = [f.name for f in dc_fields(RunConfig) if f.name not in always and f.name not in ("timeout_s",)]
    return always + [n for n in names if len({str(r.get(n)) for r in rows}) > 1]


def dry_run_table(spec: SweepSpec, exp: Expansion, launch: Launcher | None = None):
    from rich.markup import escape
    from rich.table import Table
    rows = [{**c.to_row(), "status": "planned", "error": ""} for c in exp.runs] + exp.skipped
    columns = _varying(rows)
    table = Table(title=f"sweep {spec.name} ({spec.source})", show_lines=False)
    for name in ("#", "run_id", *columns, "status", *PREDICTED, "reason"):
        table.add_column(name, overflow="fold", max_width=70 if name == "reason" else None,
                         justify="right" if name in PREDICTED else "left")
    for i, row in enumerate(rows, 1):
        status = "[green]planned[/]" if row["status"] == "planned" else "[yellow]skipped[/]"
        table.add_row(str(i), row["run_id"], *(_cell(row.get(c)) for c in columns), status,
                      *_predicted(exp.predictions.get(row["run_id"])), escape(row.get("error") or ""))
    worlds = sorted({c.world for c in exp.runs})
    kind = launch.kind if launch is not None else spec.launcher.kind
    counts = (f"{len(exp.runs)} run(s) to launch, {len(exp.skipped)} skipped ({len(exp.pruned)} pruned), "
              f"{exp.excluded} excluded, {exp.duplicates} duplicate(s); world sizes {worlds or '-'}; launcher {kind}")
    profiles = sorted({p.profile for p in exp.predictions.values() if p.profile})
    if profiles:
        counts += f"; predicted on {', '.join(profiles)}"
    if kind == "slurm":
        p = launch.profile
        shapes = sorted({p.shape(c) for c in exp.runs})
        counts += (f" (profile {p.name}: " + ", ".join(f"{n} node(s) × {t} task(s)" for n, t in shapes)
                   + f"; one job per run, arrays of ≤ {p.max_parallel} at once"
                   + (", --exclusive" if p.exclusive else "") + ")")
    return table, counts


PREDICTED = ("pred ms/step", "pred tokens/s", "pred peak MiB")


def _predicted(p) -> tuple[str, str, str]:
    """A run's predicted step time, tokens/s and largest rank's peak memory (bench/sweep/prune.py)."""
    if p is None:
        return ("-",) * 3
    return (f"{p.step_time_s * 1e3:.3g}" if p.step_time_s else "-",
            f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-",
            f"{p.peak_bytes / 2**20:,.1f}" if p.peak_bytes is not None else "-")


def summary_table(rows: list[dict], title: str, width: int = 140):
    """One line per run: every column as wide as its widest cell, the note (a reason's first clause) what is
    left of `width`, but no less than 60 characters (ending in … where its clause is longer); print it at
    its own width (`table.width`)."""
    from rich.markup import escape
    from rich.table import Table
    columns = _varying(rows)
    order = {s: i for i, s in enumerate(Status)}
    cells = []
    for row in sorted(rows, key=lambda r: (order.get(r["status"], 9), str(r.get("backend")), r.get("world_size") or 0,
                                           str(r.get("tp")), str(r.get("cp")), str(r.get("pp")))):
        ok = row["status"] == Status.OK
        cells.append([*(_cell(row.get(c)) for c in columns), row["status"],
                      f"{row['step_time_s'] * 1e3:.1f}" if ok else "",
                      f"{row['tokens_per_s']:.0f}" if ok else "",
                      f"{row['mfu']:.2%}" if ok else "",
                      f"{row['peak_mem_bytes'] / 2**20:.1f}" if ok else "",
                      "" if ok else escape(first_clause(row.get("error")))])
    names = (*columns, "status", "step ms", "tokens/s", "MFU", "peak MiB", "note")
    widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, name in enumerate(names)]
    widths[-1] = min(widths[-1], max(60, width - sum(widths[:-1]) - 3 * len(names) - 1))  # padding, border: 3
    table = Table(title=title, width=sum(widths) + 3 * len(names) + 1)
    for name, w in zip(names, widths):
        table.add_column(name, no_wrap=True, overflow="ellipsis", width=w)
    for c in cells:
        colour = {Status.OK: "green", Status.SKIPPED: "yellow"}.get(c[len(columns)], "red")
        c[len(columns)] = f"[{colour}]{c[len(columns)]}[/]"
        table.add_row(*c)
    return table


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    from rich.markup import escape
    return escape(str(value))


def print_counts(counts: dict) -> str:
    """'ok 3 · failed 1 · …' over every status."""
    return " · ".join(f"{s} {counts.get(s, 0)}" for s in Status)


def launch_overhead(df):
    """Per launcher and world size, what launching a run costs: the wall time of its runs as the sweep
    process saw it (launch → row). Use trivial runs (sweeps/overhead.yaml: one step of the tiny model),
    whose own work is the `work_s` column (warmup + steps + the counted step at the median step time).
    `cold` is the first run of a world size in the sweep (a local pool starting: interpreter + imports),
    `warm` the median of the later ones (a warm pool: new port and process groups only). Every Slurm
    run is a fresh job and its wall time counts from the array's submission, so it includes waiting for
    earlier runs of the array: `sacct -o JobID,Submit,Start,End` gives each job's own start-up time."""
    import pandas as pd
    ok = df[df.status == Status.OK].sort_values("time")
    rows = []
    for (launcher, world), group in ok.groupby(["launcher", "world_size"], sort=True):
        walls = group.wall_s.astype(float)
        rows.append({"launcher": launcher, "world_size": int(world), "runs": len(group),
                     "cold_s": round(float(walls.iloc[0]), 2),
                     "warm_s": round(float(walls.iloc[1:].median()), 2) if len(group) > 1 and launcher != "slurm"
                     else None,
                     "median_s": round(float(walls.median()), 2),
                     "work_s": round(float(((group.warmup + group.steps + 1) * group.step_time_s).median()), 3)})
    return pd.DataFrame(rows)
