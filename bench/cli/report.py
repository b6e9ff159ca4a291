"""CLI commands over bench.report (registered on the `bench` app in bench/cli/__init__.py): report, compare, history.
Commands parse, call, print; imports of pandas/matplotlib stay inside the functions."""
from __future__ import annotations

import sys

import math

import click

from bench.cli.options import positive_int

COMMANDS: list[click.Command] = []


def _command(func):
    COMMANDS.append(func)
    return func


@_command
@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", "out", type=click.Path(file_okay=False), default="report", show_default=True,
              help="folder for index.html, report.md and figures/")
def report(results, out):
    """Write an HTML + Markdown report of sweep RESULTS (output folders or results.parquet files)."""
    from bench.report.render import build_report
    index = build_report(results, out)
    click.echo(f"report: {index}  (markdown: {index.parent / 'report.md'})")


def _parse_thresholds(items) -> dict[str, float]:
    out = {}
    for item in items:
        if "=" not in item:
            raise click.BadParameter(f"{item!r} must look like METRIC=FRACTION, e.g. step_time_s=0.10 or "
                                     "step_time_s=10%", param_hint="--metric-threshold")
        key, value = item.split("=", 1)
        out[key.strip()] = _fraction(value, "--metric-threshold")
    return out


def _fraction(value: str, hint: str) -> float:
    text = str(value).strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a fraction (0.05) or a percentage (5%)", param_hint=hint) from None
    if not math.isfinite(fraction) or fraction < 0:
        raise click.BadParameter(f"{value!r} must be a finite fraction ≥ 0 (0.05) or percentage (5%)",
                                 param_hint=hint)
    return fraction


@_command
@click.command()
@click.argument("baseline", type=click.Path())
@click.argument("current", type=click.Path())
@click.option("--threshold", default="5%", show_default=True,
              help="how much worse a noisy metric (time, throughput, measured memory) may get: 0.05 or 5%")
@click.option("--metric-threshold", "metric_thresholds", multiple=True, metavar="METRIC=FRACTION",
              help="per-metric threshold, e.g. step_time_s=10% (repeatable)")
@click.option("--exact-only", is_flag=True,
              help="gate on exact metrics only (comm bytes, parameter and state bytes, predictions); timing is "
                   "reported, not gated (what CI uses on shared machines)")
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON")
@click.option("--markdown", "as_markdown", is_flag=True, help="print Markdown (for a CI comment)")
@click.option("--update-baseline", is_flag=True, help="after comparing, write CURRENT as the new BASELINE (exit 0)")
@click.option("--check-predictions", is_flag=True,
              help="also fail when a run's predicted communication (pred_comm_*) differs from its measured "
                   "comm_* (bytes, wire bytes, ops), in CURRENT or in BASELINE")
def compare(baseline, current, threshold, metric_thresholds, exact_only, as_json, as_markdown, update_baseline,
            check_predictions):
    """Compare CURRENT results with BASELINE config by config; exit 1 on a regression.

    Exact metrics must be equal; noisy metrics regress only when worse than the baseline by more than the
    threshold and by more than the spread of the repeats. New and missing configs are listed, not failures."""
    from pathlib import Path

    from bench.report import baseline as bl
    from bench.report import compare_format as fmt
    from bench.report.compare import compare as run_compare
    from bench.report.load import load_many

    thresholds, default_threshold = _parse_thresholds(metric_thresholds), _fraction(threshold, "--threshold")
    cur = load_many([current])
    if update_baseline and not Path(baseline).exists():
        bl.write_baseline(cur, baseline)
        click.echo(f"baseline written: {baseline} ({len(cur)} runs, machine kind {bl.machine_kind(cur)})")
        return
    base, meta = bl.load_baseline(baseline)
    notes, gate_timing = [], not exact_only
    if meta and meta.get("machine_kind") != bl.machine_kind(cur):
        notes.append(f"the baseline was measured on '{meta.get('machine_kind')}', these results on "
                     f"'{bl.machine_kind(cur)}': timing and measured memory are reported, not gated")
        gate_timing = False
    result = run_compare(base, cur, thresholds=thresholds, default_threshold=default_threshold,
                         exact_only=not gate_timing)
    result.exact_only = exact_only or not gate_timing
    result.notes.extend(notes)
    if as_json:
        click.echo(fmt.to_json(result))
    elif as_markdown:
        click.echo(fmt.to_markdown(result))
    else:
        fmt.print_terminal(result)
    if update_baseline:
        bl.write_baseline(cur, baseline)
        click.echo(f"baseline updated: {baseline} ({len(cur)} runs)", err=True)
        return
    wrong = _prediction_check(base, cur) if check_predictions else []
    sys.exit(1 if result.regressed or wrong else 0)


def _prediction_check(base, cur) -> list[str]:
    from bench.report.compare import prediction_mismatches
    wrong = [f"baseline: {w}" for w in prediction_mismatches(base)] + \
        [f"current: {w}" for w in prediction_mismatches(cur)]
    for line in wrong:
        click.echo(f"prediction ≠ measurement: {line}", err=True)
    if not wrong:
        click.echo("predicted communication = measured in every run (baseline and current)", err=True)
    return wrong


@click.group()
def history():
    """Record result sets over time and look for step changes."""


@history.command("add")
@click.argument("results", nargs=-1, required=True, type=click.Path())
@click.option("--history", "path", type=click.Path(dir_okay=False), default="results/history.parquet",
              show_default=True)
def history_add(results, path):
    """Append RESULTS' rows (with the git sha and time) to the history."""
    from bench.report import history as h
    from bench.report.load import load_many
    added, total = h.add(load_many(results), path)
    click.echo(f"history: {added} row(s) added, {total} in {path}")


@history.command("show")
@click.option("--config", "config", default=None, help="run_id or config_id (a prefix is enough)")
@click.option("--metric", default="tokens_per_s", show_default=True, help="column to plot over time")
@click.option("--where", "where", multiple=True, metavar="COLUMN=VALUE", help="filter rows, e.g. backend=native")
@click.option("--threshold", default="10%", show_default=True, help="relative level shift that flags a step change")
@click.option("--window", type=positive_int(1000), default=3, show_default=True,
              help="points on each side of a step change")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None,
              help="figure path (default: results/history-<config>-<metric>.png)")
@click.option("--history", "path", type=click.Path(dir_okay=False), default="results/history.parquet",
              show_default=True)
def history_show(config, metric, where, threshold, window, out, path):
    """Plot METRIC of one config over time and flag step changes; without --config, list the configs."""
    from pathlib import Path

    from bench.report import history as h
    from bench.report.labels import add_labels
    bad = [w for w in where if "=" not in w]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} must look like COLUMN=VALUE", param_hint="--where")
    filters, shift = dict(w.split("=", 1) for w in where), _fraction(threshold, "--threshold")
    df = h.read(path)
    rows = h.select(df, config, filters)
    if not config and not filters:
        listing = add_labels(rows).groupby("config_id").agg(
            label=("label", "first"), points=("time", "nunique"))
        for cid, r in listing.iterrows():
            click.echo(f"{cid}  {r['label']}  ({r['points']} point(s))")
        return
    if rows["config_id"].nunique() > 1:
        click.echo(f"note: {rows['config_id'].nunique()} configs match; their runs are pooled per time", err=True)
    points = h.series(rows, metric)
    if points.empty:
        raise click.ClickException(f"no successful runs with {metric} for that selection")
    flagged = h.step_changes(points["value"].tolist(), window=window, threshold=shift)
    label = add_labels(rows.head(1))["label"].iloc[0]
    name = (config or "selection").replace("/", "_")
    figure = h.plot(points, flagged, metric, f"{label}: {metric}",
                    Path(out) if out else Path(path).parent / f"history-{name}-{metric}.png")
    for i, p in points.iterrows():
        mark = "  ← step change" if i in flagged else ""
        click.echo(f"{p['when']:%Y-%m-%d %H:%M}  {p['git_sha'] or '-':>12}  {p['value']:.6g}  ({p['runs']} run(s)){mark}")
    click.echo(f"{len(flagged)} step change(s); figure: {figure}")


COMMANDS.append(history)
