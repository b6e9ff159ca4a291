"""`bench report`: figures and tables → DIR/index.html (self-contained), DIR/report.md, DIR/figures/*.png."""
from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

from bench.report import figures, tables
from bench.report.load import load_many
from bench.results import Status

CAPTIONS = {
    "throughput_heatmap": "Tokens per second for each tensor × pipeline layout, one panel per backend variant "
                          "(and per world size when a layout ran at several dp, dp = world / (tp·cp·pp)). A cell "
                          "shows the best config of that layout (over schedules, micro-batches, …) and its dp "
                          "(cp·dp where it split the sequence).",
    "backend_comparison": "The best config of each backend variant and layout at the same world size. Bars: mean "
                          "over repeats; whiskers: min–max over repeats (none for single runs). Memory per "
                          "rank = model state (params + grads + optimizer state) + the measured step peak, max "
                          "over ranks.",
    "memory_breakdown": "Per rank, max over ranks: measured model state (parameters, gradients, optimizer state) "
                        "plus the measured step peak, beside the analytic prediction (hatched) when the rows carry "
                        "one. The best configs by tokens/s are shown.",
    "comm_breakdown": "Payload bytes per optimizer step in each group (tp, pp, dp), averaged over ranks, "
                      "measured by the communication counter beside the analytic prediction (hatched).",
    "bubble": "Idle fraction of a pipeline step against the number of micro-batches, per schedule; dashed: "
              "the theoretical (p−1)/(m+p−1) of a synchronous schedule with p stages.",
    "predicted_time": "Per config (mean over repeats), the measured median step time beside the time model's "
                      "prediction split into its terms (bench/analysis/time_model.py) and the error "
                      "predicted / measured − 1; right: the errors' distribution. The profile is named in the "
                      "title: calibrated on this machine (by the sweep itself, or `bench calibrate`) or built-in.",
}


def build_report(results, out_dir) -> Path:
    """Writes the report for `results` (paths, or a dataframe) into `out_dir`; returns index.html's path."""
    df = results if isinstance(results, pd.DataFrame) else load_many(results)
    out = Path(out_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    figures.theme()
    panels = [_make_figure(df, name, out) for name in figures.FIGURES]
    sections = _tables(df)
    profiled = _safe(lambda d: tables.traces(d, out), df)
    if not profiled.empty:
        sections.insert(-1, ("Profiled runs", profiled, "One extra, untimed step per rank under torch.profiler "
                             "(Chrome / Perfetto JSON: open in https://ui.perfetto.dev); the op table lists the "
                             "top ops by self time and the rank's compute / communication / idle split."))
    summary = tables.summary(df)
    (out / "report.md").write_text(_markdown(summary, panels, sections))
    index = out / "index.html"
    index.write_text(_html(summary, panels, sections))
    return index


def _make_figure(df: pd.DataFrame, name: str, out: Path) -> dict:
    title, make = figures.FIGURES[name]
    try:
        result = make(df)
    except Exception as e:  # noqa: BLE001 - one odd panel must not cost the whole report
        result = f"could not draw it from these rows ({type(e).__name__}: {e})"
    panel = {"name": name, "title": title, "caption": CAPTIONS[name], "png": None, "empty": None}
    if isinstance(result, str):
        panel["empty"] = result
        (out / "figures" / f"{name}.png").unlink(missing_ok=True)  # no stale figure from an earlier report
        return panel
    path = out / "figures" / f"{name}.png"
    result.savefig(path, bbox_inches="tight")
    figures.plt.close(result)
    panel["png"] = path
    return panel


def _tables(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame, str]]:
    """(title, table, note) in page order; the note explains the table, or its absence."""
    parity, parity_note = _safe(tables.loss_parity, df, default=(pd.DataFrame(), None))
    fails, top, env, slow = (_safe(make, df) for make in (tables.failures, tables.top_configs, tables.environment,
                                                            tables.stragglers))
    from bench.report.compare import STRAGGLER_SPREAD
    return [
        ("Top configs by throughput", top, "No successful run with a step time: nothing to rank." if top.empty else
         "Mean over repeats; ± is half the min–max spread of the repeats."),
        ("Stragglers: median step per rank (ms)", slow,
         f"No run has a rank slower than {STRAGGLER_SPREAD:g}× its median rank." if slow.empty else
         f"Runs whose slowest rank's median step exceeds {STRAGGLER_SPREAD:g}× the median rank's "
         "(step_time_spread); on CPU each timed step starts at a barrier, so a rank's time is its own work."),
        ("Loss parity against the single-process reference", parity, parity_note),
        ("Failed and skipped runs", fails, "Every run succeeded." if fails.empty else
         f"{len(fails)} run(s) produced no measurement; the reason is the last line of their error."),
        ("Environment", env, "No environment columns in these rows." if env.empty else ""),
    ]


def _safe(make, df: pd.DataFrame, default=None):
    """A table that cannot be built from these rows is left out, with the reason, instead of failing."""
    try:
        return make(df)
    except Exception as e:  # noqa: BLE001
        reason = f"could not build it from these rows ({type(e).__name__}: {e})"
        return (pd.DataFrame(), reason) if default is not None else pd.DataFrame({"note": [reason]})


# --- HTML ---------------------------------------------------------------------------------------
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"  # the page can fetch nothing
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:22px 36px}header h1{margin:0 0 6px;font-size:24px}
header p{margin:2px 0;color:#c9d1e0}main{max-width:1180px;margin:0 auto;padding:18px 28px 48px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px #0002;padding:16px 22px;margin:18px 0}
h2{font-size:18px;margin:4px 0 10px}p.caption{color:#4a5365;font-size:14px;margin:6px 0 10px}
img{max-width:100%;height:auto;display:block;margin:6px auto}
.empty{border:2px dashed #c3c9d5;border-radius:6px;padding:22px;color:#4a5365;background:#fafbfc}
table{border-collapse:collapse;font-size:13px;width:100%}th,td{padding:5px 8px;border-bottom:1px solid #e3e6ec;
text-align:left;vertical-align:top}th{background:#eef1f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pill{display:inline-block;padding:2px 10px;border-radius:12px;margin-right:6px;font-size:13px;background:#2f3a52}
.pill.ok{background:#0072b2}.pill.bad{background:#d55e00}.pill.skip{background:#6b7280}
nav a{color:#c9d1e0;margin-right:14px;font-size:13px}
"""


def _html(summary: dict, panels: list[dict], sections) -> str:
    body = [_html_header(summary)]
    for p in panels:
        body.append(f'<section id="{p["name"]}"><h2>{html.escape(p["title"])}</h2>'
                    f'<p class="caption">{html.escape(p["caption"])}</p>{_html_figure(p)}</section>')
    for title, table, note in sections:
        anchor = title.split()[0].lower()
        content = _html_table(table) if not table.empty else ""
        note_html = f'<p class="caption">{html.escape(note)}</p>' if note else ""
        body.append(f'<section id="{anchor}"><h2>{html.escape(title)}</h2>{note_html}{content}</section>')
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>parabench report</title>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style></head>"
            f"<body>{''.join(body)}</main></body></html>")


def _html_header(summary: dict) -> str:
    pills = []
    for status, n in sorted(summary["counts"].items()):
        kind = {Status.OK: "ok", Status.SKIPPED: "skip"}.get(status, "bad")
        pills.append(f'<span class="pill {kind}">{n} {html.escape(str(status))}</span>')
    best = f"<p>Fastest: <b>{html.escape(summary['best'])}</b></p>" if summary["best"] else ""
    best += f"<p>Predictions on {html.escape(summary['profiles'])}</p>" if summary["profiles"] else ""
    sweeps = f" · sweep {html.escape(', '.join(summary['sweeps']))}" if summary["sweeps"] else ""
    nav = "".join(f'<a href="#{k}">{html.escape(t)}</a>' for k, (t, _) in figures.FIGURES.items())
    return (f"<header><h1>parabench report</h1><p>{_runs_of_configs(summary)}{sweeps}"
            f"</p><p>{''.join(pills)}</p>{best}<nav>{nav}</nav></header><main>")


def _runs_of_configs(summary: dict) -> str:
    runs, configs = summary["runs"], summary["configs"]
    return f"{runs} run{'s' * (runs != 1)} of {configs} config{'s' * (configs != 1)}"


def _html_figure(panel: dict) -> str:
    if panel["empty"]:
        return f'<div class="empty">No figure: {html.escape(panel["empty"])}.</div>'
    data = base64.b64encode(panel["png"].read_bytes()).decode()
    return f'<img alt="{html.escape(panel["title"])}" src="data:image/png;base64,{data}">'


def _html_table(table: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = []
    for values in table.itertuples(index=False):
        cells = "".join(f'<td class="{"num" if _numeric(v) else ""}">{_html_cell(v)}</td>' for v in values)
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _html_cell(value) -> str:
    if isinstance(value, tables.Link):
        return f'<a href="{html.escape(value.href)}">{html.escape(str(value))}</a>'
    return html.escape(str(value))


def _numeric(value) -> bool:
    text = str(value).replace(",", "").replace("%", "").split(" ±")[0]
    try:
        float(text)
        return True
    except ValueError:
        return False


# --- Markdown -----------------------------------------------------------------------------------
def _markdown(summary: dict, panels: list[dict], sections) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary["counts"].items()))
    lines = ["# parabench report", "", f"{_runs_of_configs(summary)} ({counts})."]
    if summary["best"]:
        lines += ["", f"Fastest: **{summary['best']}**"]
    if summary["profiles"]:
        lines += ["", f"Predictions on {summary['profiles']}."]
    for p in panels:
        lines += ["", f"## {p['title']}", "", p["caption"], ""]
        lines.append(f"> No figure: {p['empty']}." if p["empty"] else f"![{p['title']}](figures/{p['name']}.png)")
    for title, table, note in sections:
        lines += ["", f"## {title}", ""]
        if note:
            lines += [note, ""]
        if not table.empty:
            lines.append(markdown_table(table))
    return "\n".join(lines) + "\n"


def markdown_table(table: pd.DataFrame) -> str:
    def cell(v) -> str:
        text = str(v).replace("|", "\\|").replace("\n", " ")
        return f"[{text}]({v.href})" if isinstance(v, tables.Link) else text
    head = "| " + " | ".join(cell(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([head, rule, *body])
