"""bench compare: the statistics by hand, then the gate on result sets from real runs."""
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from bench.report.compare import compare, judge, prediction_mismatches
from support.report_runs import result_sets


# --- the statistics, fed by hand -----------------------------------------------------------------
def test_exact_metrics_must_be_equal():
    assert judge([930304.0], [930304.0], exact=True).verdict == "equal"
    changed = judge([930304.0, 930304.0], [930305.0], exact=True)
    assert changed.verdict == "changed" and changed.change == pytest.approx(1 / 930304)


def test_single_runs_compare_by_threshold_alone():
    assert judge([100.0], [104.9], exact=False, threshold=0.05).verdict == "ok"  # step time 4.9 % slower
    assert judge([100.0], [105.1], exact=False, threshold=0.05).verdict == "regressed"
    assert judge([100.0], [94.0], exact=False, threshold=0.05).verdict == "improved"
    assert judge([100.0], [110.0], exact=False, threshold=0.20).verdict == "ok"  # per-metric override


def test_higher_is_better_flips_the_direction():
    assert judge([1000.0], [900.0], exact=False, higher_is_better=True).verdict == "regressed"  # tokens/s down
    assert judge([1000.0], [1100.0], exact=False, higher_is_better=True).verdict == "improved"


def test_regression_must_exceed_the_noise_of_the_repeats():
    # baseline repeats spread 80..120 (noise 40): a 20 % slower median is within the noise
    noisy = judge([80.0, 100.0, 120.0], [120.0, 121.0], exact=False, threshold=0.05)
    assert noisy.verdict == "ok" and noisy.noise == 40.0 and noisy.limit == 40.0
    # tight repeats: the same 20 % is a regression
    tight = judge([99.0, 100.0, 101.0], [120.0, 121.0], exact=False, threshold=0.05)
    assert tight.verdict == "regressed" and tight.limit == pytest.approx(5.0)
    # the current side's spread counts too
    assert judge([100.0], [90.0, 130.0, 160.0], exact=False).verdict == "ok"


def test_small_absolute_changes_stay_under_the_floor():
    assert judge([0.004], [0.009], exact=False, floor=0.02).verdict == "ok"  # bubble +125 %, +0.5 points
    assert judge([0.10], [0.15], exact=False, floor=0.02).verdict == "regressed"


def test_missing_values_are_no_data_not_a_verdict():
    assert judge([float("nan")], [1.0], exact=False).verdict == "no data"
    assert judge([], [1.0], exact=True).verdict == "no data"


def test_fp32_loss_is_gated_exactly_mixed_precision_loss_is_not():
    """fp32 losses are deterministic here: a change beyond 1e-6 relative (a learning rate 1 % off moves
    the 3-step loss by ~5e-5) fails the gate; bf16 runs (CUDA atomics, autocast) are not gated on loss."""
    def rows(loss, dtype="fp32"):
        return pd.DataFrame([{"run_id": "a", "config_id": "a", "status": "ok", "backend": "native", "tp": 1,
                              "pp": 1, "dp": 1, "dtype": dtype, "loss_first": 5.5, "loss_last": loss}])
    verdicts = lambda b, c: {r["metric"]: r["verdict"] for r in compare(b, c).rows}  # noqa: E731
    assert verdicts(rows(5.476713), rows(5.476713 * (1 + 5e-7)))["loss_last"] == "equal"
    assert verdicts(rows(5.476713), rows(5.476713 * (1 + 5e-5)))["loss_last"] == "changed"
    assert "loss_last" not in verdicts(rows(5.47, "bf16-mixed"), rows(5.48, "bf16-mixed"))


def test_new_missing_and_failed_configs():
    rows = lambda ids, status="ok": pd.DataFrame(  # noqa: E731
        [{"run_id": i, "config_id": i, "status": status, "backend": "native", "tp": 1, "pp": 1, "dp": 1,
          "step_time_s": 0.1, "params": 10.0, "error": None if status == "ok" else "boom"} for i in ids])
    result = compare(rows(["a", "b"]), pd.concat([rows(["b"]), rows(["c"])]))
    assert [c["config_id"] for c in result.new] == ["c"] and [c["config_id"] for c in result.missing] == ["a"]
    assert not result.regressed
    failed = compare(rows(["a"]), rows(["a"], status="failed"))
    assert failed.regressed and failed.rows[0]["verdict"] == "failed" and failed.rows[0]["error"] == "boom"
    gone = compare(rows(["a"]), rows(["a"]).drop(columns="params"))  # an exact metric no longer measured
    assert gone.regressed and [r["verdict"] for r in gone.failures] == ["missing"]
    added = compare(rows(["a"]).drop(columns="params"), rows(["a"]))  # a new metric: nothing to compare
    assert not added.regressed
    skipped = compare(rows(["a"]), rows(["a"], status="skipped"))
    assert not skipped.regressed and skipped.rows[0]["verdict"] == "skipped"
    with pytest.raises(ValueError, match="noisy metrics are"):
        compare(rows(["a"]), rows(["a"]), thresholds={"step_tim_s": 0.1})


def test_prediction_check_compares_each_row_with_itself():
    row = {"run_id": "a", "config_id": "a", "status": "ok", "backend": "deepspeed", "tp": 2, "pp": 2, "dp": 1,
           "zero": 1, "comm_bytes_pp": 33064.0, "pred_comm_bytes_pp": 33064.0, "comm_ops_pp": 17.0,
           "pred_comm_ops_pp": 17.0}
    assert prediction_mismatches(pd.DataFrame([row])) == []
    wrong = prediction_mismatches(pd.DataFrame([{**row, "pred_comm_bytes_pp": 65548.0, "pred_comm_ops_pp": 10.0}]))
    assert len(wrong) == 2 and "pred_comm_bytes_pp = 65548, comm_bytes_pp = 33064" in wrong[0]
    failed = {**row, "status": "failed", "pred_comm_ops_pp": 10.0}  # nothing measured: nothing to check
    assert prediction_mismatches(pd.DataFrame([failed])) == []


@pytest.mark.parametrize("dim, config_fields", [("cp", ("cp", "cp_comm")), ("ep", ("ep",))])
def test_an_older_set_without_a_dimension_compares_equal_to_a_new_one(tmp_path, dim, config_fields):
    """The committed baseline predates cp and ep: its measured rows read comm_*_cp = comm_*_ep = 0 (size 1 moved
    nothing), as a new run of the same config writes them, so the gate sees equal, never `no data`; a real
    change fails."""
    from pathlib import Path
    from bench.results import comm_columns
    from bench.results.store import ResultStore, load_results
    old = load_results(Path(__file__).resolve().parents[1] / "results" / "baselines" / "quickstart")
    dim_columns = comm_columns(dims=(dim,))
    ok = old["status"] == "ok"
    assert (old.loc[ok, dim_columns] == 0).all().all() and old.loc[~ok, dim_columns].isna().all().all()
    new = ResultStore(tmp_path / "new")  # the same rows as runs/*.json of a new parabench: the columns written
    for row in old.to_dict("records"):
        new.write({k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()})
    comparison = compare(old, load_results(tmp_path / "new"), exact_only=True)
    dim_rows = [r for r in comparison.rows if r["metric"] in dim_columns]
    assert dim_rows and {r["verdict"] for r in dim_rows} == {"equal"} and not comparison.regressed
    moved = old.assign(**{f"comm_bytes_{dim}": old[f"comm_bytes_{dim}"].where(~ok, 64.0)})
    assert compare(old, moved, exact_only=True).regressed
    rows = [{k: v for k, v in r.items() if not k.endswith(f"_{dim}") and k not in config_fields}
            for r in new.rows()]  # runs/*.json of a parabench before the dimension: read through the same rule
    older = tmp_path / "older" / "runs"
    older.mkdir(parents=True)
    for row in rows:
        (older / f"{row['run_id']}.json").write_text(json.dumps(row))
    again = load_results(tmp_path / "older")
    assert (again.loc[again.status == "ok", dim_columns] == 0).all().all() and set(again[dim]) == {1}


# --- the gate on real runs -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sets(pools, tmp_path_factory):
    return result_sets(pools, tmp_path_factory.mktemp("runs"))


def test_cli_entry_point_runs_compare(sets):
    """Once through the installed entry point in a fresh interpreter, as a user or CI calls it."""
    out = subprocess.run([sys.executable, "-c", "from bench.cli import main; main()", "compare",
                          str(sets["baseline"]), str(sets["baseline"]), "--exact-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no regression" in out.stdout, out.stdout + out.stderr


def test_identical_result_sets_pass(sets, bench):
    out = bench("compare", sets["baseline"], sets["baseline"])
    assert out.returncode == 0, out.stdout
    assert "no regression" in out.stdout and "REGRESSION" not in out.stdout


def test_fresh_rerun_has_equal_exact_metrics(sets, bench):
    out = bench("compare", sets["baseline"], sets["rerun"], "--exact-only", "--json")
    assert out.returncode == 0, out.stdout
    report = json.loads(out.stdout)
    exact = [r for r in report["rows"] if r["kind"] == "exact"]
    assert exact and all(r["verdict"] == "equal" for r in exact)
    assert {r["metric"] for r in exact} >= {"params", "comm_bytes_dp", "persistent_bytes"}
    assert [c["label"] for c in report["missing"]] == ["native tp1·pp1·dp2 fault=raise"]  # listed, not failed


def test_planted_slowdown_is_a_regression(sets, bench):
    out = bench("compare", sets["baseline"], sets["slowed"], "--json")
    assert out.returncode == 1, out.stdout
    report = json.loads(out.stdout)
    slow = {(r["label"], r["metric"]): r for r in report["rows"] if r["verdict"] == "regressed"}
    # 400 ms of sleep per step: beyond 5 % and beyond the repeats' spread even on a loaded machine
    assert ("native tp1·pp1·dp1 m2", "step_time_s") in slow and ("native tp1·pp1·dp2", "step_time_s") in slow
    assert slow[("native tp1·pp1·dp1 m2", "step_time_s")]["current"] > 0.400
    assert any(metric == "tokens_per_s" for _, metric in slow)
    assert all(r["verdict"] == "equal" for r in report["rows"] if r["kind"] == "exact")
    # CI mode: timing is reported, not gated
    gated = bench("compare", sets["baseline"], sets["slowed"], "--exact-only", "--markdown")
    assert gated.returncode == 0 and "regressed" in gated.stdout and "✅" in gated.stdout


def test_exact_metric_mismatch_fails_even_in_exact_only_mode(sets, bench):
    out = bench("compare", sets["baseline"], sets["changed"], "--exact-only", "--markdown")
    assert out.returncode == 1, out.stdout
    assert "❌" in out.stdout and "| native tp1·pp1·dp2 | params |" in out.stdout
    table = bench("compare", sets["baseline"], sets["changed"], "--exact-only")
    assert table.returncode == 1 and "changed" in table.stdout and "comm_bytes_dp" in table.stdout


def test_check_predictions_on_real_runs(sets, bench):
    out = bench("compare", sets["baseline"], sets["rerun"], "--exact-only", "--check-predictions")
    assert out.returncode == 0 and "predicted communication = measured" in out.stderr, out.stdout + out.stderr


def test_thresholds_from_flags(sets, bench):
    out = bench("compare", sets["baseline"], sets["slowed"], "--metric-threshold", "step_time_s=100000%",
                "--metric-threshold", "tokens_per_s=1.0", "--json")
    rows = json.loads(out.stdout)["rows"]
    assert not [r for r in rows if r["metric"] in ("step_time_s", "tokens_per_s") and r["verdict"] == "regressed"]
    bad = bench("compare", sets["baseline"], sets["slowed"], "--metric-threshold", "step_time_s")
    assert bad.returncode == 2 and "METRIC=FRACTION" in bad.stderr + bad.stdout


def test_update_baseline_then_compare(sets, tmp_path, bench):
    base = tmp_path / "quick"
    out = bench("compare", base, sets["rerun"], "--update-baseline")
    assert out.returncode == 0 and (base / "results.parquet").exists()
    meta = json.loads((base / "baseline.json").read_text())
    assert meta["machine_kind"].startswith("cpu") and meta["runs"] == 3
    assert bench("compare", base, sets["rerun"]).returncode == 0
    # a baseline from another machine kind: said clearly, timing not gated, exact metrics still are
    meta["machine_kind"] = "NVIDIA H100 80GB HBM3 x86_64"
    (base / "baseline.json").write_text(json.dumps(meta))
    other = bench("compare", base, sets["slowed"])
    assert other.returncode == 0 and "measured on 'NVIDIA H100" in other.stdout and "not gated" in other.stdout
    assert bench("compare", base, sets["changed"]).returncode == 1


@pytest.mark.parametrize("case", ["missing", "empty", "foreign", "schema", "meta-schema", "no-parquet"])
def test_bad_input_is_one_clear_line(case, sets, tmp_path, bench):
    base, current = sets["baseline"], sets["rerun"]
    if case == "missing":
        base, expect = tmp_path / "nope", "not found"
    elif case == "empty":
        pd.DataFrame().to_parquet(tmp_path / "empty.parquet")
        current, expect = tmp_path / "empty.parquet", "no result rows"
    elif case == "foreign":
        pd.DataFrame({"a": [1, 2]}).to_parquet(tmp_path / "foreign.parquet")
        current, expect = tmp_path / "foreign.parquet", "not a parabench results table"
    elif case == "schema":
        old = tmp_path / "old"
        shutil.copytree(sets["rerun"], old)
        for f in (old / "runs").glob("*.json"):
            f.write_text(json.dumps({**json.loads(f.read_text()), "SCHEMA_VERSION": 0}))
        current, expect = old, "schema version"
    elif case == "meta-schema":
        base = tmp_path / "b"
        assert bench("compare", base, sets["rerun"], "--update-baseline").returncode == 0
        meta = json.loads((base / "baseline.json").read_text())
        (base / "baseline.json").write_text(json.dumps({**meta, "schema_version": 0}))
        expect = "regenerate it"
    else:
        base = tmp_path / "b2"
        assert bench("compare", base, sets["rerun"], "--update-baseline").returncode == 0
        (base / "results.parquet").unlink()
        expect = "lacks results.parquet"
    out = bench("compare", base, current)
    assert out.returncode == 2, out.stdout + out.stderr
    assert expect in out.stderr and out.stderr.startswith("error:") and len(out.stderr.strip().splitlines()) == 1
