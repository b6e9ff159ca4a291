"""The first thing to run on a GPU machine: native vs DeepSpeed vs FSDP at world 1, then the multi-rank
NCCL paths at world 2.

On CUDA, world 1 is the MFU table: gpt2-1.5b in bf16-mixed, 2 micro-batches of 8 × 1024 tokens per
step, on native ZeRO-1, DeepSpeed ZeRO-1 and FSDP full. With 2+ GPUs, world 2 runs what one GPU cannot
exercise: native pp 2 (1F1B, and interleaved with 2 virtual stages), native tp 2, and dp 2 on native
ZeRO-1, FSDP and DeepSpeed ZeRO-1. Its model is gpt2-1.5b cut to 8 layers (untied, 20 heads:
`MULTI_RANK_MODEL`): every message keeps gpt2-1.5b's size (a pipeline send is 26 MB, far above NCCL's
eager per-peer buffer, so an ordering deadlock hangs instead of slipping through), and the weight
initialisation that dominates each run shrinks fourfold. Each world-2 run has a 90 s timeout, so a hang
is a `timeout` row, not the budget. tests/test_gpu_check.py checks these shapes on CPU through
the cost model: each fits an H200 with headroom, and the whole check takes under 8 minutes on one
H200 and on a 2-GPU machine, even with one world-2 run hanging.

Per run it reports MFU, the allocated and reserved memory peaks, allocator retries and host
synchronisations per step, counted by op and, on CUDA, by CUDA's sync-debug mode (which also counts
synchronous host → device copies). Each count may exceed what the engine does once per step by design
(`ONCE_PER_STEP_SYNCS`: DeepSpeed's ZeRO step reads its overflow flag and checks its gradient norm) by
at most one: a sync per micro-batch adds at least 2 (every run has 2+ micro-batches) and is flagged as
a bug in the timed window. The environment fingerprint of the first row closes the table.

    python benchmarks/gpu_check.py                                   # CUDA, gpt2-1.5b, bf16-mixed
    python benchmarks/gpu_check.py --device cpu --model small        # CI: the same runs on CPU (gloo, fp32)

Each run goes through the suite's own launcher (warm `RankPool` processes running `bench.worker`), so
a failure is a row with its traceback, not a crash. Rows go to OUT/gpu_check.jsonl and the table to
OUT/gpu_check.md (OUT: --out, else $OUT, else results/gpu_check). Exit status 1 if a run did not
finish `ok` or a check failed. On a machine without DeepSpeed, install a pure-Python wheel built
elsewhere (`DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==VERSION`): the backend uses torch's AdamW as
its client optimizer, so no DeepSpeed op is compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RUNS = {  # world → run name → options
    1: {  # like-for-like ZeRO-1-class data parallel: the MFU table
        "native zero-1": dict(backend="native", zero=1),
        "deepspeed zero-1": dict(backend="deepspeed", zero=1),
        "fsdp full": dict(backend="fsdp", fsdp="full"),
    },
    2: {  # the NCCL paths one GPU never takes; pipelines at m = 2p, the interleaved case most prone to deadlock
        "native pp 2 1f1b": dict(backend="native", pp=2, schedule="1f1b", micro_batches=4),
        "native pp 2 interleaved": dict(backend="native", pp=2, schedule="interleaved", virtual_stages=2,
                                        micro_batches=4),
        "native tp 2": dict(backend="native", tp=2),
        "native dp 2 zero-1": dict(backend="native", dp=2, zero=1),
        "fsdp dp 2": dict(backend="fsdp", dp=2, fsdp="full"),
        "deepspeed dp 2 zero-1": dict(backend="deepspeed", dp=2, zero=1),
    },
}
SHAPE = {  # device → batch shape, dtype and steps: the GPU's fills an H200; the CPU's is CI-sized
    "cuda": dict(micro_batch=8, micro_batches=2, dtype="bf16-mixed", steps=5, warmup=2),
    "cpu": dict(micro_batch=2, micro_batches=2, dtype="fp32", steps=2, warmup=1),
}
TIMEOUT_S = {  # (device, world) → timeout_s per run: ≥ 2× a healthy run (tests/test_gpu_check.py)
    ("cuda", 1): 300, ("cuda", 2): 90,  # world 2 is where hangs live (NCCL ordering): short, so one fits the budget
    ("cpu", 1): 120, ("cpu", 2): 120,   # CI machines are shared and slow; a healthy run takes ~10 s
}
MULTI_RANK_MODEL = {  # preset → overrides of the world-2 runs (none for a preset that runs as it is)
    # 8 of 48 layers: messages keep their size; 0.41 B instead of 1.56 B values to initialise per rank.
    # Untied: the native pipeline cannot tie the embedding to the head across stages (capabilities).
    # 20 heads: tp 2 splits whole heads, and 25 is odd; head dim 80 is a multiple of 8 (flash attention).
    "gpt2-1.5b": ("layers=8", "tie_embeddings=false", "heads=20"),
}
ONCE_PER_STEP_SYNCS = {  # backend → (dtype, counter) → syncs per step its engine makes by design
    # Native and FSDP: none (the loss is read by the worker, after the counted step).
    # DeepSpeed ZeRO-1/2, DeepSpeedZeroOptimizer.step (deepspeed 0.19.8, runtime/zero/stage_1_and_2.py):
    # - the overflow flag, `overflow_gpu[0].item()` in has_overflow (:3248), when check_grad_overflow:
    #   on for bf16 (bf16.check_grad_overflow defaults true: runtime/precision_config.py:56, engine.py:2639),
    #   off for fp32 (engine.py:2643);
    # - the norm check `is_invalid_grad_norm(norm)`, a `bool(tensor)` (:3042-3043, runtime/utils.py:231-233),
    #   when dtype is not bf16 or check_grad_overflow: in every precision here;
    # - CUDA only: get_grad_norm_direct's `mask_nan_or_inf_with_val_inplace` makes `torch.tensor(-1.0,
    #   device=...)`, a synchronous host → device copy (:2699, runtime/utils.py:887), once per parameter
    #   group (scaled_global_norm, :2951); the suite's optimizer has one (bench.training.make_optimizer).
    # Seen by neither counter: its throughput timer's torch.cuda.synchronize() at every forward and
    # engine.step(), i.e. per micro-batch (engine.py:2946, :3622; utils/timer.py:236-238, :255-256; on by
    # default, utils/config.py:38-41): sync-debug mode does not report a device-wide sync.
    "deepspeed": {("bf16-mixed", "host_syncs_per_step"): 2, ("bf16-mixed", "cuda_syncs_per_step"): 3,
                  ("fp32", "host_syncs_per_step"): 1, ("fp32", "cuda_syncs_per_step"): 2},
}
SYNC_COUNTS = ("host_syncs_per_step", "cuda_syncs_per_step")
COLUMNS = (("check", "run"), ("world_size", "world"), ("status", "status"), ("step_time_s", "step s"),
           ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("peak_mem_bytes", "alloc peak GiB"),
           ("peak_mem_reserved_bytes", "reserved peak GiB"), ("alloc_retries", "alloc retries"),
           ("host_syncs_per_step", "host syncs/step"), ("cuda_syncs_per_step", "CUDA syncs/step"),
           ("loss_first", "loss first"), ("loss_last", "loss last"))
FINGERPRINT = ("device_name", "device_count", "driver_version", "cuda_version", "nccl_version", "cpu_model",
               "torch_version", "deepspeed_version", "submitit_version", "git_sha")


def config(device: str, model: str, world: int, name: str):
    """The RunConfig of run `name` (RunConfig validates it, as a sweep does: ConfigError says why not)."""
    from bench.config import RunConfig
    overrides = MULTI_RANK_MODEL.get(model, ()) if world > 1 else ()
    shape = {**SHAPE[device], "timeout_s": TIMEOUT_S[device, world], "model_overrides": overrides}
    return RunConfig(model=model, device=device, **{**shape, **RUNS[world][name]})


def configs(device: str, model: str, world: int) -> dict:
    """Run name → RunConfig of every run of one world."""
    return {name: config(device, model, world, name) for name in RUNS[world]}


def run_all(device: str, model: str, worlds: list[int]) -> list[dict]:
    from bench.spawn import RankPool
    planned = {world: configs(device, model, world) for world in worlds}  # a refused config stops us here
    rows = []
    for world, runs in planned.items():
        with RankPool(world) as pool:
            for name, cfg in runs.items():
                rows.append(_run_one(pool, name, cfg))
    return rows


def _run_one(pool, name: str, cfg) -> dict:
    t0 = time.monotonic()
    print(f"running {name} (world {cfg.world}) ...", file=sys.stderr, flush=True)
    row = pool.run(cfg)
    row.update(check=name, wall_s=time.monotonic() - t0)
    return row


def sync_limit(row: dict, key: str) -> int:
    """The most syncs per step `row` may show for counter `key`: its engine's once-per-step syncs plus one.
    A sync per micro-batch adds micro_batches (≥ 2) and so always exceeds it."""
    by_design = ONCE_PER_STEP_SYNCS.get(row.get("backend"), {})
    return by_design.get((row.get("dtype"), key), 0) + 1


def problems(row: dict) -> list[str]:
    """What is wrong with one row: not ok, a host sync per micro-batch, an MFU that cannot be."""
    if row.get("status") != "ok":
        return [f"{row.get('status')}: {(row.get('error') or '').strip().splitlines()[-1:]}"]
    out = []
    for key in SYNC_COUNTS:
        if (row.get(key) or 0) > sync_limit(row, key):
            out.append(f"{key} = {row[key]} (at most {sync_limit(row, key)} expected for {row.get('backend')})")
    mfu, datasheet = row.get("mfu") or 0, row.get("device") != "cpu"
    if mfu <= 0 or (datasheet and mfu > 1):  # a CPU's peak is measured at start-up, under whatever load
        out.append(f"MFU {mfu:.3f} outside (0, 1]")
    return out


def _cell(key: str, value) -> str:
    if value is None or value != value:  # None or NaN
        return "–"
    if key.endswith("bytes"):
        return f"{value / 2**30:.2f}"
    if key == "mfu":
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary(rows: list[dict], wall_s: float) -> str:
    lines = ["| " + " | ".join(label for _, label in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(key, row.get(key)) for key, _ in COLUMNS) + " |" for row in rows]
    ok = next((r for r in rows if r.get("status") == "ok"), rows[0] if rows else {})
    lines += ["", "environment: " + ", ".join(f"{k}={ok.get(k)}" for k in FINGERPRINT)]
    issues = [f"- {r.get('check')} (world {r.get('world_size')}): {p}" for r in rows for p in problems(r)]
    lines += ["", f"total {wall_s:.0f} s; " + ("all checks passed" if not issues else "problems:"), *issues]
    return "\n".join(lines)


def worlds(device: str, asked: int | None) -> list[int]:
    """[1, 2] where two ranks can run (2+ GPUs, or CPU), else [1]; `asked` 1 skips world 2."""
    import torch
    if asked is not None:
        return sorted({1, asked})
    return [1, 2] if device == "cpu" or torch.cuda.device_count() >= 2 else [1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default=None, help="model preset (default: gpt2-1.5b on cuda, small on cpu)")
    ap.add_argument("--world", type=int, choices=(1, 2), default=None,
                    help="2 adds the multi-rank runs (default with 2+ GPUs, and on cpu); 1 skips them")
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/gpu_check")
    args = ap.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    if args.device == "cuda" and args.world == 2 and torch.cuda.device_count() < 2:
        print(f"gpu_check: --world 2 needs 2 GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    model = args.model or ("gpt2-1.5b" if args.device == "cuda" else "small")
    t0 = time.monotonic()
    rows = run_all(args.device, model, worlds(args.device, args.world))
    text = summary(rows, time.monotonic() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    (out / "gpu_check.md").write_text(f"# gpu_check: {model} on {args.device}\n\n{text}\n")
    print(text)
    return 1 if any(problems(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
