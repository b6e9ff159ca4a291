"""Comparison → terminal table (rich), Markdown for a CI comment, JSON."""
from __future__ import annotations

import json
import math

from bench.report.compare import Comparison
from bench.report.render import markdown_table
from bench.results import unit

COLOURS = {"regressed": "bold red", "changed": "bold red", "straggler": "bold red", "missing": "bold red", "failed": "bold red", "improved": "green",
           "fixed": "green", "ok": "", "equal": "dim", "no data": "yellow", "skipped": "yellow"}


def fmt_value(metric: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, str):
        return value
    kind = unit(metric)  # as declared with the column
    if kind == "bytes":
        return f"{value / 2**20:.3f} MiB" if abs(value) >= 2**16 else f"{value:,.0f} B"
    if kind == "tokens/s":
        return f"{value:,.0f} tok/s"
    if kind == "s":
        return f"{value * 1e3:.2f} ms"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.4g}"


def fmt_spread(metric: str, value, spread) -> str:
    """The median, and [min–max] over the repeats when there are several."""
    text = fmt_value(metric, value)
    if not spread:
        return text
    lo, hi = (fmt_value(metric, v).split(" ")[0] for v in spread)  # the unit once, after the median
    return f"{text} [{lo}–{hi}]"


def fmt_change(row: dict) -> str:
    change = row.get("change")
    if change is None or (isinstance(change, float) and math.isnan(change)):
        return ""
    return "±∞" if math.isinf(change) else f"{change:+.1%}"


def fmt_verdict(row: dict) -> str:
    """The verdict; a straggler's names its rank."""
    return row["verdict"] + (f" ({row['error']})" if row["verdict"] == "straggler" and row.get("error") else "")


def fmt_noise(row: dict) -> str:
    """How much worse the metric may get: the threshold, or the repeats' noise when that is larger."""
    if row["kind"] != "noisy":
        return ""
    limit = fmt_value(row["metric"], row["limit"])
    return limit + (" (noise)" if row["noise"] and row["noise"] >= row["limit"] else "")


def shown_rows(comparison: Comparison) -> list[dict]:
    """Noisy metrics always (they are the timing report); exact metrics only when they differ."""
    return [r for r in comparison.rows if r["kind"] != "exact" or r["verdict"] != "equal"]


def headline(comparison: Comparison) -> str:
    exact = [r for r in comparison.rows if r["kind"] == "exact"]
    equal = sum(r["verdict"] == "equal" for r in exact)
    configs = len({r["config_id"] for r in comparison.rows})
    verdict = (f"REGRESSION: {len(comparison.failures)} failing check(s)" if comparison.regressed
               else "no regression")
    mode = " (exact metrics gated; timing reported only)" if comparison.exact_only else ""
    return (f"{verdict}{mode} · {configs} config(s) compared · {equal}/{len(exact)} exact metrics equal · "
            f"{len(comparison.new)} new · {len(comparison.missing)} missing")


def print_terminal(comparison: Comparison) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(150, Console().width), highlight=False)
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {note}")
    table = Table(title="bench compare", show_lines=False, header_style="bold")
    for col in ("config", "metric", "baseline [min–max]", "current [min–max]", "change", "allowed", "verdict"):
        table.add_column(col, no_wrap=True)
    for r in shown_rows(comparison):
        verdict = fmt_verdict(r) + ("" if r["gated"] or r["verdict"] in ("ok", "equal") else " (not gated)")
        table.add_row(r["label"], r["metric"], fmt_spread(r["metric"], r["base"], r.get("base_range")),
                      fmt_spread(r["metric"], r["current"], r.get("current_range")), fmt_change(r), fmt_noise(r),
                      f"[{COLOURS.get(r['verdict'], '')}]{verdict}[/]" if COLOURS.get(r["verdict"]) else verdict)
    if table.row_count:
        console.print(table)
    for title, configs in (("new configs (not in the baseline)", comparison.new),
                           ("missing configs (in the baseline only)", comparison.missing)):
        if configs:
            console.print(f"[bold]{title}:[/] " + "; ".join(f"{c['label']} [{c['run_id']}]" for c in configs))
    style = "bold red" if comparison.regressed else "bold green"
    console.print(f"[{style}]{headline(comparison)}[/]")


def to_markdown(comparison: Comparison) -> str:
    icon = "❌" if comparison.regressed else "✅"
    lines = [f"### {icon} bench compare: {headline(comparison)}"]
    lines += ["", *(f"> {note}" for note in comparison.notes)] if comparison.notes else []
    failing = comparison.failures
    if failing:
        lines += ["", "**Failing checks**", "", _md(failing)]
    timing = [r for r in comparison.rows if r["kind"] == "noisy"]
    if timing:
        lines += ["", "<details><summary>Timing and measured memory</summary>", "", _md(timing), "", "</details>"]
    for title, configs in (("New configs", comparison.new), ("Missing configs", comparison.missing)):
        if configs:
            lines += ["", f"**{title}:** " + ", ".join(f"`{c['label']}` ({c['run_id']})" for c in configs)]
    return "\n".join(lines) + "\n"


def _md(rows: list[dict]) -> str:
    import pandas as pd
    return markdown_table(pd.DataFrame([{
        "config": r["label"], "metric": r["metric"], "baseline": fmt_spread(r["metric"], r["base"], r.get("base_range")),
        "current": fmt_spread(r["metric"], r["current"], r.get("current_range")), "change": fmt_change(r), "verdict": fmt_verdict(r),
        **({"gated": "yes" if r["gated"] else "no"})} for r in rows]))


def to_json(comparison: Comparison) -> str:
    return json.dumps(clean_for_json(comparison.to_dict()), default=_plain, allow_nan=False, indent=1)


def _plain(value):
    return str(value)


def clean_for_json(obj):
    """NaN/inf → None so the JSON is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean_for_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_for_json(v) for v in obj]
    return obj
