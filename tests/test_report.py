"""bench report on real runs: files, tables, empty panels that say why, and the page in a real browser."""
import json
import re
import time

import numpy as np
import pandas as pd
import pytest

from bench.report.render import build_report
from bench.results import skipped_row
from support.browser import probe, require_chromium, screenshot
from support.report_runs import CONFIGS, FAILING, result_sets

FIGURES = ("throughput_heatmap", "backend_comparison", "memory_breakdown", "comm_breakdown", "predicted_time")


@pytest.fixture(scope="module")
def sets(pools, tmp_path_factory):
    return result_sets(pools, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def report(sets, tmp_path_factory):
    from click.testing import CliRunner

    from bench.cli.report import report as report_command
    out = tmp_path_factory.mktemp("report")
    result = CliRunner().invoke(report_command, [str(sets["baseline"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_report_files_and_tables(report):
    assert sorted(p.stem for p in (report / "figures").glob("*.png")) == sorted(FIGURES)
    page, md = (report / "index.html").read_text(), (report / "report.md").read_text()
    assert page.count("data:image/png;base64,") == len(FIGURES)
    assert not re.search(r'(src|href)="https?:', page)  # self-contained: nothing to fetch
    for name in FIGURES:
        assert f"](figures/{name}.png)" in md
    # no pipeline run in the set: the bubble panel says so instead of drawing nothing
    assert "No figure: no successful pipeline run (pp &gt; 1)" in page
    assert "> No figure: no successful pipeline run (pp > 1)" in md
    # dp2 (global batch 4) has a single-process twin (dp1 with 2 micro-batches): losses agree
    assert re.search(r"\| native tp1·pp1·dp2 \| \w+ \| native tp1·pp1·dp1 m2 \| [\d.]+ \| [\d.]+ \| [\de.+-]+ \| ✓ \|", md)
    assert "| failed | native tp1·pp1·dp2 fault=raise |" in md and "injected fault (fault=raise)" in md
    assert "| torch | 2." in md and "| device | cpu |" in md
    top = md.split("## Top configs by throughput")[1].split("##")[0]
    assert top.count("| native") == 3 and "±" in top  # three configs, repeats give a spread


def test_report_renders_in_headless_chromium(report):
    require_chromium()
    shot = report / "screenshot.png"
    done = screenshot(report / "index.html", shot, height=5200)
    assert shot.exists(), done.stderr[-2000:]
    pixels = __import__("matplotlib.image", fromlist=["imread"]).imread(shot)
    assert pixels.shape[:2] == (5200, 1280) and pixels[..., :3].std() > 0.05  # not a blank page
    found, console = probe(report / "index.html")
    assert found == {"images": len(FIGURES), "broken": 0, "widths": found["widths"], "errors": []}, found
    assert all(w > 500 for w in found["widths"])
    assert console == [], console


def test_report_of_one_run(sets, tmp_path):
    one = next((sets["baseline"] / "runs").glob(f"{CONFIGS[-1].run_id}.json"))
    index = build_report([one], tmp_path)
    page = index.read_text()
    assert "1 run of 1 config" in page and page.count("data:image/png") == len(FIGURES)
    assert "No single-process reference run (world size 1)" in page


def test_report_with_missing_metrics_says_why(sets, tmp_path):
    rows = [json.loads(p.read_text()) for p in (sets["baseline"] / "runs").glob("*.json")]
    failed = next(r for r in rows if r["status"] == "failed")
    skipped = skipped_row(FAILING.replace(tp=4, dp=1, fault="none"), "backend native: tp=4 needs 4 ranks")
    stripped = {k: v for k, v in next(r for r in rows if r["status"] == "ok").items()
                if not k.startswith(("comm_", "tokens", "params_", "peak_mem", "bubble", "loss"))}
    index = build_report(pd.DataFrame([failed, skipped, stripped]), tmp_path / "partial")
    page = index.read_text()
    assert "data:image/png" not in page
    for reason in ("no successful run with a tokens_per_s measurement",
                   "no successful run with measured model-state bytes",
                   "no successful multi-rank run with communication counts",
                   "no successful pipeline run", "No successful run with a step time"):
        assert reason in page, reason
    assert "backend native: tp=4 needs 4 ranks" in page and "injected fault" in page
    only_failures = build_report(pd.DataFrame([failed, skipped]), tmp_path / "failures").read_text()
    assert "1 failed" in only_failures and "1 skipped" in only_failures


def hundred_configs(rows: list[dict]) -> pd.DataFrame:
    """100 distinct configs built from real rows: the measured columns of a real run, scaled, under
    the identity of another layout / backend (a rendering load test, not a measurement)."""
    rng = np.random.default_rng(0)
    ok = [r for r in rows if r["status"] == "ok"]
    variants = [("native", 0, None), ("native", 1, None), ("deepspeed", 0, None), ("deepspeed", 3, None),
                ("fsdp", 0, "full"), ("fsdp", 0, "grad-op")]
    out = []
    for i in range(100):
        backend, zero, fsdp = variants[i % len(variants)]
        tp, pp = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)][(i // len(variants)) % 6]
        dp = [1, 2][i // 36 % 2]
        row = dict(ok[i % len(ok)])
        scale = float(rng.uniform(0.5, 2.0))
        row.update(run_id=f"synthetic{i:03d}", config_id=f"synthetic{i:03d}", backend=backend, zero=zero,
                   fsdp=fsdp, tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp, micro_batches=[1, 2, 4, 8][i % 4],
                   schedule=["1f1b", "gpipe"][i % 2], tokens_per_s=row["tokens_per_s"] * scale,
                   step_time_s=row["step_time_s"] / scale,
                   comm_bytes_tp=row["comm_bytes_dp"] * (tp > 1), comm_bytes_pp=4096.0 * (pp > 1),
                   bubble_fraction=(pp - 1) / (row["micro_batches"] + pp - 1) * scale if pp > 1 else None)
        out.append(row)
    return pd.DataFrame(out)


def test_report_of_a_hundred_configs(sets, tmp_path):
    rows = [json.loads(p.read_text()) for p in (sets["baseline"] / "runs").glob("*.json")]
    start = time.monotonic()
    page = build_report(hundred_configs(rows), tmp_path).read_text()
    assert page.count("data:image/png") == len(FIGURES) + 1  # the bubble panel too: pp > 1 rows
    assert "100 runs of 100 configs" in page
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_report_of_a_hundred_real_runs(pools, tmp_path):
    from bench.config import RunConfig
    from support.report_runs import write_rows
    configs = [RunConfig(model="tiny", dp=dp, micro_batches=m, seed=s, steps=2, warmup=0)
               for dp in (1, 2) for m in (1, 2) for s in range(25)]
    out = write_rows([pools(c.world).run(c) for c in configs], tmp_path / "runs")
    page = build_report([out], tmp_path / "report").read_text()
    assert "100 runs of 100 configs" in page and page.count("data:image/png") == len(FIGURES)
    require_chromium()
    found, console = probe(tmp_path / "report" / "index.html")
    assert found["broken"] == 0 and not console


@pytest.mark.parametrize("case", ["missing", "empty-folder", "foreign", "broken"])
def test_report_bad_input_is_one_clear_line(case, tmp_path, capsys, monkeypatch):
    import sys

    from bench.cli import main
    target = {"missing": tmp_path / "nope", "empty-folder": tmp_path, "foreign": tmp_path / "f.parquet",
              "broken": tmp_path / "b.parquet"}[case]
    if case == "foreign":
        pd.DataFrame({"x": [1]}).to_parquet(target)
    if case == "broken":
        target.write_bytes(b"PAR1 not really")
    monkeypatch.setattr(sys, "argv", ["bench", "report", str(target), "-o", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error:") and str(target) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_labels_and_figures_name_cp_only_where_it_is_used():
    from bench.config import RunConfig
    from bench.report.figures import comm_breakdown, throughput_heatmap
    from bench.report.labels import config_label
    plain = RunConfig(tp=2, dp=2).to_row()
    before_cp = {k: v for k, v in plain.items() if k not in ("cp", "cp_comm")}  # a row from before cp
    assert config_label(plain) == config_label(before_cp) == "native tp2·pp1·dp2"
    assert config_label(RunConfig(cp=2, dp=2).to_row()) == "native tp1·cp2·pp1·dp2 ring"
    assert config_label(RunConfig(backend="deepspeed", cp=2).to_row()) == "deepspeed z0 tp1·cp2·pp1·dp1 ulysses"

    def measured(cfg, tokens):
        return {**cfg.to_row(), "status": "ok", "run_id": cfg.run_id, "config_id": cfg.config_id, "world_size": 4,
                "tokens_per_s": tokens, "comm_bytes_tp": 0.0, "comm_bytes_cp": 3e6 * (cfg.cp > 1),
                "comm_bytes_pp": 0.0, "comm_bytes_dp": 1e6}
    runs = pd.DataFrame([measured(RunConfig(dp=4), 1000.0), measured(RunConfig(cp=2, dp=2), 1500.0)])
    legend = [t.get_text() for t in comm_breakdown(runs).axes[0].get_legend().get_texts()]
    assert legend[:4] == ["tp group", "cp group", "pp group", "dp group"]
    legend = [t.get_text() for t in comm_breakdown(runs[runs.cp == 1]).axes[0].get_legend().get_texts()]
    assert "cp group" not in legend  # a sweep without cp draws what it drew before
    heatmap = throughput_heatmap(runs)  # one cell (tp 1, pp 1) of world 4: its best layout, the cp one
    assert [t.get_text() for t in heatmap.axes[0].texts] == ["1.5k\ncp2·dp2"]


def test_a_planted_straggler_is_flagged_with_its_rank(pools, tmp_path):
    """One rank slowed by 400 ms a step (fault slow_rank, the last rank; more than a tiny step takes on a
    loaded machine, so the spread clears the bar with room): its row names it as the slowest
    with a spread past STRAGGLER_SPREAD; the report's per-rank view marks it and `bench compare` finds it
    new against a baseline without one (gated unless --exact-only)."""
    from bench.config import RunConfig
    from bench.report.compare import STRAGGLER_SPREAD, compare
    from support.report_runs import write_rows
    cfg = RunConfig(model="tiny", dp=2, steps=3, warmup=1, fault="slow_rank:400")
    row = pools(2).run(cfg)
    assert row["status"] == "ok", row["error"]
    per_rank = json.loads(row["step_time_s_per_rank"])
    assert len(per_rank) == 2 and per_rank[1] - per_rank[0] > 0.1  # the sleep lands on rank 1's own steps only
    assert row["slowest_rank"] == 1 and row["step_time_spread"] > STRAGGLER_SPREAD
    page = (build_report([write_rows([row], tmp_path / "runs")], tmp_path / "report").parent / "report.md").read_text()
    view = page.split("## Stragglers")[1].split("\n## ")[0]
    flagged = [line for line in view.splitlines() if "◀ slowest" in line]
    assert len(flagged) == 1 and "| rank 1 |" in flagged[0] and flagged[0].endswith("◀ slowest |")  # rank 1: the last
    healthy = {**row, "step_time_spread": 1.0, "slowest_rank": 0}
    found = compare(pd.DataFrame([healthy]), pd.DataFrame([row]))
    finding = [r for r in found.rows if r["verdict"] == "straggler"]
    assert len(finding) == 1 and finding[0]["error"] == "rank 1 is the slowest" and found.regressed
    assert not compare(pd.DataFrame([healthy]), pd.DataFrame([row]), exact_only=True).regressed
    assert not [r for r in compare(pd.DataFrame([row]), pd.DataFrame([row])).rows if r["verdict"] == "straggler"]
