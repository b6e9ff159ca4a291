"""Sweeps on the real local Slurm cluster (slurm/local-cluster/start.sh: two emulated nodes on this host)
through real submitit jobs: a 2-rank run, a 2-node × 2-task run, job arrays of several runs, a failing run,
and the runs Slurm ends: a time limit, scancel, a preemption (requeued or not), a sweep's Ctrl-C.
The slow ones start in the background first (the `background` fixture) and are checked at the end.

Outside CI these skip with the reason when the cluster is not up; under CI (CI=true) that is a failure.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm is not installed"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
        sacct = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"Slurm does not answer ({e})"
    if "UP" not in ping.stdout:
        return "slurmctld is down"
    if not any(s.startswith(("idle", "mixed", "alloc")) for s in state.stdout.split()):
        return f"no usable node (sinfo: {state.stdout.strip() or 'nothing'})"
    if sacct.returncode:
        return "sacct does not work (slurmdbd down?): submitit could not see cancelled jobs"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = _cluster_problem()
    if problem:
        message = f"local Slurm cluster not up: {problem}; start it with slurm/local-cluster/start.sh (as root)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " — under CI this is a failure, not a skip")
        pytest.skip(message)


BENCH = str(Path(os.sys.executable).parent / "bench")


def _start_sweep(path: Path, text: str, *args: str) -> subprocess.Popen:
    path.write_text(text)
    return subprocess.Popen([BENCH, "sweep", str(path), "--out", str(path.with_suffix("")), "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _nodes() -> list[str]:
    return subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"], capture_output=True, text=True,
                          timeout=10).stdout.split()


@pytest.fixture(scope="module")
def background(cluster, tmp_path_factory):
    """The slow sweeps, started first and checked by the tests at the end, so that their waits overlap:
    on the first node a run that sleeps past its job's 1-minute time limit (Slurm's finest; slurmctld
    enforces limits every 30 s, so it ends 60-100 s after it starts; no early warning signal, which
    Slurm may send 30 s before it is due: at once here, before the task can handle it) and the sweep a test interrupts
    with Ctrl-C (a quick run and two sleepers, one at a time); on the second the run the preemption test preempts
    without requeue. (Preemption takes the second node: nothing else may run there then.)"""
    first, second = _nodes()[:2]
    tmp = tmp_path_factory.mktemp("background")
    sweeps = {
        "limit": f"""
base: {{steps: 3, warmup: 0, fault: "sleep:200000"}}
grid: {{seed: [0]}}
launcher: {{kind: slurm, profile: local, time_min: 1, signal_delay_s: 0,
           slurm_additional_parameters: {{nodelist: {first}}}}}
""",
        "interrupt": f"""
base: {{steps: 3, warmup: 0}}
runs:
  - {{seed: 0}}
  - {{seed: 1, fault: "sleep:200000"}}
  - {{seed: 2, fault: "sleep:200000"}}
launcher: {{kind: slurm, profile: local, max_parallel: 1, slurm_additional_parameters: {{nodelist: {first}}}}}
""",
        "preempt-false": f"""
base: {{steps: 3, warmup: 0, fault: "sleep:200000", timeout_s: 120}}
grid: {{seed: [0]}}
launcher: {{kind: slurm, profile: local, requeue: false, slurm_additional_parameters: {{nodelist: {second}}}}}
"""}
    procs = {name: _start_sweep(tmp / f"{name}.yaml", f"name: {name}-test\n{text}") for name, text in sweeps.items()}
    yield {name: (proc, tmp / name) for name, proc in procs.items()} | {"second": second}
    for proc in procs.values():
        _stop(proc)


@pytest.fixture(scope="module")
def slurm_sweep(cluster, background, tmp_path_factory):
    """One sweep, three job arrays: world 1 (three seeds), world 2 (an ok run and a failing one) and
    world 4 as 2 nodes × 2 tasks (ranks_per_node 2): tp 2 inside a node, dp 2 across the nodes."""
    from bench.sweep.runner import prepare, run_sweep
    from bench.sweep.spec import load_sweep
    tmp = tmp_path_factory.mktemp("slurm")
    (tmp / "s.yaml").write_text("""
name: slurm-test
base: {steps: 2, warmup: 1, timeout_s: 120}
runs:
  - {dp: 1, seed: 0}
  - {dp: 1, seed: 1}
  - {dp: 1, seed: 2}
  - {dp: 2}
  - {dp: 2, fault: raise}
  - {tp: 2, dp: 2}
launcher: {kind: slurm, profile: local, ranks_per_node: 2}
""")
    t0 = time.monotonic()
    outcome = run_sweep(prepare(load_sweep(tmp / "s.yaml"), tmp / "out"), progress=False)
    return {"outcome": outcome, "out": tmp / "out", "wall": time.monotonic() - t0}


def _rows(out):
    from bench.results.store import load_results
    return load_results(out)


def test_two_rank_run_on_slurm(slurm_sweep):
    df = _rows(slurm_sweep["out"])
    row = df[(df.world_size == 2) & (df.fault == "none")].iloc[0]
    assert row.status == "ok", row.error
    assert row.world_size == 2 and row.launcher == "slurm" and row.slurm_job_id
    assert row.comm_bytes_dp == 232576 * 4  # the 2 tasks really all-reduced fp32 gradients over gloo
    assert row.loss_last < row.loss_first


def test_each_row_is_written_once_by_whoever_knows_it(slurm_sweep):
    """An ok row is stored by its job's rank 0 (with the sweep's columns and its wall time) and the sweep
    reports that very row; the failed one is stored by the sweep, which saw the job end."""
    from bench.results.store import ResultStore
    stored = {r["run_id"]: r for r in ResultStore(slurm_sweep["out"]).rows()}
    for row in slurm_sweep["outcome"].rows:
        on_disk = stored[row["run_id"]]
        assert (on_disk["wall_s"], on_disk["time"], on_disk["hostname"]) == (row["wall_s"], row["time"], row["hostname"])
        assert on_disk["sweep"] == "slurm-test" and on_disk["launcher"] == "slurm" and on_disk["wall_s"] > 0


def test_runs_of_one_shape_go_as_one_job_array(slurm_sweep):
    df = _rows(slurm_sweep["out"])
    singles = df[df.dp == 1]
    assert len(singles) == 3 and set(singles.status) == {"ok"}
    arrays = {job.split("_")[0] for job in singles.slurm_job_id}
    assert len(arrays) == 1 and sorted(singles.slurm_array_task_id.astype(int)) == [0, 1, 2]
    pair = df[df.world_size == 2]
    assert len({job.split("_")[0] for job in pair.slurm_job_id}) == 1  # a second array: the 2-task shape
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", next(iter(arrays))],
                           capture_output=True, text=True, timeout=10).stdout
    assert sacct.count("COMPLETED") == 3, sacct


def test_failing_run_is_failed_with_rank_and_traceback(slurm_sweep):
    df = _rows(slurm_sweep["out"])
    row = df[df.fault == "raise"].iloc[0]
    assert row.status == "failed" and row.failed_rank == 1  # the last rank raises; rank 0 only lost its peer
    assert "injected fault (fault=raise)" in row.error
    assert slurm_sweep["outcome"].counts["ok"] == 5 and slurm_sweep["outcome"].counts["failed"] == 1


def test_two_node_job_keeps_tp_inside_a_node_and_dp_across(slurm_sweep):
    """The 2 × 2 job: every global rank reports the node it ran on (its Slurm node name: the emulated
    nodes share this host), and the groups the layout view says cross nodes are exactly the ones whose
    ranks did run on different nodes."""
    from bench.analysis.explain import explain
    from bench.layout import Layout
    row = _rows(slurm_sweep["out"]).query("world_size == 4").iloc[0]
    assert row.status == "ok", row.error
    nodes = json.loads(row.node_per_rank)  # by global rank
    assert len(nodes) == 4 and len(set(nodes)) == 2 and nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "NNodes,NodeList", "-j", row.slurm_job_id],
                           capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
    assert sacct.split("|")[0] == "2", sacct  # Slurm gave the job two nodes
    view = explain(Layout(tp=2, dp=2, gpus_per_node=2))  # the layout view, ranks_per_node as the node size
    node_index = {name: i for i, name in enumerate(dict.fromkeys(nodes))}
    assert [r["node"] for r in view["ranks"]] == [node_index[n] for n in nodes]  # Slurm's block placement
    for dim in ("tp", "dp"):
        said = [link["ranks"] for link in view["links"] if link["dim"] == dim and link["link"] == "network"]
        did = [g for g in view["groups"][dim] if len({nodes[r] for r in g}) > 1]
        assert said == did, (dim, nodes)
    assert view["groups"]["dp"] == [[0, 2], [1, 3]] and did == [[0, 2], [1, 3]]  # dp crosses, tp stays inside
    assert row.comm_bytes_tp > 0 and row.comm_bytes_dp > 0 and row.loss_last < row.loss_first


def test_cancelled_job_is_recorded_as_cancelled(cluster, tmp_path):
    proc = _start_sweep(tmp_path / "c.yaml", """
name: cancel-test
base: {steps: 500, warmup: 0, fault: "sleep:200", timeout_s: 300}
grid: {seed: [7]}
launcher: {kind: slurm, profile: local}
""")
    try:
        job = _wait_running("bench-cancel-test", timeout=90)[0]
        subprocess.run(["scancel", job], check=True, timeout=10)
        _, stderr = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 0, stderr
    row = _rows(tmp_path / "c").iloc[0]
    assert row.status == "cancelled" and "Slurm state CANCELLED BY 0" in row.error, row.error
    _assert_resume_reruns(tmp_path / "c", {row.run_id})


def test_preempted_job_is_requeued_when_the_profile_asks_else_cancelled(background, tmp_path):
    """Two sweeps of one run each on the second node, preempted by a job of the urgent partition that
    takes that node: `requeue: true` runs the job again (slurm_attempts 2, an ok row), `requeue: false`
    ends it (cancelled, Slurm's PREEMPTED as the reason)."""
    node = background["second"]
    ended_proc, ended_out = background["preempt-false"]
    again_proc = _start_sweep(tmp_path / "preempt-true.yaml", f"""
name: preempt-true-test
base: {{steps: 2, warmup: 0, fault: "sleep:500", timeout_s: 120}}
grid: {{seed: [0]}}
launcher: {{kind: slurm, profile: local, requeue: true, slurm_additional_parameters: {{nodelist: {node}}}}}
""")
    try:
        job = _wait_running("bench-preempt-true-test", timeout=90)[0]
        _wait_running("bench-preempt-false-test", timeout=30)
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-w", node, "-o", "/dev/null",
                                 "--wrap", "sleep 1"], capture_output=True, text=True, timeout=10, check=True)
        _wait_gone(urgent.stdout.strip(), timeout=60)
        # Slurm holds a requeued job back for 2 minutes (its BeginTime): release it now
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], capture_output=True, timeout=10)
        outs = [proc.communicate(timeout=120) for proc in (again_proc, ended_proc)]
    finally:
        _stop(again_proc)
    assert again_proc.returncode == 0 and ended_proc.returncode == 0, [err for _, err in outs]
    again = _rows(tmp_path / "preempt-true").iloc[0]
    assert again.status == "ok" and again.slurm_attempts == 2, (again.status, again.error)
    ended = _rows(ended_out).iloc[0]
    assert ended.status == "cancelled" and "preempted" in ended.error and "Slurm state PREEMPTED" in ended.error
    _assert_resume_reruns(ended_out, {ended.run_id})


def test_ctrl_c_cancels_the_sweeps_jobs_and_keeps_the_finished_rows(background):
    """Ctrl-C while one run has finished, one is running and one queued: the sweep exits 130 only after
    Slurm has ended its jobs (squeue lists none, no task process is left), the finished row is kept,
    and --resume would launch exactly the other two."""
    proc, out = background["interrupt"]
    deadline = time.monotonic() + 120
    while not (list((out / "runs").glob("*.json")) if (out / "runs").is_dir() else []):
        assert time.monotonic() < deadline and proc.poll() is None, "the quick run never finished"
        time.sleep(0.3)
    deadline = time.monotonic() + 60
    while _states("bench-interrupt-test") != ["PENDING", "RUNNING"]:  # the quick job gone, a sleeper running
        assert time.monotonic() < deadline, _states("bench-interrupt-test")
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr
    queued = subprocess.run(["squeue", "-h", "-n", "bench-interrupt-test", "-o", "%i %T"], capture_output=True,
                            text=True, timeout=10).stdout
    assert queued.strip() == "", queued
    tasks = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert [line for line in tasks.splitlines() if str(out) in line] == [], tasks  # no orphan task process
    rows = _rows(out)
    assert list(rows.status) == ["ok"] and rows.seed.iloc[0] == 0
    _assert_resume_reruns(out, {_run_id(out, seed) for seed in (1, 2)})


def test_time_limit_kill_is_a_timeout_row_with_slurms_reason(background):
    proc, out = background["limit"]
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    row = _rows(out).iloc[0]
    assert row.status == "timeout" and "reached its time limit" in row.error, row.error
    assert "Slurm state" in row.error  # TIMEOUT, or FAILED when submitit's USR2 handler ended it first
    assert not list((out / "runs").glob(".*.tmp"))  # nothing half-written
    _assert_resume_reruns(out, {row.run_id})


def _stop(proc: subprocess.Popen) -> None:
    """A sweep a failing test leaves running: Ctrl-C it (it cancels its jobs), kill it if that hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_id(out: Path, seed: int) -> str:
    from bench.sweep.spec import expand, load_sweep
    return next(c.run_id for c in expand(load_sweep(out.with_suffix(".yaml"))).runs if c.seed == seed)


def _assert_resume_reruns(out: Path, run_ids: set[str]) -> None:
    """`--resume` on OUT would launch exactly `run_ids` (the runs its sweep file expands to, less the done)."""
    from bench.results.store import ResultStore
    from bench.sweep.runner import to_launch
    from bench.sweep.spec import expand, load_sweep
    stored = {row["run_id"]: row for row in ResultStore(out).rows()}
    assert {c.run_id for c in to_launch(expand(load_sweep(out.with_suffix(".yaml"))).runs, stored)} == run_ids


def _wait_running(name: str, timeout: float, count: int = 1) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-n", name, "-t", "RUNNING", "-o", "%i"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        if len(out) >= count:
            return out
        time.sleep(0.3)
    raise AssertionError(f"{count} job(s) {name} did not start within {timeout} s")


def _states(name: str) -> list[str]:
    return sorted(subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%T"], capture_output=True, text=True,
                                 timeout=10).stdout.split())


def _wait_gone(job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=10).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout} s"
        time.sleep(0.3)


@pytest.mark.parametrize("launcher, world, says", [
    ("{kind: slurm, profile: local, nodes: 3}", 3, "nodes = 3, but partition debug has 2"),
    ("{kind: slurm, profile: local, gpus_per_node: 4}", 6, "gpus_per_node = 4 does not divide world size 6"),
])
def test_a_profile_the_cluster_cannot_serve_is_refused_before_submission(cluster, tmp_path, launcher, world, says):
    (tmp_path / "b.yaml").write_text(f"name: bad-profile\nbase: {{steps: 1}}\ngrid: {{dp: [{world}]}}\nlauncher: {launcher}\n")
    out = subprocess.run([BENCH, "sweep", str(tmp_path / "b.yaml"), "--out", str(tmp_path / "b"), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "b" / "slurm").exists()  # nothing submitted


def test_requeue_needs_a_folder_every_node_sees():
    from bench.sweep.slurm import mount_type, unshared_reason
    here = {"pb-node1": socket.gethostname(), "pb-node2": socket.gethostname()}
    assert unshared_reason(Path("/tmp"), here) is None  # emulated nodes: one host, one file system
    elsewhere = {"gpu001": "gpu001.cluster", "gpu002": "gpu002.cluster"}
    reason = unshared_reason(Path("/tmp"), elsewhere)
    assert reason and mount_type(Path("/tmp")) in reason and "local file system" in reason


def test_resume_reruns_what_slurm_interrupted_and_keeps_other_outcomes():
    """No cluster needed: which stored rows `--resume` launches again."""
    from bench.config import RunConfig
    from bench.results import failure_row
    from bench.sweep.runner import to_launch
    runs = [RunConfig(seed=seed) for seed in range(5)]
    outcomes = [("slurm", "cancelled"), ("slurm", "timeout"), ("local", "timeout"), ("slurm", "failed"), None]
    stored = {cfg.run_id: {**failure_row(cfg, status, "why"), "launcher": launcher}
              for cfg, outcome in zip(runs, outcomes) if outcome for launcher, status in [outcome]}
    assert [c.seed for c in to_launch(runs, stored)] == [0, 1, 4]  # a hung local run's timeout is a result
    assert [c.seed for c in to_launch(runs, stored, retry_failed=True)] == [0, 1, 2, 3, 4]


def test_task_environment_of_a_two_node_job_comes_from_submitit():
    """What a rank of a 2-node × 2-task submitit job exports for torch.distributed (no cluster needed:
    these are the variables Slurm and submitit's batch script set in such a task)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_PROCID="3", SLURM_LOCALID="1",
               SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu[003-004]")
    code = ("import os; from bench.distributed import env_from_slurm; env_from_slurm(); "
            "print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')))")
    out = subprocess.run([os.sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3", "4", "1", "2", "gpu003"], out.stderr


def test_the_rendezvous_port_of_a_job_is_shared_and_below_the_ephemeral_range():
    """Every task of a job draws the same MASTER_PORT, and never from the range the kernel hands out for
    outgoing connections (a port one of them holds made rank 0 fail with EADDRINUSE)."""
    from bench.distributed import job_port
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {job_id: job_port(job_id) for job_id in ("41", "41_0", "41_1", "97")}
    assert all(job_port(job_id) == port for job_id, port in ports.items())
    assert all(20000 <= port < low for port in ports.values()) and len(set(ports.values())) > 1
