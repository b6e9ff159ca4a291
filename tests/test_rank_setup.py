"""A rank's device set-up, checked without a GPU (issue: the first GPU cluster run must work).

A recording accelerator (tests/support/accelerator.py) answers like a machine with N GPUs and records
each call with the device index it names. Set-up code runs against a `cuda:k` one with
`init_process_group` recorded; the worker and calibration run for real on gloo against a `cpu:k` one,
whose calls must all name the rank's own device, the device set before anything else.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from bench import device as bench_device
from bench.config import RunConfig
from bench.distributed import DeviceSetupError, resolve_device, setup_rank
from support.accelerator import RecordingAccelerator, recorded

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _InitReached(Exception):
    pass


@pytest.fixture
def slurm_task(monkeypatch):
    """The environment of task 3 (local id 3) of a one-node, 8-task Slurm job that submitit started,
    with nothing of the rank set (the suite's Slurm task removes what sbatch inherited)."""
    for key in RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_PROCID="3", SLURM_LOCALID="3",
                           SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
                           SLURM_JOB_NODELIST="gpu001").items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def gpus(monkeypatch):
    """A machine with 8 recorded GPUs; `init_process_group` is recorded into the same call list and
    stops the caller there (nothing after it could run without NCCL)."""
    accel = RecordingAccelerator(count=8, type="cuda")

    def init_process_group(backend, timeout=None, device_id=None, **kw):
        accel.calls.append(("init_process_group", device_id.index if device_id is not None else None))
        accel.init_backend = backend
        raise _InitReached

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with bench_device.installed(accel):
        yield accel


def test_a_slurm_rank_sets_the_gpu_of_its_local_rank_before_the_group(slurm_task, gpus):
    """The worker's own prologue: with SLURM_LOCALID=3 the rank must take cuda:3, set it, and bind the
    default group to it (the old order chose cuda:0 before the Slurm variables were exported, on every
    rank: NCCL's "Duplicate GPU detected")."""
    from bench import worker
    with pytest.raises(_InitReached):
        worker.run(RunConfig(model="tiny", device="cuda", dp=8))
    assert gpus.calls == [("set_device", 3), ("init_process_group", 3)]
    assert gpus.init_backend == "nccl"
    assert os.environ["LOCAL_RANK"] == "3"  # what DeepSpeed's engine reads for its own set_device


def test_deepspeed_and_the_suite_agree_on_the_gpu(slurm_task, monkeypatch):
    """DeepSpeed's engine calls set_device(int(LOCAL_RANK)); the suite's rule must give the same index.
    With one GPU visible to the task (a --gpus-per-task binding) they cannot agree: refused in one line
    naming LOCAL_RANK (the old rule, LOCAL_RANK % device count, took cuda:0 while DeepSpeed asked for
    cuda:3)."""
    with bench_device.installed(RecordingAccelerator(count=8, type="cuda")):
        from bench.distributed import env_from_slurm
        env_from_slurm()
        assert resolve_device("auto").index == int(os.environ["LOCAL_RANK"]) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with bench_device.installed(RecordingAccelerator(count=1, type="cuda")):
        with pytest.raises(DeviceSetupError, match="LOCAL_RANK=3 but this task sees 1 GPU") as err:
            resolve_device("cuda")
    assert "\n" not in str(err.value) and "--gpus-per-task" in str(err.value)


@pytest.mark.parametrize("env, count, requested, names", [
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 2, "auto", "LOCAL_WORLD_SIZE=4"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, 2, "cuda", "LOCAL_RANK=2"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, None, "cuda", "--device cuda"),
])
def test_a_device_the_rank_cannot_have_is_refused_before_any_group(monkeypatch, env, count, requested, names):
    """More ranks per node than GPUs, a LOCAL_RANK beyond the visible devices, --device cuda without a
    GPU: one line naming the variable and the fix, and no process group started."""
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(a))
    monkeypatch.setattr(bench_device, "accelerator", lambda: None if count is None else
                        RecordingAccelerator(count=count, type="cuda"))
    with pytest.raises(DeviceSetupError, match=names) as err:
        setup_rank(requested)
    assert "\n" not in str(err.value) and not started


def test_the_local_launcher_starts_no_more_ranks_than_gpus(monkeypatch):
    """Four ranks on two GPUs would share them (the launcher used to wrap LOCAL_RANK round the GPUs)."""
    from bench.sweep.runner import local_size_reason
    with bench_device.installed(RecordingAccelerator(count=2, type="cuda")):
        assert local_size_reason(2, "cuda") is None
        assert "more ranks than the 2 GPU(s)" in local_size_reason(4, "cuda")
        assert "more ranks than the 2 GPU(s)" in local_size_reason(4, "auto")
        assert local_size_reason(4, "cpu") is None


def _assert_own_device(rank_calls):
    for calls, local_rank in rank_calls:
        assert calls[0] == ("set_device", local_rank), calls[:3]
        others = {(op, index) for op, index in calls if index != local_rank}
        assert not others, f"rank {local_rank} named another device: {sorted(others)}"


def _worker_row(cfg_dict: dict):
    from bench import worker
    return worker.run(RunConfig.from_dict(cfg_dict))


def test_the_worker_names_only_its_own_device(pools):
    """A real world-2 run (pp 2 × 1F1B on gloo) through the accelerator paths: every call names the
    rank's device, the device is set first, the steps are timed by events, and the bubble meter waits
    for the current stream only (a device-wide sync would also wait for the pipeline's pending sends,
    which under NCCL turns them into blocking ones)."""
    cfg = RunConfig(model="tiny", device="cuda", pp=2, micro_batches=4, schedule="1f1b", steps=2, warmup=1)
    got = pools(2).call(recorded, _worker_row, cfg.to_dict())
    assert got[0][0]["status"] == "ok", got[0][0].get("error")
    _assert_own_device([(calls, local) for _, local, calls in got])
    for _, _, calls in got:
        ops = [op for op, _ in calls]
        assert ops.count("event.record") == 2 * cfg.steps  # a start and an end event per timed step
        assert "stream_synchronize" in ops  # the metered step's compute sections
        assert ops.count("synchronize") == cfg.warmup + 2  # device-wide: each warm-up step, the memory probe


def _calibration(sizes: dict):
    from bench import calibrate
    compute = calibrate.measure_compute(sizes)
    return compute is not None, calibrate.measure_collectives(2, 2, sizes["comm_bytes"], sizes["window_s"])


def test_calibration_ranks_time_their_own_device(pools):
    """Every calibration rank sets its device before timing (rank 1 used to record its events on
    GPU 0's stream and time nothing)."""
    sizes = {"matmul": (16,), "window_s": 0.002, "elementwise": 1 << 12, "comm_bytes": (4, 1 << 12)}
    got = pools(2).call(recorded, _calibration, sizes)
    assert got[0][0][0] and not got[1][0][0]  # the single-rank figures are rank 0's
    _assert_own_device([(calls, local) for _, local, calls in got])
    assert all(("event.record", local) in calls for _, local, calls in got)
