"""The time model: its terms, the published-runs budget, the calibrated profile and its bad inputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.analysis.estimate import estimate, predict_row
from bench.analysis.hardware import get_hardware, load_profiles
from bench.analysis.time_model import SUITE_OPS, TERMS
from bench.conventions import dtype_key
from bench.analysis.validate import PUBLISHED, PublishedError, load_published, validate
from bench.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def bench(*args, env=None):
    out = subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)
    return out.returncode, out.stdout + out.stderr


# --- published runs -------------------------------------------------------------------------------
KORTHIKANTI_SOURCE = "Korthikanti et al. 2022 (arXiv:2205.05198)"
SOURCES = (KORTHIKANTI_SOURCE, "Narayanan et al. 2021 (arXiv:2104.04473)",
           "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783)",
           "torchtitan, pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e",
           "Rajbhandari et al. 2019, ZeRO (arXiv:1910.02054)")
# The mean |error| per source and side the model had when these entries came in (2026-12-02), rounded up:
# a budget that fails a change making them worse, never one fitted to them (issue 23's targets are
# ≤ 8 % per source; only Korthikanti's and the ZeRO paper's reach them today).
TODAY = {SOURCES[1]: {"time": 0.59}, SOURCES[2]: {"time": 0.35}, SOURCES[3]: {"time": 0.39, "memory": 0.45},
         SOURCES[4]: {"memory": 0.003}}


def test_korthikanti_error_budget():
    """Table 5 times and Figure 1 memory. Issue 11's target for the times: mean |error| below Calculon's
    3.65 %, none above 8 %. Datasheet figures and the published matmul measurements reach 3.66 % and
    6.9 % (every time within 7 %); this budget keeps them there. Memory: every entry within 5 %."""
    s = validate()["by_source"][KORTHIKANTI_SOURCE]
    assert s["time"]["entries"] == 8 and s["time"]["mean_abs_error"] < 0.0365, s["time"]
    assert s["time"]["max_abs_error"] <= 0.07, s["time"]
    assert s["memory"]["entries"] == 12 and s["memory"]["max_abs_error"] <= 0.05, s["memory"]


def test_every_entry_predicts_or_is_refused_with_its_reason():
    result = validate()
    assert len(result["entries"]) >= 50 and {r["source"] for r in result["entries"]} == set(SOURCES)
    for r in result["entries"]:
        assert r["source"] and r["where"], r
        assert (r["refused"] is None) == (r["error"] is not None), r
        if r["refused"] is None:  # the error is on the time or bytes, whatever unit the source printed
            assert r["predicted"] > 0 and r["error"] == pytest.approx(r["predicted_base"] / r["published_base"] - 1)
    assert {r["family"] for r in result["entries"]} == {"3D", "ZeRO-3/FSDP", "single node"}


def test_new_sources_keep_todays_budget():
    by_source = validate()["by_source"]
    for source, sides in TODAY.items():
        for side, ceiling in sides.items():
            assert by_source[source][side]["mean_abs_error"] <= ceiling, (source, side, by_source[source][side])


def test_a_rate_becomes_the_time_of_the_sources_own_count():
    """Narayanan et al.'s eq. (3) counts 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs a step: the 1T row of
    Table 1 at 163 TFLOP/s per GPU on 3,072 GPUs is that over 3,072 × 163e12 seconds."""
    entry = next(e for e in load_published() if e.name == "Table 1 1008.0B")
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert entry.published_base() == pytest.approx(flops / (3072 * 163e12))
    tokens = next(e for e in load_published() if e.name == "Table 1 FSDP 8 GPUs")
    assert tokens.published_base() == pytest.approx(16 * 8192 / (8 * 5762))  # global batch 16 of 8,192 tokens


def test_korthikanti_entries_request_the_unfused_kernel():
    """Their figures count the saved attention scores: under the default flash kernel the activation
    entries would be far off (the knob, not a constant, keeps them)."""
    assert PUBLISHED.read_text().count("attention: unfused") >= 2
    entries = [e for e in load_published() if e.source == KORTHIKANTI_SOURCE and e.kind == "activation_memory"]
    from dataclasses import replace
    from bench.analysis.validate import predicted
    moved = [predicted(replace(e, attention="flash")) / predicted(e) for e in entries]
    assert entries and all(r < 0.8 for r in moved[:4]), moved  # the no-recompute rows: scores dominate


def test_a_refused_entry_is_reported_with_its_reason(tmp_path):
    bad = tmp_path / "published.yaml"
    bad.write_text(yaml.safe_dump({"sources": [{"source": "a test", "hardware": "a100-80gb", "entries": [
        {"name": "tp 3 of 96 heads", "model": "gpt3-175b", "kind": "time", "value": 1.0, "unit": "s",
         "where": "nowhere", "config": {"tp": 3}}]}]}))
    (row,) = validate(bad)["entries"]
    assert row["refused"] and "3" in row["refused"] and row["error"] is None
    code, out = bench("validate", "--published", str(bad), "--figure", "")
    assert code == 0 and "refused:" in out and "1 entries refused" in out, out


def test_a_figure_read_off_a_plot_is_reported_apart(tmp_path):
    path = tmp_path / "published.yaml"
    entry = {"model": "gpt3-175b", "kind": "time", "unit": "s", "where": "x",
             "config": {"tp": 8, "pp": 8, "micro_batches": 64, "recompute": "full"}}
    path.write_text(yaml.safe_dump({"sources": [{"source": "a test", "hardware": "a100-80gb", "entries": [
        {**entry, "name": "printed", "value": 18.13}, {**entry, "name": "plotted", "value": 9.0, "read_off_plot": True}]}]}))
    result = validate(path)
    assert result["summary"]["time"]["entries"] == 1 and result["by_source"]["a test"]["time"]["entries"] == 1
    assert result["read_off_plot"]["a test"]["time"]["entries"] == 1
    code, out = bench("validate", "--published", str(path), "--figure", "")
    assert code == 0 and "(read off a plot)" in out and "read off a plot (in none of the above)" in out, out


@pytest.mark.parametrize("change,key", [({"kind": "speed"}, "kind"), ({"unit": "furlongs"}, "unit"),
                                        ({"unit": "TFLOP/s"}, "flops"), ({"model": "gpt-9t"}, "model"),
                                        ({"where": ""}, "where"), ({"params": "lots", "kind": "state_memory"}, "params")])
def test_published_entry_mistakes_name_the_entry_and_key(tmp_path, change, key):
    entry = {"name": "one", "model": "gpt3-175b", "kind": "time", "value": 1.0, "unit": "s", "where": "x", **change}
    bad = tmp_path / "published.yaml"
    bad.write_text(yaml.safe_dump({"sources": [{"source": "a test", "hardware": "a100-80gb", "entries": [entry]}]}))
    with pytest.raises(PublishedError, match=key) as e:
        load_published(bad)
    assert "entries[0]" in str(e.value)


def test_published_file_with_an_unknown_key(tmp_path):
    data = yaml.safe_load(PUBLISHED.read_text())
    data["sources"][0]["entries"][0]["micro_batchez"] = 2
    bad = tmp_path / "published.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(PublishedError, match="micro_batchez"):
        load_published(bad)
    code, out = bench("validate", "--published", str(bad), "--figure", "")
    assert code == 2 and str(bad) in out and "'micro_batchez'" in out and "known keys" in out
    assert len(out.strip().splitlines()) == 1


def test_validate_cli_prints_every_entry_and_the_means_per_source_and_family(tmp_path):
    fig = tmp_path / "v.png"
    code, out = bench("validate", "--json", "--figure", str(fig))
    assert code == 0, out
    result = json.loads(out)
    assert set(result["summary"]) == {"time", "state_memory", "activation_memory", "peak_memory"}
    assert fig.stat().st_size > 10_000
    code, text = bench("validate", "--figure", "")
    assert code == 0, text
    for r in result["entries"]:
        assert r["name"] in text
    for source, sides in result["by_source"].items():
        for side, s in sides.items():
            assert f"{source} · {side}: {s['entries']} entries, mean {s['mean_abs_error']:.2%}" in text
            rows = [r for r in result["entries"] if r["source"] == source and r["error"] is not None
                    and (r["kind"] == "time") == (side == "time")]
            assert s["mean_abs_error"] == pytest.approx(sum(abs(r["error"]) for r in rows) / len(rows))
    for family in ("3D", "ZeRO-3/FSDP", "single node"):
        assert f"{family} · time:" in text


def test_attention_kernel_knob_defaults_to_flash_for_every_backend():
    """Unfused attention computes the whole a·s² score matrix and saves its softmax: more time and memory
    than the flash default, under either activation model; `bench estimate --attention` chooses it."""
    for backend, extra in (("native", {"tp": 8}), ("deepspeed", {"dp": 8, "zero": 3}), ("fsdp", {"dp": 8})):
        shape = RunConfig.unchecked(model="llama3-8b", backend=backend, seq=8192, dtype="bf16-mixed", **extra)
        for acts in ("suite", "table2"):
            default = estimate(shape, "h100-sxm", activations=acts)
            assert default == estimate(shape, "h100-sxm", activations=acts, attention="flash")
            unfused = estimate(shape, "h100-sxm", activations=acts, attention="unfused")
            assert default["attention"] == "flash" and unfused["attention"] == "unfused"
            assert unfused["activation_bytes"] > 1.5 * default["activation_bytes"], (backend, acts)
            assert unfused["compute_s"] > default["compute_s"], (backend, acts)
    code, out = bench("estimate", "--model", "llama3-8b", "--seq", "8192", "--hardware", "h100-sxm",
                      "--attention", "unfused", "--json")
    assert code == 0 and json.loads(out)["attention"] == "unfused", out


# --- the terms --------------------------------------------------------------------------------------
def test_step_is_the_sum_of_its_terms():
    shape = RunConfig.unchecked(model="llama2-70b", tp=8, pp=8, dp=16, micro_batch=1, micro_batches=64, seq=4096,
                                dtype="bf16-mixed", schedule="interleaved", virtual_stages=5, sequence_parallel=True,
                                recompute="selective")
    est = estimate(shape, "h100-sxm", 8)
    assert est["step_time_s"] == pytest.approx(sum(est[t] for t in TERMS))
    assert all(est[t] >= 0 for t in TERMS) and est["bubble_s"] > 0 and est["comm_exposed_tp_s"] > 0


def test_zero3_gathers_are_exposed_when_compute_is_short():
    """Prefetched one layer ahead: hidden behind long layers, exposed behind short ones (fewer tokens)."""
    def dp_share(seq):
        s = RunConfig.unchecked(model="llama2-70b", dp=8, backend="fsdp", fsdp="full", micro_batch=1, seq=seq,
                                dtype="bf16-mixed")
        est = estimate(s, "h100-sxm", 8)
        return est["comm_exposed_dp_s"] / est["step_time_s"]
    assert dp_share(256) > 2 * dp_share(4096)


def test_suite_op_counts_are_the_model_s():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.config import get_preset
    from models.gpt import Block

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    for key, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        block = Block(get_preset("small"))
        x = torch.randn(2, 16, 256, requires_grad=True)
        Count.n = 0
        with Count(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = block(x)
        fwd = Count.n
        Count.n = 0
        with Count():
            y.float().sum().backward()
        assert (fwd, Count.n) == SUITE_OPS[key]
    assert set(SUITE_OPS) == {dtype_key(d) for d in ("fp32", "bf16-mixed", "fp16-mixed")}  # every precision


def test_every_precision_gets_its_row_predictions():
    """fp16-mixed had no op count: its rows' predictions raised KeyError (a GPU-only path)."""
    for dtype in ("fp32", "bf16-mixed", "fp16-mixed"):
        cfg = RunConfig.unchecked(model="tiny", dp=2, dtype=dtype, device="cuda")
        assert predict_row(cfg, hardware=get_hardware("h100-sxm"))["pred_step_time_s"] > 0, dtype


COPYING = [dict(backend="native"), dict(backend="ddp"), dict(backend="fsdp", fsdp="full"),
           *(dict(backend="deepspeed", zero=z) for z in range(4))]


@pytest.mark.parametrize("world", [2, 4])
def test_backend_copy_bytes_are_what_the_backends_copy(pools, world):
    """The time model's gradient upkeep and backend copies (step_upkeep: DDP's bucket copies, FSDP2's and
    ZeRO-3's gather copy-in/out, DeepSpeed's flatten, average and partition copies) against the bytes
    the backends' copy kernels move in one step, counted under TorchDispatchMode (tests/support/copies.py), at
    1 and 2 micro-batches: each backend's excess over the native engine's, within 3 % of its total.
    Tiny model: every ZeRO-3 parameter persists whole, so its gathers are the small model's, below."""
    from support.copies import step_copy_bytes
    cfgs = [RunConfig(model="tiny", dp=world, micro_batches=m, device="cpu", **kw) for m in (1, 2) for kw in COPYING]
    if world == 4:  # the 1/n terms; the m = 2 half of them
        cfgs = [c for c in cfgs if c.micro_batches == 2]
    counted = dict(zip(cfgs, step_copy_bytes(pools(world), cfgs)))
    for cfg, got in counted.items():
        native = next(c for c in counted if c.backend == "native" and c.micro_batches == cfg.micro_batches)
        pred, n = _upkeep_bytes(cfg)
        want = pred - _upkeep_bytes(native)[0]
        assert abs((got - counted[native]) - want) <= 0.03 * pred, (cfg.backend, cfg.zero, cfg.micro_batches,
                                                                           (got - counted[native]) / n, want / n)


def test_zero3_gather_copies_are_counted(pools):
    """ZeRO-3 on the small model (its blocks' weights partitioned and gathered every micro-batch)."""
    from support.copies import step_copy_bytes
    cfgs = [RunConfig(model="small", dp=2, device="cpu", **kw) for kw in (COPYING[0], COPYING[-1])]
    native, zero3 = step_copy_bytes(pools(2), cfgs)
    (pred, n), (pred_native, _) = _upkeep_bytes(cfgs[1]), _upkeep_bytes(cfgs[0])
    assert abs((zero3 - native) - (pred - pred_native)) <= 0.03 * pred, ((zero3 - native) / n, (pred - pred_native) / n)


def _upkeep_bytes(cfg) -> tuple[float, int]:
    """(step_upkeep's bytes, parameters) of rank 0."""
    from bench.analysis.comm import stage_traffic
    from bench.analysis.estimate import default_mixed_state, stage_plan
    from bench.analysis.time_model import step_upkeep
    plan = stage_plan(cfg)
    traffic = tuple(stage_traffic(plan, 0, default_mixed_state(cfg)))
    return step_upkeep(cfg, plan.ranks[0], "suite", traffic).bytes, plan.ranks[0].params


def test_time_model_imports_no_torch():
    """Pure maths: none of the time model's modules imports torch (the package-wide check is #8's)."""
    import ast
    for name in ("time_model", "validate", "hardware", "estimate"):
        tree = ast.parse((ROOT / "bench" / "analysis" / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m and m.split(".")[0] == "torch" for m in imported), name


# --- calibration ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    code, out = bench("calibrate", "--quick", "--world", "2", env={"PARABENCH_PROFILES": str(folder)})
    assert code == 0, out
    return folder


def test_calibrate_writes_a_profile_found_by_name(calibrated, monkeypatch):
    path = calibrated / "cpu.yaml"
    assert [p.name for p in calibrated.iterdir()] == ["cpu.yaml"]  # no temporary file left behind
    hw = load_profiles(path)["cpu"]
    cal = hw.calibration
    assert cal.machine["cores"] == os.cpu_count() and cal.machine["torch"].startswith("2.")
    assert set(cal.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert all(set(t) == {2} and set(t[2]) == {2} for t in cal.collectives.values())  # groups of 2, 2 running
    curve = cal.curve("all_reduce", 2)  # measured over message sizes: a larger one never reads faster
    assert len(curve) >= 3 and all(t0 <= t1 for (_, t0), (_, t1) in zip(curve, curve[1:]))
    mid = (curve[1][0] + curve[2][0]) / 2
    assert curve[1][1] <= cal.collective_seconds("all_reduce", 2, mid) <= curve[2][1]
    assert cal.memory_bw > 0 and cal.op_overhead_s > 0 and cal.optimizer_s_per_param > 0
    assert cal.matmul_rate("fp32", 2 * 512**3) > cal.matmul_rate("fp32", 2 * 32**3)  # a curve, not one peak
    assert set(cal.activation_bw) == {"gelu", "swiglu", "cross_entropy"} and min(cal.activation_bw.values()) > 0
    assert set(cal.memory_contention) == {1, 2} and cal.memory_contention[1] == 1.0 <= cal.memory_contention[2]
    monkeypatch.setenv("PARABENCH_PROFILES", str(calibrated))
    assert get_hardware("cpu").calibration is not None
    row = predict_row(RunConfig(model="small", dp=2), "cpu")
    assert row["pred_hardware"] == "cpu" and row["pred_profile"].startswith(f"calibrated on {cal.machine['hostname']} at ")
    assert row["pred_step_time_s"] == pytest.approx(sum(row[f"pred_{t}"] for t in TERMS))
    code, out = bench("estimate", "--model", "small", "--dp", "2", "--hardware", "cpu", "--json",
                      env={"PARABENCH_PROFILES": str(calibrated)})
    est = json.loads(out)
    assert code == 0 and est["calibrated"] and {"step_time_s", "compute_s", "overhead_s", "optimizer_s"} <= set(est)


def test_a_profile_measured_here_is_used_and_cached(calibrated, monkeypatch, tmp_path):
    """The sweep's calibration finds the profile measured on this machine (no second calibration: 0 s); a
    profile of another torch (or host, CPU, cores) is not this machine's, nor one measured with fewer ranks."""
    from dataclasses import replace as copy

    from bench.analysis.estimate import row_hardware
    from bench.analysis.hardware import measured_profile
    from bench.calibrate import for_this_machine, write_profile
    from bench.environment import machine_identity
    monkeypatch.setenv("PARABENCH_PROFILES", str(calibrated))
    here = load_profiles(calibrated / "cpu.yaml")["cpu"]
    hw, line = for_this_machine((1, 2))
    assert hw == here and "cached, 0 s" in line and line.count("\n") == 0
    assert row_hardware("cpu", 2) == here
    other = copy(here, calibration=copy(here.calibration, machine={**here.calibration.machine, "torch": "0.0"}))
    monkeypatch.setenv("PARABENCH_PROFILES", str(tmp_path))
    write_profile(other, tmp_path / "cpu.yaml")
    assert measured_profile(machine_identity("cpu"), (2,)) is None
    assert row_hardware("cpu", 2).calibration.machine["torch"] == "0.0"  # by name, as before: `bench calibrate`'s cpu
    (tmp_path / "cpu.yaml").unlink()
    assert row_hardware("cpu", 2) == get_hardware("cpu") and predict_row(RunConfig(model="tiny", dp=2), "cpu")[
        "pred_profile"] == "built-in cpu"
    monkeypatch.setenv("PARABENCH_PROFILES", str(calibrated))
    assert measured_profile(machine_identity("cpu"), (4,)) == here  # the best there is, though it covers 2 ranks only


@pytest.mark.slow
def test_the_first_sweep_calibrates_then_uses_the_cache(monkeypatch, tmp_path):
    """No profile measured here: the quick calibration runs once (the line says how long) and is cached under
    the machine's fingerprint; the next sweep reads it (0 s)."""
    import time

    from bench.environment import fingerprint, machine_identity
    from bench.sweep.runner import calibrate_here
    monkeypatch.setenv("PARABENCH_PROFILES", str(tmp_path))
    runs = [RunConfig(model="tiny", dp=2)]
    first = calibrate_here(runs, "local")
    assert first.startswith("calibrated this machine in ") and (tmp_path / f"auto-{fingerprint(machine_identity())}.yaml").is_file()
    t0 = time.monotonic()
    assert "cached, 0 s" in calibrate_here(runs, "local") and time.monotonic() - t0 < 1.0
    assert calibrate_here(runs, "slurm") is None  # its tasks run on other hosts
    assert predict_row(runs[0], "cpu")["pred_profile"].startswith("calibrated on ")


def test_collectives_are_read_at_the_ranks_running():
    """A group of 2 among 4 running ranks (on a CPU, more ranks than cores) is read off its own curve;
    without the ranks running, the group alone; a run larger than any measured, the largest."""
    from bench.analysis.hardware import Calibration
    alone, crowded = [(8.0, 1e-4), (1e6, 1e-3)], [(8.0, 4e-4), (1e6, 4e-3)]
    cal = Calibration(machine={}, matmul={}, memory_bw=1.0, activation_bw={}, op_overhead_s=0.0,
                      optimizer_s_per_param=0.0, optimizer_s_per_tensor=0.0,
                      collectives={"all_reduce": {2: {2: alone, 4: crowded}}}, oversubscription={},
                      memory_contention={}, reference_s=0.0, composition=1.0)
    assert cal.collective_seconds("all_reduce", 2, 1e6, ranks=4) == 4e-3
    assert cal.collective_seconds("all_reduce", 2, 1e6, ranks=2) == cal.collective_seconds("all_reduce", 2, 1e6) == 1e-3
    assert cal.collective_seconds("all_reduce", 2, 1e6, ranks=1024) == 4e-3


class _FakeCalibrationPool:
    """A RankPool for `calibrate` without ranks: each call answers what its ranks would, made up. A collective
    of `g`-rank groups among `running` ranks takes (10·g + running) µs, so each curve says where it came from."""

    def __init__(self, world: int):
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def call(self, fn, *args):
        from bench import calibrate
        if fn is calibrate.measure_compute:
            compute = {"matmul": {d: [[2.0 * 32**3, 1e9], [2.0 * 512**3, 4e9]] for d in ("fp32", "bf16")},
                       "memory_bw": 1e10, "activation_bw": {"gelu": 5e9, "swiglu": 5e9, "cross_entropy": 2e9},
                       "op_overhead_s": 1e-5, "optimizer_s_per_param": 1e-9, "optimizer_s_per_tensor": 1e-6,
                       "reference_s": 0.5}
            return [compute] + [None] * (self.world - 1)
        if fn is calibrate._on_first:
            k = args[0]
            return [0.01 * k if rank < k else None for rank in range(self.world)]
        if fn is calibrate.measure_collectives:
            g, running, sizes = args[:3]
            t = (10 * g + running) * 1e-6
            row = {op: [[4.0 * max(1, b // 4), t * (1 + i)] for i, b in enumerate(sizes)] for op in calibrate.OPS}
            return [row if rank < running else None for rank in range(self.world)]
        raise AssertionError(f"calibrate called {fn.__name__} in its ranks")


def test_calibration_files_each_curve_under_its_group_and_ranks_running(monkeypatch):
    """World 4 (without its ranks: too slow on 2 cores): groups of 2 are measured with 2 and with 4 ranks
    running, and each curve is filed under the ranks that ran it (at world 2 every key is 2: any filing
    agrees); the time model then reads a 2-group among 4 ranks off the crowded curve."""
    from bench import calibrate, spawn
    assert calibrate.collective_shapes(4) == [(2, 2), (2, 4), (4, 4)]
    assert calibrate.collective_shapes(8) == [(2, 2), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8)]
    monkeypatch.setattr(spawn, "RankPool", _FakeCalibrationPool)
    monkeypatch.setattr(calibrate, "RankPool", _FakeCalibrationPool, raising=False)  # were it imported at the top
    monkeypatch.setattr(calibrate, "_cuda_available", lambda: False)
    monkeypatch.setattr(calibrate, "machine", lambda: {"device": "cpu", "cores": 4, "hostname": "test",
                                                       "measured_at": "2000-01-01T00:00:00Z"})
    cal = calibrate.calibrate(world=4, quick=True).calibration
    sizes = calibrate.plan_sizes(quick=True)["comm_bytes"]
    for op in calibrate.OPS:
        filed = {g: {r: round(curve[0][1] * (2e6 if op == "send" else 1e6)) for r, curve in by_ranks.items()}
                 for g, by_ranks in cal.collectives[op].items()}  # the first point's µs: 10·g + ranks running
        assert filed == {2: {2: 22, 4: 24}, 4: {4: 44}}, f"{op}: group → ranks running → µs {filed}"
        assert [b for b, _ in cal.collectives[op][2][4]] == [4.0 * max(1, b // 4) for b in sizes]
    assert cal.collective_seconds("all_reduce", 2, 4.0, ranks=4) == pytest.approx(24e-6)
    assert cal.collective_seconds("all_reduce", 2, 4.0, ranks=2) == pytest.approx(22e-6)
    assert cal.oversubscription == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["calibration"].pop("memory_bw"), "calibration.memory_bw is missing"),
    (lambda d: d["calibration"].__setitem__("op_overhead_s", -1.0), "calibration.op_overhead_s is -1.0"),
    (lambda d: d.__setitem__("inter_node_bw", -5), "inter_node_bw: must be > 0"),
    (lambda d: d["calibration"]["collectives"]["send"][2].__setitem__(2, [[0, 1e-3]]),
     "calibration.collectives.send.2.2 must list [payload bytes, seconds] pairs > 0"),
    (lambda d: d["calibration"]["collectives"]["send"].__setitem__(2, [[0, 1e-3]]),  # the format before ranks
     "calibration.collectives.send.2 must list [payload bytes, seconds] pairs > 0"),
])
def test_bad_profiles_fail_in_one_line(calibrated, tmp_path, edit, message):
    data = yaml.safe_load((calibrated / "cpu.yaml").read_text())
    edit(data)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, out = bench("estimate", "--model", "small", "--hardware", str(bad))
    assert code == 2 and message in out and str(bad) in out and len(out.strip().splitlines()) == 1, out


def test_unknown_hardware_names_the_fix():
    code, out = bench("estimate", "--model", "small", "--hardware", "tpu-v9")
    assert code == 2 and "unknown hardware 'tpu-v9'" in out and "bench calibrate" in out


def test_interrupted_write_leaves_the_old_profile(tmp_path):
    from dataclasses import replace

    from bench.calibrate import write_profile
    hw = get_hardware("a100-80gb")
    path = write_profile(hw, tmp_path / "a.yaml")
    before = path.read_text()
    with pytest.raises(Exception):
        write_profile(replace(hw, peak_flops={"fp32": object()}), path)  # fails half-way through the dump
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["a.yaml"]


def test_a_measured_row_carries_its_predicted_time(pools, monkeypatch, tmp_path):
    monkeypatch.setenv("PARABENCH_PROFILES", str(tmp_path))  # no profile measured here
    row = pools(2).run(RunConfig(model="tiny", dp=2, steps=2, warmup=1))
    assert row["status"] == "ok", row["error"]
    assert row["pred_profile"] == "built-in cpu" and row["pred_step_time_s"] > 0
    assert row["pred_step_time_s"] == pytest.approx(sum(row[f"pred_{t}"] for t in TERMS))
    assert row["pred_step_time_error"] == pytest.approx(row["pred_step_time_s"] / row["step_time_s"] - 1)
    assert row["pred_step_time_abs_error"] == pytest.approx(abs(row["pred_step_time_error"]))
    assert 0 < row["pred_mfu"] < 1 and row["pred_tokens_per_s"] > 0
