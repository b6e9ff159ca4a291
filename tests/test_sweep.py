"""Sweep runner: expansion and validation (pure), the bad-input corpus through the CLI, and real local
sweeps: failure taxonomy, a hung rank, the results store, resume after the sweep process is SIGKILLed."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.config import RunConfig
from bench.results import Status, skipped_row
from bench.sweep.spec import SweepError, expand, load_sweep, parse_sweep
from bench.results.store import SCHEMA_VERSION, load_results

ROOT = Path(__file__).resolve().parents[1]
BENCH = str(Path(sys.executable).parent / "bench")  # the installed entry point
BAD = sorted((ROOT / "tests" / "bad_sweeps").glob("*.yaml"))


def _spec(**data):
    return parse_sweep(data, "test.yaml")


# --- expansion (pure) -------------------------------------------------------------------------------------

def test_grid_backend_blocks_dp_auto_and_skipped_reasons():
    spec = _spec(world_size=4, base={"steps": 2}, grid={"backend": ["native", "ddp", "deepspeed"], "tp": [1, 2],
                                                           "dp": "auto"},
                 backends={"deepspeed": {"zero": [0, 3]}}, deepspeed={"zero_optimization": {"overlap_comm": False}})
    exp = expand(spec)
    # native: tp 1, 2 · ddp: tp 1 (tp 2 skipped) · deepspeed: zero 0, 3 × tp 1 (tp 2: whatever its check says)
    by_backend = {}
    for cfg in exp.runs:
        by_backend.setdefault(cfg.backend, []).append(cfg)
    assert sorted((c.tp, c.dp) for c in by_backend["native"]) == [(1, 4), (2, 2)]
    assert [(c.tp, c.dp) for c in by_backend["ddp"]] == [(1, 4)]
    assert {c.zero for c in by_backend["deepspeed"]} == {0, 3}
    assert all(c.ds_set == ("zero_optimization.overlap_comm=false",) for c in by_backend["deepspeed"])
    assert all(c.ds_set == () and c.zero == 0 for c in by_backend["native"] + by_backend["ddp"])
    assert all(c.steps == 2 and c.world == 4 for c in exp.runs)
    ddp_tp2 = [r for r in exp.skipped if r["backend"] == "ddp"]
    assert len(ddp_tp2) == 1 and "data parallel only" in ddp_tp2[0]["error"] and ddp_tp2[0]["status"] == "skipped"
    assert len(exp.runs) + len(exp.skipped) == 2 + 2 + 4


def test_zip_exclude_repeats_and_duplicates():
    spec = _spec(grid={"dp": [1, 2]}, zip=[{"micro_batch": [1, 2, 4], "micro_batches": [8, 4, 2]}],
                 exclude=[{"dp": 2, "micro_batch": [1, 4]}], repeats=2)
    exp = expand(spec)
    pairs = sorted({(c.dp, c.micro_batch, c.micro_batches) for c in exp.runs})
    assert pairs == [(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 2, 4)]
    assert exp.excluded == 2 * 2 and len(exp.runs) == 4 * 2
    assert {c.repeat for c in exp.runs} == {0, 1}
    assert len({c.run_id for c in exp.runs}) == 8 and len({c.config_id for c in exp.runs}) == 4
    dup = expand(_spec(grid={"backend": ["native", "native"]}))
    assert len(dup.runs) == 1 and dup.duplicates == 1


def test_dp_auto_that_does_not_divide_is_skipped_with_reason():
    exp = expand(_spec(world_size=4, grid={"tp": [1, 3], "dp": "auto"}))
    assert [c.dp for c in exp.runs] == [4]
    assert exp.skipped[0]["error"] == "dp: auto: world_size (4) is not divisible by tp (3) × pp (1) = 3"
    assert exp.skipped[0]["dp"] is None


def test_model_preset_with_overrides_and_world_size_axis():
    exp = expand(_spec(model={"preset": "tiny", "layers": 8}, world_size=[1, 2], grid={"pp": [1, 2], "dp": "auto"}))
    assert sorted((c.world, c.pp, c.dp) for c in exp.runs) == [(1, 1, 1), (2, 1, 2), (2, 2, 1)]
    assert all(c.model_config.layers == 8 for c in exp.runs)


def test_a_list_in_the_model_block_is_an_axis_and_misfits_are_skipped_rows():
    exp = expand(_spec(model={"preset": "tiny", "layers": 2, "kv_heads": [1, 2, 3, 4]}, world_size=2,
                       grid={"tp": [2], "dp": "auto"}))
    assert sorted(c.model_overrides for c in exp.runs) == [("layers=2", "kv_heads=2"), ("layers=2", "kv_heads=4")]
    assert all(c.model_config.layers == 2 for c in exp.runs)
    reasons = sorted(row["error"] for row in exp.skipped)
    assert "kv_heads (1) is not divisible by tp (2)" in reasons[0] + reasons[1]
    assert any("divide model.heads (4)" in r for r in reasons)
    for bad, where in (({"kv_heads": []}, "model.kv_heads"), ({"kv_heads": [2, "two"]}, r"model.kv_heads\[1\]"),
                       ({"kv_head": [2]}, "model.kv_head")):
        with pytest.raises(SweepError, match=where):
            _spec(model={"preset": "tiny", **bad}, grid={"tp": [1]})


def test_example_sweeps_expand():
    quick = expand(load_sweep(ROOT / "sweeps" / "quickstart.yaml"))
    assert {c.backend for c in quick.runs} == {"native", "ddp", "fsdp", "deepspeed"}
    assert all(c.model == "tiny" and c.global_batch == 8 for c in quick.runs) and quick.skipped
    assert {(c.world, c.tp, c.pp, c.dp) for c in quick.runs} == {(4, 1, 1, 4), (4, 1, 2, 2), (4, 2, 1, 2),
                                                                 (4, 2, 2, 1), (1, 1, 1, 1)}  # + the reference
    paper = expand(load_sweep(ROOT / "sweeps" / "paper-3d.yaml"))
    assert sorted((c.tp, c.pp) for c in paper.runs) == [(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)]
    assert all(c.world == 64 and c.dp == 64 // (c.tp * c.pp) for c in paper.runs)


def test_runs_list_explicit_configs_crossed_with_the_grid():
    exp = expand(_spec(base={"steps": 2}, grid={"backend": ["native", "ddp"]},
                       runs=[{"dp": 2}, {"pp": 2, "dp": 1, "schedule": "gpipe"}]))
    assert [(c.backend, c.pp, c.dp, c.schedule) for c in exp.runs] == [
        ("native", 1, 2, "1f1b"), ("native", 2, 1, "gpipe"), ("ddp", 1, 2, "1f1b")]
    assert "data parallel only" in exp.skipped[0]["error"]  # ddp pp 2: a skipped row, as from a grid
    alone = expand(_spec(runs=[{"tp": 2, "dp": 1}, {"dp": 2}]))  # no grid: exactly the runs, in order
    assert [(c.tp, c.dp) for c in alone.runs] == [(2, 1), (1, 2)]


# --- prune: the analytic model skips configs before anything launches (bench/sweep/prune.py) ------------

def _planned(tmp_path, launcher="local", **data):
    from bench.sweep.runner import make_launcher, plan
    spec = _spec(**data)
    return plan(spec, make_launcher(spec, tmp_path, launcher))


def test_prune_slower_than_best_skips_with_the_predicted_figures(tmp_path):
    from bench.analysis.estimate import predict_row
    exp = _planned(tmp_path, world_size=2, base={"device": "cpu", "dtype": "fp32"},
                         grid={"tp": [1, 2], "dp": "auto"}, zip=[{"micro_batch": [1, 2], "micro_batches": [4, 2]}],
                         prune={"slower_than_best": 2.0})
    unpruned = expand(_spec(world_size=2, base={"device": "cpu", "dtype": "fp32"}, grid={"tp": [1, 2], "dp": "auto"},
                            zip=[{"micro_batch": [1, 2], "micro_batches": [4, 2]}]))
    tps = {c.run_id: predict_row(c, "cpu")["pred_tokens_per_s"] for c in unpruned.runs}
    best = max(tps.values())
    slow = {i for i, t in tps.items() if best / t > 2.0}
    assert slow and len(slow) < len(tps)  # tp 2 on CPU: every tp collective on the critical path
    assert {r["run_id"] for r in exp.skipped} == slow == exp.pruned  # ids as without prune: resume finds them
    assert {c.run_id for c in exp.runs} == set(tps) - slow
    for row in exp.skipped:
        assert row["status"] == "skipped" and row["tp"] == 2
        pred = predict_row(RunConfig(**{k: row[k] for k in ("model", "tp", "dp", "micro_batch", "micro_batches",
                                                            "device", "dtype")}), "cpu")
        assert row["error"].startswith(f"pruned: predicted {pred['pred_step_time_s'] * 1e3:.3g} ms/step, "
                                       f"{pred['pred_tokens_per_s']:,.0f} tokens/s on cpu")
        assert f"{best / pred['pred_tokens_per_s']:.1f}× the best predicted time per token" in row["error"]
        assert "native tp=1 pp=1 dp=2" in row["error"] and row["error"].endswith("prune.slower_than_best = 2")
    assert set(exp.predictions) == set(tps)  # every run predicted, pruned or not


def test_prune_compares_time_per_token_across_global_batches(tmp_path):
    """pp 2 · dp 1 takes less time per step than dp 2 but does half the tokens: per token it is slower."""
    exp = _planned(tmp_path, world_size=2, base={"device": "cpu", "dtype": "fp32", "micro_batch": 4},
                         grid={"pp": [1, 2], "dp": "auto"}, prune={"slower_than_best": 1.5})
    preds = exp.predictions
    (kept,), (pruned,) = exp.runs, exp.skipped
    assert pruned["pp"] == 2 and preds[pruned["run_id"]].step_time_s < preds[kept.run_id].step_time_s
    assert preds[pruned["run_id"]].tokens_per_s * 1.5 < preds[kept.run_id].tokens_per_s


def test_prune_fit_uses_the_named_profile_memory(tmp_path):
    hw = tmp_path / "small-gpu.yaml"
    hw.write_text("name: small-gpu\npeak_flops: {fp32: 10T}\nmemory_bytes: 6MiB\nintra_node_bw: 10GB\n"
                  "inter_node_bw: 1GB\n")
    exp = _planned(tmp_path, base={"device": "cpu", "dtype": "fp32"},
                         zip=[{"micro_batch": [8, 1], "micro_batches": [1, 8]}], grid={"seed": [0]},
                         prune={"fit": True, "hardware": str(hw)})
    (kept,), (pruned,) = exp.runs, exp.skipped
    assert (kept.micro_batch, pruned["micro_batch"]) == (1, 8)
    peak = exp.predictions[pruned["run_id"]].peak_bytes
    assert peak > 6 * 2**20 > exp.predictions[kept.run_id].peak_bytes
    assert pruned["error"] == (f"pruned: predicted peak memory {peak / 2**20:,.1f} MiB per rank exceeds the 6.0 MiB "
                               "a rank has on small-gpu (one device's 6.0 MiB); prune.fit = true")
    # 6 MiB sits 1.41× below that peak: a fit rule 1.4× too lax would still prune it. At the edge the rule is
    # exact: a rank with one byte less than the peak is pruned, one with exactly the peak keeps its run.
    for memory, fits in ((peak - 1, False), (peak, True)):
        hw.write_text(f"name: small-gpu\npeak_flops: {{fp32: 10T}}\nmemory_bytes: {int(memory)}\n"
                      "intra_node_bw: 10GB\ninter_node_bw: 1GB\n")
        edge = _planned(tmp_path, base={"device": "cpu", "dtype": "fp32"},
                        zip=[{"micro_batch": [8, 1], "micro_batches": [1, 8]}], grid={"seed": [0]},
                        prune={"fit": True, "hardware": str(hw)})
        assert edge.predictions[pruned["run_id"]].peak_bytes == peak  # the profile's memory is no input of it
        assert edge.predictions[pruned["run_id"]].rank_memory == memory
        assert (pruned["run_id"] in edge.pruned) is not fits, \
            f"peak {peak:.0f} B on a rank with {memory:.0f} B: should be {'kept' if fits else 'pruned'}"
        assert {c.run_id for c in edge.runs} == {kept.run_id} | ({pruned["run_id"]} if fits else set())


def test_prune_on_cpu_shares_the_host_memory_and_unknown_gpus_warn(tmp_path):
    from bench.analysis.estimate import row_hardware
    hw = row_hardware("cpu")
    exp = _planned(tmp_path, world_size=2, base={"device": "cpu"}, grid={"dp": "auto"}, prune={"fit": True})
    (pred,) = exp.predictions.values()
    assert pred.rank_memory == hw.memory_bytes * hw.gpus_per_node / 2 and "shared by 2 rank(s)" in pred.memory_note
    assert exp.runs and not exp.skipped  # the tiny model fits
    gpu = _planned(tmp_path, "slurm", world_size=2, base={"device": "cuda"}, grid={"dp": "auto"},
                      prune={"fit": True, "slower_than_best": 2.0})
    assert gpu.runs and not gpu.pruned  # the slurm hosts' GPUs are unknown here: nothing pruned, and it says so
    assert any("no hardware profile for device cuda with the slurm launcher" in w for w in gpu.warnings)
    assert any("nothing is pruned by fit" in w for w in gpu.warnings)


def test_pruned_rows_never_block_a_later_unpruned_run(tmp_path):
    """In-process (debug launcher, world 1): a pruned run's skipped row is replaced by its measurement when
    the sweep runs again without prune (--resume), under the same id; pruning again keeps the measurement."""
    from bench.sweep.runner import prepare, run_sweep
    sweep = "name: prune-resume\nbase: {steps: 1, warmup: 0, device: cpu}\ngrid: {recompute: [none, full]}\n" \
            "launcher: debug\n"
    pruned = load_sweep(_write(tmp_path / "p.yaml", sweep + "prune: {slower_than_best: 1.05}\n"))
    first = run_sweep(prepare(pruned, tmp_path / "out"), progress=False)
    assert first.counts["ok"] == 1 and first.counts["skipped"] == 1
    (skipped,) = [r for r in first.rows if r["status"] == "skipped"]
    assert skipped["recompute"] == "full" and skipped["error"].startswith("pruned: predicted")
    full = load_sweep(_write(tmp_path / "f.yaml", sweep))
    again = run_sweep(prepare(full, tmp_path / "out"), resume=True, progress=False)
    assert again.resumed == 1 and [(r["run_id"], r["status"]) for r in again.rows] == [(skipped["run_id"], "ok")]
    third = run_sweep(prepare(pruned, tmp_path / "out"), resume=True, progress=False)
    assert third.rows == [] and third.resumed == 2
    assert set(load_results(tmp_path / "out").status) == {"ok"}


def test_dry_run_shows_every_prediction_and_the_pruned_reason(tmp_path):
    path = _write(tmp_path / "d.yaml", "world_size: 2\nbase: {device: cpu, dtype: fp32}\n"
                                       "grid: {tp: [1, 2], dp: auto}\nprune: {slower_than_best: 2.0}\n")
    done = subprocess.run([BENCH, "sweep", str(path), "--dry-run"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    assert "pred ms/step" in done.stdout and "pred tokens/s" in done.stdout and "pred peak MiB" in done.stdout
    assert "1 run(s) to launch, 1 skipped (1 pruned)" in done.stdout and "predicted on built-in cpu" in done.stdout
    assert "pruned: predicted" in done.stdout and "prune.slower_than_best = 2" in done.stdout
    spec = load_sweep(path)
    from bench.analysis.estimate import predict_row
    for cfg in expand(spec).runs:  # each run's predicted figures are in its line
        pred = predict_row(cfg, "cpu")
        line = next(ln for ln in done.stdout.splitlines() if cfg.run_id in ln)
        assert f"{pred['pred_step_time_s'] * 1e3:.3g}" in line and f"{pred['pred_tokens_per_s']:,.0f}" in line
        assert f"{pred['pred_total_bytes'] / 2**20:,.1f}" in line


# --- bad input: one clear message, exit 2, nothing launched -----------------------------------------------

def test_corpus_is_large_enough():
    assert len(BAD) >= 15


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_sweep_file_gives_one_clear_error(path, tmp_path, monkeypatch, capsys):
    expected = re.match(r"# expect: (.*)", path.read_text()).group(1)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench", "sweep", str(path), "--out", str(out)])
    from bench.cli import main
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert err.count("\n") == 0, err  # one line, no traceback
    assert err.startswith(f"error: {path}: "), err
    assert expected in err, err
    assert not out.exists()  # nothing launched, nothing written


def test_sweep_error_carries_file_key_and_problem():
    with pytest.raises(SweepError) as e:
        parse_sweep({"grid": {"tp": ["x"]}}, "f.yaml")
    assert (e.value.source, e.value.path) == ("f.yaml", "grid.tp[0]")


# --- real local sweeps ------------------------------------------------------------------------------------

def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """One real sweep on world 2: ok, a hung rank, a raising rank, ok again; plus a skipped combination."""
    from bench.sweep.runner import prepare, run_sweep
    tmp = tmp_path_factory.mktemp("local")
    spec = load_sweep(_write(tmp / "mixed.yaml", """
name: mixed
world_size: 2
base: {steps: 2, warmup: 1}
grid:
  tp: [1, 3]
  dp: auto
zip:
  - {fault: [none, hang, raise], timeout_s: [120, 8, 120]}
exclude: [{tp: 3, fault: [hang, raise]}]
"""))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    outcome = run_sweep(prepare(spec, tmp / "out"), progress=False)
    return {"outcome": outcome, "wall": time.monotonic() - t0, "before": before, "out": tmp / "out"}


def test_failure_taxonomy_and_the_sweep_goes_on(local_sweep):
    df = load_results(local_sweep["out"])
    status = {row.fault: row.status for row in df.itertuples() if row.status != "skipped"}
    assert status == {"none": "ok", "hang": "timeout", "raise": "failed"}
    skipped = df[df.status == "skipped"]
    assert len(skipped) == 1 and "not divisible by tp (3)" in skipped.error.iloc[0]
    failed = df[df.status == "failed"].iloc[0]
    assert failed.failed_rank == 1 and "injected fault" in failed.error
    assert set(df.columns) >= {"SCHEMA_VERSION", "sweep", "launcher", "wall_s", "git_sha", "hostname", "time",
                               "torch_version", "deepspeed_version", "submitit_version", "slurm_job_id"}
    assert (df.SCHEMA_VERSION == SCHEMA_VERSION).all() and (df.sweep == "mixed").all()
    assert (local_sweep["out"] / "results.parquet").is_file()


def test_hung_rank_times_out_within_its_limit_and_leaves_no_process(local_sweep):
    df = load_results(local_sweep["out"])
    hung = df[df.fault == "hang"].iloc[0]
    assert hung.status == "timeout" and "timeout_s=8" in hung.error
    assert hung.wall_s <= 8 + 6  # detected at the limit (warm pool), then killed
    left = {p.pid for p in psutil.Process().children(recursive=True)} - local_sweep["before"]
    alive = [p for p in map(_proc, left) if p is not None and p.status() != psutil.STATUS_ZOMBIE
             and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's one helper, not a rank
    assert not alive, [p.cmdline() for p in alive]


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def test_existing_output_needs_resume(local_sweep):
    from bench.sweep.runner import prepare, run_sweep
    spec = load_sweep(local_sweep["out"] / "sweep.yaml")
    with pytest.raises(ValueError, match="--resume"):
        run_sweep(prepare(spec, local_sweep["out"]), progress=False)
    again = run_sweep(prepare(spec, local_sweep["out"]), resume=True, progress=False)  # nothing left to run
    assert again.resumed == 3 and sum(again.counts.values()) == 1  # the skipped row is rewritten


def test_load_results_rejects_foreign_empty_and_other_versions(local_sweep, tmp_path):
    import pandas as pd
    df = load_results(local_sweep["out"] / "results.parquet")
    assert len(df) == 4 and set(df.status) <= set(Status)
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "foreign.parquet")
    with pytest.raises(ValueError, match="not a parabench results table"):
        load_results(tmp_path / "foreign.parquet")
    df.iloc[:0].to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="no result rows"):
        load_results(tmp_path / "empty.parquet")
    df.assign(SCHEMA_VERSION=SCHEMA_VERSION + 1).to_parquet(tmp_path / "future.parquet")
    with pytest.raises(ValueError, match="schema version"):
        load_results(tmp_path / "future.parquet")
    with pytest.raises(ValueError, match="no results"):
        load_results(tmp_path)


def test_resume_after_the_sweep_process_is_killed(tmp_path):
    """SIGKILL `bench sweep` while a run is going; --resume reruns only what has no row: none lost, none twice."""
    sweep = _write(tmp_path / "slow.yaml", """
name: slow
base: {steps: 3, warmup: 1, fault: "sleep:250", timeout_s: 60}
grid:
  seed: [0, 1, 2, 3, 4]
""")
    out = tmp_path / "out"
    cmd = [BENCH, "sweep", str(sweep), "--out", str(out), "--no-progress", "--no-calibrate"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    runs = out / "runs"
    deadline = time.monotonic() + 120
    while len(list(runs.glob("*.json"))) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no run finished in 120 s"
        time.sleep(0.1)
    time.sleep(0.5)  # the third run is going now
    ranks = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = {p.name: p.read_text() for p in runs.glob("*.json")}
    assert 2 <= len(first) < 5
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, "rank processes outlived the killed sweep"

    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(p.read_text()) for p in runs.glob("*.json")]
    assert len(rows) == 5 and len({r["run_id"] for r in rows}) == 5
    assert sorted(r["seed"] for r in rows) == [0, 1, 2, 3, 4] and {r["status"] for r in rows} == {"ok"}
    for name, text in first.items():  # finished runs were not rerun
        assert (runs / name).read_text() == text
    assert f"{len(first)} resumed" in done.stdout
    assert len(load_results(out)) == 5


def test_results_command_rebuilds_the_parquet(local_sweep):
    (local_sweep["out"] / "results.parquet").unlink()
    done = subprocess.run([BENCH, "results", str(local_sweep["out"]), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ok 1" in done.stdout and "timeout 1" in done.stdout and "skipped 1" in done.stdout
    assert (local_sweep["out"] / "results.parquet").is_file()


def test_a_row_write_cut_off_half_way_shows_no_partial_row(tmp_path, monkeypatch):
    """The store writes to a temporary name and renames: a reader listing runs/ while a row is being written
    (or after the writer died half-way) sees the previous row or none, never a truncated one."""
    from bench.results import skipped_row
    from bench.results.store import ResultStore, read_row
    store = ResultStore(tmp_path / "out")
    old = store.write(skipped_row(RunConfig(seed=0), "first attempt"))
    seen = []

    def dump_half_then_die(obj, f, **kw):  # the writer killed (disk full, SIGKILL) mid-row
        text = json.dumps(obj, **kw)
        f.write(text[:len(text) // 2])
        f.flush()
        seen.append({p.name: read_row(p) for p in store.runs.glob("*.json")})  # a reader, right now
        raise OSError("No space left on device")

    monkeypatch.setattr(json, "dump", dump_half_then_die)
    for row in (skipped_row(RunConfig(seed=0), "the rerun"), skipped_row(RunConfig(seed=1), "a new run")):
        with pytest.raises(OSError, match="No space"):
            store.write(row)
    monkeypatch.undo()
    assert len(seen) == 2
    for snapshot in seen:  # mid-write: only the old, whole row
        assert snapshot == {f"{old['run_id']}.json": (old, None)}, snapshot
    assert store.rows() == [old] and store.set_aside() == []  # and after: nothing corrupt to move aside


def test_dry_run_prints_the_table_and_counts():
    done = subprocess.run([BENCH, "sweep", "sweeps/paper-3d.yaml", "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "16 run(s) to launch, 0 skipped" in done.stdout and "launcher slurm" in done.stdout
    assert not (ROOT / "results" / "paper-3d").exists()


def test_resume_skips_stored_runs_and_retry_failed_reruns_only_the_failed(tmp_path):
    """In-process (debug launcher, world 1): resume launches nothing stored; --retry-failed reruns failures."""
    from bench.sweep.runner import prepare, run_sweep
    saved = dict(os.environ)
    try:
        spec = load_sweep(_write(tmp_path / "d.yaml", """
name: debug-retry
base: {steps: 1, warmup: 0}
grid: {seed: [0, 1], fault: [none, raise]}
launcher: debug
"""))
        first = run_sweep(prepare(spec, tmp_path / "out"), progress=False)
        assert first.counts["ok"] == 2 and first.counts["failed"] == 2
        failed_ids = {r["run_id"] for r in first.rows if r["status"] == "failed"}
        again = run_sweep(prepare(spec, tmp_path / "out"), resume=True, progress=False)
        assert again.resumed == 4 and again.rows == []
        retry = run_sweep(prepare(spec, tmp_path / "out"), retry_failed=True, progress=False)
        assert retry.resumed == 2 and {r["run_id"] for r in retry.rows} == failed_ids
        assert len(load_results(tmp_path / "out")) == 4
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_cp_is_an_axis_with_dp_auto_and_a_column_where_used():
    from bench.sweep.runner import dry_run_table, summary_table
    exp = expand(_spec(world_size=4, grid={"backend": ["native", "deepspeed", "ddp"], "cp": [1, 2],
                                          "cp_comm": ["ring", "ulysses"], "dp": "auto"}))
    runs = {(c.backend, c.cp, c.cp_comm, c.dp) for c in exp.runs}
    assert runs == {("native", 1, None, 4), ("native", 2, "ring", 2), ("deepspeed", 1, None, 4),
                    ("deepspeed", 2, "ulysses", 2), ("ddp", 1, None, 4)}  # cp 1: cp_comm means nothing (one run)
    reasons = {(r["backend"], r["cp_comm"]): r["error"] for r in exp.skipped}
    assert "runs cp_comm ring, not ulysses" in reasons["native", "ulysses"]
    assert "has no context parallel" in reasons["ddp", "ring"]
    mixed = expand(_spec(runs=[{"cp": 3}, {"backend": "deepspeed", "tp": 2, "cp": 4}, {"cp": 2}]))
    assert [c.cp for c in mixed.runs] == [2]  # a misfit is a skipped row with RunConfig's reason
    assert [r["error"].split(";")[0] for r in mixed.skipped] == [
        "cp (3) needs seq (32) divisible by 2 × cp = 6 (each rank holds two equal chunks, zig-zag)",
        "cp_comm ulysses needs model heads (4) divisible by tp × cp = 8"]
    odd = expand(_spec(world_size=4, grid={"cp": [3], "dp": "auto"}))
    assert odd.skipped[0]["error"] == "dp: auto: world_size (4) is not divisible by tp (1) × cp (3) × pp (1) = 3"

    def header(table):
        return [c.header for c in table.columns]
    plain = expand(_spec(world_size=4, grid={"tp": [1, 2], "dp": "auto"}))
    assert header(dry_run_table(_spec(grid={"tp": [1]}), plain)[0])[:7] == ["#", "run_id", "backend", "world_size",
                                                                              "tp", "pp", "dp"]
    every_cp = expand(_spec(world_size=4, base={"cp": 2}, grid={"tp": [1, 2], "dp": "auto"}))
    assert header(dry_run_table(_spec(grid={"tp": [1]}), every_cp)[0])[2:8] == ["backend", "world_size", "tp", "cp",
                                                                                  "pp", "dp"]
    rows = [{**c.to_row(), "status": "skipped", "error": "x"} for c in every_cp.runs]
    assert header(summary_table(rows, "t"))[:6] == ["backend", "world_size", "tp", "cp", "pp", "dp"]


def test_the_summary_is_one_line_per_run():
    """Each row's reason is cut to its first clause in the terminal; the row keeps the whole text."""
    from rich.console import Console

    from bench.sweep.runner import first_clause, summary_table
    reason = ("backend deepspeed: zero=3 is incompatible with pipeline parallel (pp=2); DeepSpeed's pipeline "
              "engine supports zero 0 and 1")
    rows = [skipped_row(RunConfig(model="tiny", backend="deepspeed", zero=3, dp=1, seed=s), reason) for s in range(3)]
    table = summary_table(rows, "t", 100)
    console = Console(record=True, width=table.width)
    console.print(table)
    lines = [ln for ln in console.export_text().splitlines() if "skipped" in ln]
    assert len(lines) == 3 and all("zero=3 is incompatible" in ln and "DeepSpeed's" not in ln for ln in lines)
    assert first_clause(reason) == "backend deepspeed: zero=3 is incompatible with pipeline parallel (pp=2)"
    assert first_clause("rank 1 failed:\nTraceback …\nRuntimeError: injected fault (fault=raise)") == \
        "RuntimeError: injected fault (fault=raise)"
    assert first_clause("cp (3) needs seq (32) divisible by 2 × cp = 6; pick seq or cp") == \
        "cp (3) needs seq (32) divisible by 2 × cp = 6"
    assert first_clause("x" * 200).endswith("…") and len(first_clause("x" * 200)) == 80
    assert rows[0]["error"] == reason
