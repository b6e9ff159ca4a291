"""Fair comparisons (issue 12): interleaved repeats, the spread in the report and `bench compare`,
`--profile` (one extra, untimed step under torch.profiler per rank), and its one-line refusals."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report.compare import judge
from bench.report.render import build_report
from bench.sweep.runner import prepare, run_sweep
from bench.sweep.spec import SweepError, expand, parse_sweep
from bench.results.store import load_results

ROOT = Path(__file__).resolve().parents[1]


def _spec(**data):
    return parse_sweep(data, "test.yaml")


def _order(exp):
    return [(c.repeat, c.backend, c.micro_batch) for c in exp.runs]


def test_repeats_are_interleaved_by_default_and_blocked_on_request():
    data = dict(world_size=2, grid={"backend": ["native", "ddp"], "micro_batch": [1, 2], "dp": "auto"}, repeats=2)
    interleaved = _order(expand(_spec(**data)))
    blocked = _order(expand(_spec(**data, repeat_order="blocked")))
    configs = [("native", 1), ("native", 2), ("ddp", 1), ("ddp", 2)]
    assert interleaved == [(r, b, m) for r in (0, 1) for b, m in configs]  # A B C D A B C D
    assert blocked == [(r, b, m) for b, m in configs for r in (0, 1)]  # A A B B C C D D
    ids = lambda spec: sorted(c.run_id for c in expand(spec).runs)  # noqa: E731
    assert ids(_spec(**data)) == ids(_spec(**data, repeat_order="blocked"))  # the order is no part of an id


def test_a_bad_repeat_order_names_the_key_and_the_choices():
    with pytest.raises(SweepError, match=r"repeat_order.*interleaved, blocked"):
        _spec(grid={"tp": [1]}, repeat_order="random")


def test_profile_is_no_part_of_the_run_id():
    plain, profiled = (expand(_spec(grid={"tp": [1]}, base={"profile": p})).runs[0] for p in (False, True))
    assert profiled.profile and plain.run_id == profiled.run_id and plain.config_id == profiled.config_id


def test_compare_reports_the_range_of_the_repeats():
    j = judge([1.0, 1.2, 1.1], [0.9, 1.3], exact=False)
    assert (j.base, j.base_range, j.current_range) == (1.1, (1.0, 1.2), (0.9, 1.3))
    assert judge([1.0], [1.0], exact=False).base_range is None  # one run: no spread to show


def test_profiled_sweep_interleaves_writes_traces_beside_rows_and_the_report_links_them(tmp_path):
    """World 1 (one warm rank), two configs × 2 repeats: the rows land A B A B, each profiled run
    has a Chrome trace and an op table in OUT/runs/<run_id>/, and the report links them."""
    spec = _spec(name="fair", model="tiny", base={"steps": 1, "warmup": 0, "device": "cpu", "profile": True},
                 grid={"micro_batch": [1, 2]}, repeats=2)
    out = tmp_path / "out"
    outcome = run_sweep(prepare(spec, out), progress=False)
    assert outcome.counts["ok"] == 4
    assert [(r["repeat"], r["micro_batch"]) for r in outcome.rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    df = load_results(out)
    for row in df.itertuples():
        folder = Path(row.trace_dir)
        assert folder == (out / "runs" / row.run_id).resolve()
        trace = json.loads((folder / "trace_rank0.json").read_text())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
        table = (folder / "ops_rank0.md").read_text()
        assert "| compute |" in table and "| communication |" in table and "top 15 ops" in table
    index = build_report(df, out / "report")
    report = (out / "report" / "report.md").read_text()
    assert "## Profiled runs" in report and "(../runs/" in report and 'href="../runs/' in index.read_text()


def test_profile_refused_in_one_line_where_traces_cannot_be_written(tmp_path):
    """A folder the ranks could not create (under a file here: unwritable even for root)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, "-c", "from bench.cli import main; main()", "run", "--model", "tiny",
                          "--profile", "--trace-dir", str(blocker / "traces")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "running" not in out.stderr  # refused before any rank started
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --profile: cannot write traces to")
    spec = _spec(model="tiny", base={"profile": True}, grid={"tp": [1]})
    with pytest.raises(ValueError, match="--profile: cannot write traces"):
        run_sweep(prepare(spec, blocker / "out"), progress=False)


def test_profile_refused_for_a_launcher_without_this_file_system(tmp_path):
    spec = _spec(model="tiny", base={"profile": True}, grid={"tp": [1]},
                 launcher={"kind": "slurm", "profile": "local"})
    with pytest.raises(ValueError, match="profile: the slurm launcher"):
        run_sweep(prepare(spec, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()  # nothing written, nothing submitted


def test_peers_benchmark_runs_every_backend_interleaved_and_prints_the_ratio(tmp_path):
    """benchmarks/peers.py end to end on the tiny model: one layout, two repeats of every backend; the
    printed ratio is native's median over the best peer's, from those rows, and --summary re-reads it."""
    out = tmp_path / "peers"
    cmd = [sys.executable, "benchmarks/peers.py", "--model", "tiny", "--layouts", "dp2", "--dtypes", "fp32",
           "--micro-batch", "2", "--repeats", "2", "--steps", "1", "--warmup", "0", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    df = load_results(out)
    assert set(df.backend) == {"native", "ddp", "fsdp", "deepspeed"} and (df.status == "ok").all()
    assert sorted(df.groupby("backend").size()) == [2, 2, 2, 2]
    median = df.groupby("backend").step_time_s.median()
    best = median.drop("native").idxmin()
    line = next(x for x in done.stdout.splitlines() if x.startswith("dp2"))
    assert f"ratio {median['native'] / median[best]:.3f} vs {best}" in line
    again = subprocess.run([sys.executable, "benchmarks/peers.py", "--summary", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and line.split("(of minima")[0] in again.stdout
