"""Real multi-process runs through the local launcher (gloo)."""
import json
import math
import subprocess
import sys

import pytest

from bench.config import RunConfig

REQUIRED = ["status", "backend", "tp", "pp", "dp", "world_size", "model", "params", "step_time_s", "tokens_per_s",
            "mfu", "peak_mem_bytes", "persistent_bytes", "comm_bytes_tp", "comm_bytes_pp", "comm_bytes_dp",
            "comm_wire_bytes_tp", "comm_wire_bytes_pp", "comm_wire_bytes_dp", "loss_first", "loss_last", "run_id"]


def test_bench_run_cli_prints_one_json_row():
    out = subprocess.run([sys.executable, "-m", "bench.cli", "run", "--model", "tiny", "--backend", "native",
                          "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "5", "--json", "--no-calibrate"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)  # exactly one JSON object on stdout
    for key in REQUIRED:
        assert key in row, key
    for f in RunConfig.__dataclass_fields__:
        assert f in row, f
    assert row["status"] == "ok" and row["params"] == 232576
    assert row["loss_last"] < row["loss_first"]
    assert row["comm_bytes_dp"] == 0 and row["persistent_bytes"] == 4 * 232576 * 4  # p + g + 2 Adam moments
    assert 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0


def test_two_ranks_average_gradients_like_one_rank(pools):
    one = pools(1).run(RunConfig(micro_batch=4, steps=3))
    two = pools(2).run(RunConfig(dp=2, micro_batch=2, steps=3))
    assert one["status"] == two["status"] == "ok", (one.get("error"), two.get("error"))
    assert math.isclose(one["loss_last"], two["loss_last"], rel_tol=1e-5)
    grads = 232576 * 4
    assert two["comm_bytes_dp"] == grads and two["comm_wire_bytes_dp"] == grads  # ring: 2(n-1)/n = 1 at n=2
    assert json.loads(two["peak_mem_bytes_per_rank"]).__len__() == 2


@pytest.mark.parametrize("fault,status", [("raise", "failed"), ("oom", "oom")])
def test_failing_rank_is_reported_not_hung(pools, fault, status):
    row = pools(2).run(RunConfig(dp=2, steps=2, fault=fault, timeout_s=120))
    assert row["status"] == status
    assert row["failed_rank"] == 1 and "injected fault" in row["error"]


def test_hung_rank_times_out_and_pool_recovers(pools):
    row = pools(2).run(RunConfig(dp=2, steps=2, fault="hang", timeout_s=8))
    assert row["status"] == "timeout" and "timeout_s=8" in row["error"]
    assert pools(2).run(RunConfig(dp=2, steps=2))["status"] == "ok"


def test_an_explicit_hardware_predicts_the_row_on_it(tmp_path, monkeypatch):
    """`--hardware`: the row is predicted on the named profile (nothing calibrated), and says so."""
    monkeypatch.setenv("PARABENCH_PROFILES", str(tmp_path))  # no profile measured here
    from bench.analysis.hardware import get_hardware
    from bench.sweep.local import run_debug
    row = run_debug(RunConfig(model="tiny", steps=1, warmup=0), None, get_hardware("h100-sxm"))
    assert row["status"] == "ok" and row["pred_hardware"] == "h100-sxm" and row["pred_profile"] == "built-in h100-sxm"
    assert run_debug(RunConfig(model="tiny", steps=1, warmup=0))["pred_profile"] == "built-in cpu"


def _thread_count() -> int:
    import os
    return len(os.listdir("/proc/self/task"))


def _leak_threads(n: int) -> None:
    import threading
    import time
    for _ in range(n):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def test_warm_ranks_do_not_gather_threads_run_after_run(pools):
    """Each run's gloo groups (a device loop and two worker threads each) are freed after the call: a
    warm rank once held 400 threads late in the suite, which then ran three times slower (the native
    engine's gradient hooks, held on torch's C++ side, kept every run's groups)."""
    pool = pools(2)
    counts = []
    for backend in ("native", "fsdp", "native", "fsdp"):
        assert pool.run(RunConfig(model="tiny", dp=2, steps=1, warmup=0, backend=backend))["status"] == "ok"
        counts.append(pool.call(_thread_count))
    assert all(c == counts[0] for c in counts), counts


def test_a_rank_past_the_thread_bound_is_retired(pools):
    """Whatever else leaks cannot pile up: the pool starts fresh ranks once one exceeds MAX_RANK_THREADS."""
    from bench.spawn import MAX_RANK_THREADS
    pool = pools(2)
    pool.call(_leak_threads, MAX_RANK_THREADS)
    assert max(pool.call(_thread_count)) < MAX_RANK_THREADS
