"""benchmarks/gpu_check.py's CUDA runs, checked on CPU through the cost model (issue 21): each is a config a
sweep accepts, fits an H200 with headroom, and the whole check finishes in under 8 minutes on one H200
and on a 2-GPU machine, even with one world-2 run hanging to its timeout; its pipeline sends are too
large for NCCL to complete eagerly; and its sync rule flags a sync per micro-batch but not DeepSpeed's
once-per-step reads. No process starts."""
import importlib.util
from pathlib import Path

import pytest

from bench.analysis.hardware import PROFILES
from bench.capabilities import unsupported_reason
from bench.config import RunConfig
from bench.sweep.prune import predict
from models.config import count_params, get_preset

ROOT = Path(__file__).resolve().parents[1]
H200 = PROFILES["h200"]  # the datasheet profile (141 GiB), never a calibration file found on this machine
BUDGET_S = 8 * 60
MEMORY_HEADROOM = 0.75  # the model's error, the CUDA context, NCCL's buffers, the allocator's cache
NCCL_EAGER_BYTES = 4 * 2**20  # NCCL_BUFFSIZE's default: a send up to it completes without its receive

# What a run costs besides its steps (the cost model predicts the steady-state step only). From
# /work/shared/NOTES-gpu-readiness.md §3 and measurements on this machine:
POOL_START_S = 20  # new ranks import torch and the suite (10-20 s); once per world
GROUP_INIT_S = {1: 3, 2: 5}  # the default group's NCCL communicator and the suite's groups (1-3 s at world 1)
INIT_VALUES_PER_S = 40e6  # models.init_value at one thread: 59-85 M values/s measured here (gpt2-1.5b's
#                          token table, an MLP weight); half of that for the copy and a busy host
SETUP_S = {"native": 2, "fsdp": 5, "deepspeed": 20}  # the engine: DeepSpeed's import + initialize 10-20 s
FIRST_STEP_S = 5  # cuBLAS handles, kernel selection, the allocator's first growth
UNTIMED_STEPS = 3  # the meter step, and the counted step at ~2× (dispatch mode + sync-debug mode)


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()
RUN_IDS = [(world, name) for world in gpu_check.RUNS for name in gpu_check.RUNS[world]]


class _CudaRuns(dict):
    """(world, name) → the RunConfig gpu_check runs on CUDA, built when first asked for, so that a config
    RunConfig refuses fails its own tests with the reason instead of the file's collection."""

    def __missing__(self, key):
        self[key] = gpu_check.config("cuda", "gpt2-1.5b", *key)
        return self[key]


CUDA_RUNS = _CudaRuns()


def init_seconds(cfg: RunConfig) -> float:
    """Each rank generates the whole tensors of its stage (tp ranks too, notes R15; dp, FSDP and
    DeepSpeed ZeRO-1 the whole model), every rank at once."""
    return count_params(cfg.model_config) / cfg.pp / INIT_VALUES_PER_S


def run_seconds(cfg: RunConfig) -> float:
    """Predicted wall time of one run on H200s: fixed costs, then every step it takes at the predicted time."""
    steps = cfg.warmup + cfg.steps + UNTIMED_STEPS
    fixed = GROUP_INIT_S[cfg.world] + init_seconds(cfg) + SETUP_S[cfg.backend] + FIRST_STEP_S
    return fixed + steps * predict(cfg, H200, cfg.world).step_time_s


def check_seconds(worlds: list[int]) -> float:
    runs = [CUDA_RUNS[world, name] for world, name in RUN_IDS if world in worlds]
    return POOL_START_S * len(worlds) + sum(run_seconds(cfg) for cfg in runs)


@pytest.mark.parametrize("world, name", RUN_IDS)
def test_every_cuda_run_is_a_config_a_sweep_accepts(world, name):
    cfg = CUDA_RUNS[world, name]  # RunConfig refused nothing when it was built (structure, capabilities)
    assert unsupported_reason(cfg) is None and cfg.world == world and cfg.device == "cuda"
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # the form each rank receives
    assert predict(cfg, H200, world).error is None


def test_the_cpu_path_runs_the_same_checks():
    for world in (1, 2):
        cpu = gpu_check.configs("cpu", "small", world)
        assert cpu.keys() == gpu_check.configs("cuda", "gpt2-1.5b", world).keys()
        assert all(cfg.world == world and cfg.dtype == "fp32" for cfg in cpu.values())


@pytest.mark.parametrize("world, name", RUN_IDS)
def test_every_cuda_run_fits_an_h200_with_headroom(world, name):
    prediction = predict(CUDA_RUNS[world, name], H200, world)
    assert prediction.rank_memory == H200.memory_bytes  # one device per rank, not a shared host
    assert prediction.peak_bytes <= MEMORY_HEADROOM * H200.memory_bytes, (
        f"{name}: {prediction.peak_bytes / 2**30:.1f} GiB predicted per rank, more than "
        f"{MEMORY_HEADROOM:.0%} of {H200.memory_bytes / 2**30:.0f} GiB")


@pytest.mark.parametrize("worlds, machine", [([1], "one H200"), ([1, 2], "a 2-GPU H200 machine")],
                         ids=["one-gpu", "two-gpu"])
def test_the_whole_check_takes_under_8_minutes(worlds, machine):
    total = check_seconds(worlds)
    assert total < BUDGET_S, f"gpu_check on {machine}: {total:.0f} s predicted, over {BUDGET_S} s"


@pytest.mark.parametrize("world, name", RUN_IDS)
def test_a_timeout_is_short_but_never_cuts_a_healthy_run(world, name):
    cfg = CUDA_RUNS[world, name]
    assert run_seconds(cfg) <= cfg.timeout_s / 2, f"{name}: a healthy run is close to its timeout"
    if world > 1:  # where NCCL ordering can hang: the hang is a row within 2 minutes
        assert cfg.timeout_s <= 120


def test_one_hung_world2_run_still_leaves_the_check_in_budget():
    """A hang costs its run's timeout, and the pool's restart for the next run, instead of the run."""
    world2 = [CUDA_RUNS[2, name] for name in gpu_check.RUNS[2]]
    hangs = [cfg.timeout_s + POOL_START_S - run_seconds(cfg) for cfg in world2]
    total = check_seconds([1, 2]) + max(hangs)
    assert total < BUDGET_S, f"with one world-2 hang: {total:.0f} s predicted, over {BUDGET_S} s"


@pytest.mark.parametrize("name", [name for name, options in gpu_check.RUNS[2].items() if options.get("pp", 1) > 1])
def test_pipeline_sends_are_gpt2_1_5b_activations_beyond_nccls_eager_buffer(name):
    cfg, full = CUDA_RUNS[2, name], get_preset("gpt2-1.5b")
    assert (cfg.model_config.hidden, cfg.seq) == (full.hidden, full.seq_len)
    send_bytes = cfg.micro_batch * cfg.seq * cfg.model_config.hidden * 2  # bf16 at least (2 bytes a value)
    assert send_bytes >= 2 * NCCL_EAGER_BYTES


@pytest.mark.parametrize("device, model", [("cuda", "gpt2-1.5b"), ("cpu", "small")])
def test_every_run_has_micro_batches_enough_to_expose_a_per_micro_batch_sync(device, model):
    for world in (1, 2):
        assert all(cfg.micro_batches >= 2 for cfg in gpu_check.configs(device, model, world).values())


def _ok_row(cfg: RunConfig, **counts) -> dict:
    return {**cfg.to_row(), "status": "ok", "mfu": 0.4, **counts}


@pytest.mark.parametrize("world, name", RUN_IDS)
def test_the_sync_rule_passes_the_engines_once_per_step_reads_and_flags_one_per_micro_batch(world, name):
    cfg = CUDA_RUNS[world, name]
    by_design = {key: gpu_check.sync_limit(cfg.to_row(), key) - 1 for key in gpu_check.SYNC_COUNTS}
    assert gpu_check.problems(_ok_row(cfg, **by_design)) == []
    for key in gpu_check.SYNC_COUNTS:
        per_micro_batch = {**by_design, key: by_design[key] + cfg.micro_batches}
        assert key in " ".join(gpu_check.problems(_ok_row(cfg, **per_micro_batch)))


def test_deepspeed_zero1s_step_reads_pass_and_a_per_micro_batch_sync_fails():
    """The figures read off DeepSpeed's ZeRO-1 step (gpu_check.ONCE_PER_STEP_SYNCS): on bf16, the overflow
    flag and the norm check (2 scalar reads) and one host → device copy; on CPU fp32, the norm check
    (the CI run measures host_syncs_per_step = 1)."""
    ds, native = CUDA_RUNS[1, "deepspeed zero-1"], CUDA_RUNS[1, "native zero-1"]
    assert gpu_check.problems(_ok_row(ds, host_syncs_per_step=2, cuda_syncs_per_step=3)) == []
    assert gpu_check.problems(_ok_row(ds, host_syncs_per_step=2, cuda_syncs_per_step=3 + ds.micro_batches)) != []
    assert gpu_check.problems(_ok_row(native, host_syncs_per_step=0, cuda_syncs_per_step=2)) != []
    cpu_ds = gpu_check.configs("cpu", "small", 1)["deepspeed zero-1"]
    assert gpu_check.problems({**_ok_row(cpu_ds, host_syncs_per_step=1), "cuda_syncs_per_step": None}) == []
