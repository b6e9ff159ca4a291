"""CLI commands over bench.sweep (registered on the `bench` app in bench/cli/__init__.py): sweep, results."""
from pathlib import Path

import click

from bench.cli.ecosystem import spec_from_source, from_options

COMMANDS: list[click.Command] = []


@click.command("sweep")
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--dry-run", is_flag=True, help="print the expanded runs with their predicted step time, tokens/s and "
                                              "peak memory (and skipped or pruned ones, with the reason); launch nothing")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="output folder (default results/<name>/)")
@click.option("--resume", is_flag=True, help="skip runs already stored in OUT; run the missing ones and those Slurm "
                                             "interrupted (a cancelled or timed-out Slurm job)")
@click.option("--retry-failed", is_flag=True, help="like --resume, but rerun stored failed/oom/timeout/cancelled runs")
@click.option("--launcher", type=click.Choice(["local", "slurm", "debug"]), default=None,
              help="override the sweep file's launcher")
@click.option("--profile", default=None, help="Slurm profile (slurm/profiles/NAME.yaml) for --launcher slurm")
@click.option("--exclusive", is_flag=True, help="Slurm: whole nodes per job (--exclusive), for timed runs")
@click.option("--max-parallel", type=click.IntRange(min=1), default=None,
              help="Slurm: at most N runs of a job array at once (overrides the profile)")
@click.option("--no-progress", is_flag=True, help="no live progress bar or per-run log lines")
@click.option("--no-report", is_flag=True, help="skip the report even if the sweep file asks for one")
@click.option("--fail-on-failure", is_flag=True,
              help="exit 1 when OUT holds a failed, oom, timeout or cancelled row (default: exit 0, they are results)")
@click.option("--no-calibrate", is_flag=True,
              help="do not measure this machine first: predict on a profile measured here before, else the built-in")
@click.option("--hardware", default=None, help="predict every run on this profile (name or YAML file; local and "
                                               "debug launchers); nothing is calibrated")
@from_options
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="with --from: the GPUs of the run")
def sweep(file, dry_run, out, resume, retry_failed, launcher, profile, exclusive, max_parallel, no_progress,
          no_report, fail_on_failure, no_calibrate, hardware, source, model_config, approximate, blocks, world_size):
    """Run every configuration of a sweep FILE; one row per run in OUT/runs/, all rows in OUT/results.parquet.

    A failing run never stops the sweep: it is recorded as failed, oom, timeout or cancelled, and the sweep
    exits 0 (1 with --fail-on-failure); a mistake in the inputs exits 2 before anything launches."""
    from rich.console import Console

    from bench.sweep.runner import dry_run_table, prepare, print_counts, run_sweep, summary_table
    from bench.sweep.spec import load_sweep
    if bool(file) == bool(source):
        raise click.UsageError("give a sweep FILE or --from a framework's config (not both)")
    spec = spec_from_source(source, world_size, model_config, approximate, blocks) if source else load_sweep(file)
    if profile and (launcher or spec.launcher.kind) != "slurm":
        raise click.UsageError("--profile applies to the slurm launcher; add --launcher slurm")
    out = Path(out or Path("results") / spec.name)
    from bench.analysis.hardware import get_hardware
    prepared = prepare(spec, out, launcher, profile, exclusive, max_parallel, predict=dry_run,
                       calibrate=not (no_calibrate or dry_run), hardware=hardware and get_hardware(hardware))  # every error first
    from bench.sweep.prune import warn
    warn(prepared.exp.warnings)
    console = Console(highlight=False, width=max(Console().width, 140))
    if dry_run:
        table, counts = dry_run_table(spec, prepared.exp, prepared.launch)
        console.print(table)
        console.print(counts)
        return
    result = run_sweep(prepared, resume=resume or retry_failed, retry_failed=retry_failed, progress=not no_progress)
    from bench.results.store import load_results
    df = load_results(out)
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    table = summary_table(rows, f"sweep {spec.name}: {len(rows)} row(s) in {out}", console.width)
    console.width = max(console.width, table.width)  # one line per run, wider than the terminal if need be
    console.print(table)
    console.print(f"this invocation: {print_counts(result.counts)}"
                  + (f" · {result.resumed} resumed" if result.resumed else "")
                  + f"   wall {result.wall_s:.1f} s   → {out}/results.parquet")
    if spec.report and not no_report:
        _write_report(out, console)
    if fail_on_failure:
        from bench.results import PROBLEMS
        failures = sum(row["status"] in PROBLEMS for row in rows)
        if failures:
            console.print(f"[red]{failures} run(s) in {out} failed, ran out of memory, timed out or were cancelled[/]")
            raise SystemExit(1)


def _write_report(out: Path, console) -> None:
    """The sweep file asked for a report: write it; a report problem never fails the finished sweep."""
    try:
        from bench.report.render import build_report
        index = build_report([str(out)], out / "report")
        console.print(f"report: {index}")
    except Exception as e:  # noqa: BLE001 - the rows are safe on disk; say what went wrong and go on
        console.print(f"[yellow]report not written[/]: {type(e).__name__}: {e} (rows are in {out})")


@click.command("results")
@click.argument("path", type=click.Path(exists=True))
@click.option("--quiet", is_flag=True, help="no table, only the counts")
@click.option("--overhead", is_flag=True, help="also print the launch overhead per launcher and world size")
def results(path, quiet, overhead):
    """Load a sweep's rows (folder or parquet), check the schema, write OUT/results.parquet, print a summary."""
    from rich.console import Console

    from bench.sweep.runner import print_counts, summary_table
    from bench.results import Status
    from bench.results.store import ResultStore, load_results
    path = Path(path)
    df = ResultStore(path).write_parquet() if path.is_dir() and (path / "runs").is_dir() else load_results(path)
    console = Console(highlight=False, width=max(Console().width, 140))
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    if not quiet:
        table = summary_table(rows, f"{path}: {len(rows)} row(s)", console.width)
        console.width = max(console.width, table.width)
        console.print(table)
    if overhead:
        from bench.sweep.runner import launch_overhead
        console.print("launch overhead: wall time per run, launch → row (s); work_s = the run's own steps")
        console.print(launch_overhead(df).to_string(index=False))
    counts = {s: int((df["status"] == s).sum()) for s in Status}
    console.print(print_counts(counts) + (f"   → {path / 'results.parquet'}" if path.is_dir() else ""))


COMMANDS += [sweep, results]
