"""The report's figures: each function takes the results dataframe and returns a matplotlib Figure,
or a string saying why the panel is empty (the report prints it in the figure's place).

Conventions: seaborn's colour-blind palette for categories, viridis for the heatmap, MiB for bytes,
error bars are the min–max range over repeats of one config.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from bench.layout import named_dims  # noqa: E402
from bench.report.labels import MiB, add_labels, cp_of, largest_cp, largest_ep  # noqa: E402
from bench.results import Status, comm_column  # noqa: E402

PALETTE = "colorblind"
MAX_BARS = 16  # configs per breakdown figure: the best by tokens/s (more is unreadable)
PRED_MEMORY = {"params": "pred_params_bytes", "grads": "pred_grads_bytes", "optimizer": "pred_optimizer_bytes",
               "activations": "pred_activation_bytes"}


def theme() -> None:
    sns.set_theme(style="whitegrid", context="notebook", palette=PALETTE, font_scale=0.95)
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 110, "axes.titleweight": "bold"})


def ok_runs(df: pd.DataFrame, *needed: str) -> pd.DataFrame:
    """Successful runs that carry every `needed` metric (as numbers), with label columns."""
    if "status" not in df:
        return df.iloc[0:0]
    ok = df[df["status"] == Status.OK].copy()
    for col in needed:
        if col not in ok:
            return ok.iloc[0:0]
        ok[col] = pd.to_numeric(ok[col], errors="coerce")
        ok = ok[ok[col].notna()]
    return add_labels(ok) if not ok.empty else ok


def per_config(ok: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """One row per config: the mean of `metrics` over repeats, the first repeat's other columns."""
    key = "config_id"
    first = ok.groupby(key, sort=False).head(1).set_index(key)
    means = ok.groupby(key, sort=False)[metrics].mean()
    first[metrics] = means
    first["repeats"] = ok.groupby(key, sort=False).size()
    return first.reset_index()


# --- throughput heatmap -------------------------------------------------------------------------
def throughput_heatmap(df: pd.DataFrame):
    ok = ok_runs(df, "tokens_per_s", "tp", "pp", "dp")
    if ok.empty:
        return "no successful run with a tokens_per_s measurement and its layout (tp, pp, dp)"
    configs = per_config(ok, ["tokens_per_s"])
    configs["world"] = configs["tp"] * configs["pp"] * configs["dp"] * [cp_of(r) for r in configs.to_dict("records")]
    # A tp × pp cell ran at several dp when world sizes (or cp) differ (dp = world / (tp·cp·pp)): then one
    # panel per backend and world size, so a panel compares layouts of equal resources.
    by_world = configs.groupby(["variant", "tp", "pp"])["dp"].nunique().max() > 1
    panels = sorted(configs.groupby(["variant", "world"] if by_world else "variant").groups)
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    cell = 1.15  # inches per heatmap cell, whatever the grid size
    width = max(2.6, cell * configs["tp"].nunique() + 1.0)
    height = max(2.2, cell * configs["pp"].nunique() + 0.9)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 1.4, height * nrows + 0.5), squeeze=False,
                             layout="constrained")
    vmax = configs["tokens_per_s"].max()
    for ax, panel in zip(axes.flat, panels):
        panel = panel if isinstance(panel, tuple) else (panel,)
        sub = configs[configs["variant"] == panel[0]]
        if by_world:
            sub = sub[sub["world"] == panel[1]]
        ranks = f", {int(panel[1])} rank{'s' * (panel[1] != 1)}" if by_world else ""
        _heatmap_panel(ax, sub, vmax, title=panel[0] + ranks,
                       tps=sorted(configs["tp"].unique()), pps=sorted(configs["pp"].unique()))
    for i, ax in enumerate(axes.flat):
        ax.set_visible(i < len(panels))
        if i % ncols:
            ax.set_ylabel("")
    fig.colorbar(axes[0, 0].collections[0], ax=axes, shrink=0.8, label="tokens/s (best config of the cell)")
    fig.suptitle("Throughput over tensor × pipeline parallel size", fontweight="bold")
    return fig


def _heatmap_panel(ax, sub: pd.DataFrame, vmax: float, title: str, tps: list, pps: list) -> None:
    """One backend's grid; every panel spans the same tp and pp values (a blank cell: not run / no data)."""
    best = sub.sort_values("tokens_per_s").groupby(["pp", "tp"]).tail(1)  # best option set per cell
    values = best.pivot(index="pp", columns="tp", values="tokens_per_s").reindex(index=pps, columns=tps)
    values = values.astype(float)
    text = pd.DataFrame("", index=values.index, columns=values.columns)
    for r in best.itertuples():
        text.loc[r.pp, r.tp] = f"{_si(r.tokens_per_s)}\n{_data_dims(r)}" if pd.notna(r.dp) else _si(r.tokens_per_s)
    # pcolormesh and our own labels, not sns.heatmap: seaborn draws the whole figure once per annotated
    # panel to pick text colours, which made a 24-panel sweep's figure take a minute
    grid = values.to_numpy()
    mesh = ax.pcolormesh(np.ma.masked_invalid(grid), cmap="viridis", vmin=0, vmax=vmax, edgecolors="white",
                         linewidth=1)
    for (i, pp) in enumerate(values.index):
        for (j, tp) in enumerate(values.columns):
            if pd.isna(grid[i, j]):
                ax.text(j + 0.5, i + 0.5, "not run", ha="center", va="center", fontsize=8, color="0.55")
            else:
                dark = _luminance(mesh.cmap(mesh.norm(grid[i, j]))) > 0.408  # seaborn's threshold
                ax.text(j + 0.5, i + 0.5, text.loc[pp, tp], ha="center", va="center", fontsize=9,
                        color="0.15" if dark else "white")
    ax.set_xticks([j + 0.5 for j in range(len(tps))], [str(t) for t in tps])
    ax.set_yticks([i + 0.5 for i in range(len(pps))], [str(p) for p in pps])
    ax.grid(False)
    ax.set(title=title, xlabel="tp (tensor-parallel size)", ylabel="pp (pipeline stages)")


def _luminance(rgba) -> float:
    """Relative luminance of an sRGB colour (WCAG 2.0): which text colour reads on a cell."""
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _data_dims(r) -> str:
    """What a heatmap cell's layout splits beyond tp × pp: `dp4`, or `cp2·dp2`."""
    cp = cp_of(r._asdict())
    return (f"cp{cp}·" if cp > 1 else "") + f"dp{int(r.dp)}"


# --- backend comparison -------------------------------------------------------------------------
def backend_comparison(df: pd.DataFrame):
    ok = ok_runs(df, "tokens_per_s", "world_size")
    if ok.empty:
        return "no successful run with a tokens_per_s measurement and its world_size"
    ok = _best_config_runs(ok)
    ok["tokens_k"] = ok["tokens_per_s"] / 1e3
    mem_cols = [c for c in ("persistent_bytes", "peak_mem_bytes") if c in ok]
    ok["mem_mib"] = sum(pd.to_numeric(ok[c], errors="coerce").fillna(0) for c in mem_cols) / MiB if mem_cols else np.nan
    worlds = sorted(ok["world_size"].unique())[-4:]  # the largest four world sizes
    hue_order = sorted(ok["variant"].unique())
    n_layouts = ok.groupby("world_size")["layout"].nunique().max()
    fig, axes = plt.subplots(len(worlds), 2, figsize=(max(11.0, 2.2 * n_layouts + 6), 3.6 * len(worlds) + 0.8),
                             squeeze=False, layout="constrained")
    for row, world in enumerate(worlds):
        sub = ok[ok["world_size"] == world].sort_values("layout")
        for col, (y, label) in enumerate((("tokens_k", "thousand tokens/s"), ("mem_mib", "peak memory per rank (MiB)"))):
            ax = axes[row, col]
            sns.barplot(sub, x="layout", y=y, hue="variant", hue_order=hue_order, ax=ax, errorbar=("pi", 100),
                        capsize=0.15, err_kws={"linewidth": 1.2}, legend=(row == 0 and col == 1))
            ax.set(xlabel="layout (tp·pp·dp)" if row == len(worlds) - 1 else "", ylabel=label,
                   title=f"world size {int(world)}: {'throughput' if col == 0 else 'memory'}")
            ax.tick_params(axis="x", rotation=20)
    if axes[0, 1].get_legend():
        sns.move_legend(axes[0, 1], "upper left", bbox_to_anchor=(1.01, 1.0), title="backend")
    fig.suptitle("Backends at equal world size (bars: mean over repeats, whiskers: min–max)", fontweight="bold")
    return fig


def _best_config_runs(ok: pd.DataFrame) -> pd.DataFrame:
    """Per world size, variant and layout: every repeat of the config with the best mean tokens/s."""
    key = "config_id"
    means = ok.groupby(key)["tokens_per_s"].transform("mean")
    ok = ok.assign(_mean=means)
    best = ok.sort_values("_mean").groupby(["world_size", "variant", "layout"])[key].last()
    return ok[ok[key].isin(best.values)].drop(columns="_mean")


# --- memory breakdown ---------------------------------------------------------------------------
def memory_breakdown(df: pd.DataFrame):
    ok = ok_runs(df, "params_bytes", "tokens_per_s")
    if ok.empty:
        return "no successful run with measured model-state bytes (params_bytes)"
    pred_cols = {part: name if name in ok else None for part, name in PRED_MEMORY.items()}
    have_pred = any(pred_cols.values())
    measured = {"params": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes",
                "activations": "peak_mem_bytes"}
    configs = _top_configs(per_config(ok, [c for c in [*measured.values(), *filter(None, pred_cols.values())]
                                            if c in ok]))
    bars = {"measured": measured}
    if have_pred:
        bars["predicted"] = pred_cols
    unit, name = byte_unit(configs, [c for cols in bars.values() for c in cols.values() if c])
    fig = _stacked_pairs(configs, bars, unit=unit, xlabel=f"{name} per rank (max over ranks)",
                         legend_names={"activations": "activations (measured: step peak)"})
    note = "" if have_pred else "  — no predictions in these rows (pred_* columns absent)"
    fig.suptitle(f"Memory per rank: measured vs predicted{note}", fontweight="bold", fontsize=11)
    return fig


# --- communication ------------------------------------------------------------------------------
def comm_breakdown(df: pd.DataFrame):
    ok = ok_runs(df, "tokens_per_s")
    if not ok.empty and "world_size" in ok:
        ok = ok[pd.to_numeric(ok["world_size"], errors="coerce").fillna(1) > 1]
    measured = {dim: comm_column("bytes", dim) for dim in named_dims(largest_cp(ok), largest_ep(ok))}
    if ok.empty or not any(c in ok for c in measured.values()):
        return "no successful multi-rank run with communication counts (comm_bytes_tp/pp/dp)"
    predicted = {dim: "pred_" + comm_column("bytes", dim) for dim in measured}
    have_pred = any(c in ok for c in predicted.values())
    cols = [c for c in (*measured.values(), *predicted.values()) if c in ok]
    for c in cols:
        ok[c] = pd.to_numeric(ok[c], errors="coerce")
    configs = _top_configs(per_config(ok, cols))
    bars = {"measured": measured, **({"predicted": predicted} if have_pred else {})}
    unit, name = byte_unit(configs, cols)
    fig = _stacked_pairs(configs, bars, unit=unit, xlabel=f"{name} per optimizer step (payload, mean over ranks)",
                         legend_names={d: f"{d} group" for d in measured})
    note = "" if have_pred else "  — no predictions in these rows (pred_comm_bytes_* absent)"
    fig.suptitle(f"Communication per step by group: measured vs predicted{note}", fontweight="bold", fontsize=11)
    return fig


def byte_unit(configs: pd.DataFrame, columns) -> tuple[float, str]:
    """The binary unit that keeps the largest stacked bar between 1 and 1024."""
    totals = sum(pd.to_numeric(configs[c], errors="coerce").fillna(0) for c in columns if c in configs)
    largest = float(np.max(totals)) if len(configs) and not isinstance(totals, int) else 0.0
    for unit, name in ((2**30, "GiB"), (MiB, "MiB"), (2**10, "KiB")):
        if largest >= unit:
            return unit, name
    return 1, "bytes"


def _top_configs(configs: pd.DataFrame) -> pd.DataFrame:
    return configs.sort_values("tokens_per_s", ascending=False).head(MAX_BARS).iloc[::-1]


def _stacked_pairs(configs: pd.DataFrame, bars: dict[str, dict], unit: float, xlabel: str, legend_names: dict):
    """Horizontal stacked bars: per config one bar per source (measured / predicted), stacked by part."""
    parts = list(next(iter(bars.values())))
    colors = dict(zip(parts, sns.color_palette(PALETTE, len(parts))))
    n, height = len(configs), 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * n * len(bars)))
    for b, (source, columns) in enumerate(bars.items()):
        y = np.arange(n) - 0.4 + height * (b + 0.5)
        left = np.zeros(n)
        cols = [c for c in columns.values() if c and c in configs]
        known = configs[cols].apply(pd.to_numeric, errors="coerce").notna().any(axis=1).to_numpy() if cols \
            else np.zeros(n, bool)  # a row with none of this source's columns has no bar, not a zero bar
        for part in parts:
            col = columns.get(part)
            values = (configs[col].fillna(0).to_numpy(float) / unit) if col and col in configs else np.zeros(n)
            ax.barh(y, values, height * 0.92, left=left, color=colors[part], hatch="//" if b else None,
                    edgecolor="white" if not b else "0.25", linewidth=0.5,
                    label=legend_names.get(part, part) if b == 0 else None)
            left += values
        for yi, total, has in zip(y, left, known):
            text = f" {total:.3g} {source}" if has else f" no {source} value in this row"
            ax.text(total, yi, text, va="center", fontsize=7.5, color="0.25" if has else "0.5")
    ax.set_yticks(np.arange(n), configs["label"])
    ax.grid(axis="y", visible=False)
    ax.set_xlabel(xlabel)
    ax.margins(x=0.18)
    handles, labels = ax.get_legend_handles_labels()
    if len(bars) > 1:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="0.25", hatch="//"))
        labels.append("predicted (hatched)")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


# --- pipeline bubble ----------------------------------------------------------------------------
def bubble_curve(df: pd.DataFrame):
    runs = ok_runs(df, "pp", "micro_batches")
    runs = runs[runs["pp"] > 1] if not runs.empty else runs
    if runs.empty:
        return "no successful pipeline run (pp > 1) in these results"
    measured = "bubble_fraction" in runs and pd.to_numeric(runs["bubble_fraction"], errors="coerce").notna().any()
    predicted = "pred_bubble_fraction" in runs
    fig, ax = plt.subplots(figsize=(8, 4.8))
    m_max = max(16, int(runs["micro_batches"].max()) * 2)
    m = np.arange(1, m_max + 1)
    for p in sorted(runs["pp"].unique()):
        theory = (p - 1) / (m + p - 1)
        ax.plot(m, theory, color="0.45", linestyle="--", linewidth=1)
        ax.text(m[-1], theory[-1], f" (p−1)/(m+p−1), p={int(p)}", fontsize=8, color="0.35", va="center")
    if measured:
        runs["bubble_fraction"] = pd.to_numeric(runs["bubble_fraction"], errors="coerce")
        sns.scatterplot(runs, x="micro_batches", y="bubble_fraction", hue="schedule", style="pp", s=70, ax=ax,
                        palette=PALETTE, hue_order=sorted(runs["schedule"].dropna().unique()))
    if predicted:
        runs["pred_bubble_fraction"] = pd.to_numeric(runs["pred_bubble_fraction"], errors="coerce")
        ax.scatter(runs["micro_batches"], runs["pred_bubble_fraction"], facecolors="none", edgecolors="0.2",
                   s=110, label="predicted")
    ax.set_xscale("log", base=2)
    ticks = [2**k for k in range(int(math.log2(m_max)) + 1)]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel="micro-batches per step (m)", ylabel="bubble fraction (idle / step time)",
           ylim=(0, 1), xlim=(0.8, m_max * 3.5))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    why = "" if measured else "\n(no measured bubble_fraction in these rows: only the theory is drawn)"
    ax.set_title(f"Pipeline bubble vs micro-batches per schedule{why}", fontsize=11)
    fig.tight_layout()
    return fig


# --- predicted vs measured time -----------------------------------------------------------------
TIME_TERMS = {"compute": "pred_compute_s", "overhead": "pred_overhead_s", "tp comm": "pred_comm_exposed_tp_s",
              "ep comm": "pred_comm_exposed_ep_s", "pp comm": "pred_comm_exposed_pp_s", "dp comm": "pred_comm_exposed_dp_s", "bubble": "pred_bubble_s",
              "optimizer": "pred_optimizer_s"}


def predicted_time(df: pd.DataFrame):
    """Per config the measured step time beside the predicted one split into its terms, with the error;
    and the distribution of the errors over configs."""
    ok = ok_runs(df, "step_time_s", "pred_step_time_s", "tokens_per_s")
    if ok.empty:
        return "no successful run with a predicted step time (pred_step_time_s: rows from before the time model)"
    cols = ["step_time_s", "pred_step_time_s", *[c for c in TIME_TERMS.values() if c in ok]]
    for c in cols:
        ok[c] = pd.to_numeric(ok[c], errors="coerce")
    configs = _top_configs(per_config(ok, cols))
    errors = configs["pred_step_time_s"] / configs["step_time_s"] - 1
    n = len(configs)
    fig, (ax, hist) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.5 * n), gridspec_kw={"width_ratios": [3, 1]})
    y = np.arange(n)
    ax.barh(y + 0.2, configs["step_time_s"] * 1e3, 0.38, color="0.35", label="measured")
    left = np.zeros(n)
    colors = sns.color_palette(PALETTE, len(TIME_TERMS))
    for (name, col), color in zip(TIME_TERMS.items(), colors):
        values = configs[col].fillna(0).to_numpy(float) * 1e3 if col in configs else np.zeros(n)
        ax.barh(y - 0.2, values, 0.38, left=left, color=color, hatch="//", edgecolor="white", linewidth=0.5,
                label=f"predicted: {name}")
        left += values
    for yi, total, err in zip(y, left, errors):
        ax.text(total, yi - 0.2, f" {err:+.0%}", va="center", fontsize=8)
    ax.set_yticks(y, configs["label"])
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("step time (ms): measured (grey) and predicted by term (hatched), error = predicted / measured − 1")
    ax.margins(x=0.12)
    ax.legend(loc="lower right", fontsize=7.5, framealpha=0.9)
    hist.hist(errors * 100, bins=max(5, min(20, n)), color=colors[0])
    hist.axvline(0, color="0.3", lw=1)
    hist.set_xlabel("prediction error (%)")
    hist.set_ylabel("configs")
    hist.set_title(f"median |error| {np.median(np.abs(errors)):.0%}, max {np.max(np.abs(errors)):.0%}", fontsize=10)
    fig.suptitle(f"Predicted vs measured step time ({profiles_used(configs)})", fontweight="bold", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def profiles_used(df: pd.DataFrame) -> str:
    """The profiles the rows' predictions used (`pred_profile`; older rows: `pred_hardware`), joined."""
    col = "pred_profile" if "pred_profile" in df else "pred_hardware"
    return "; ".join(sorted(df[col].dropna().astype(str).unique())) if col in df else "no profile"


FIGURES = {
    "throughput_heatmap": ("Throughput heatmap", throughput_heatmap),
    "backend_comparison": ("Backend comparison at equal world size", backend_comparison),
    "memory_breakdown": ("Memory per rank: measured vs predicted", memory_breakdown),
    "comm_breakdown": ("Communication bytes per step by group", comm_breakdown),
    "bubble": ("Pipeline bubble vs micro-batches", bubble_curve),
    "predicted_time": ("Predicted vs measured step time", predicted_time),
}


def _si(value: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def validation_figure(result: dict):
    """`bench validate`: predicted vs published, one panel per kind, the diagonal ±5 % shaded."""
    theme()
    kinds = list(result["summary"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = [e for e in result["entries"] if e["kind"] == kind and not e["refused"]]
        pub = np.array([e["published_base"] for e in rows])  # one unit a kind: seconds or GiB
        pred = np.array([e["predicted_base"] for e in rows])
        lo, hi = 0.8 * min(pub.min(), pred.min()), 1.2 * max(pub.max(), pred.max())
        line = np.geomspace(lo, hi, 50)
        ax.fill_between(line, line * 0.95, line * 1.05, color="0.9", label="±5 %")
        ax.plot(line, line, color="0.5", lw=1)
        ax.scatter(pub, pred, zorder=3)
        for e in rows:
            ax.annotate(e["name"].split()[0], (e["published_base"], e["predicted_base"]), fontsize=7,
                        xytext=(3, -8), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel=f"published ({rows[0]['base_unit']})",
               ylabel=f"predicted ({rows[0]['base_unit']})")
        s = result["summary"][kind]
        ax.set_title(f"{kind}: mean |err| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}", fontsize=10)
    fig.tight_layout()
    return fig
