"""The first thing to run on a GPU machine: native vs DeepSpeed vs FSDP, world 1, then world N.

On CUDA (one H200-class GPU: under 8 minutes): gpt2-1.5b in bf16-mixed, 2 micro-batches of 8 × 1024
tokens per step, each backend at world 1, and again at dp = N when the machine has N > 1 GPUs. Per run
it reports MFU, the allocated and reserved memory peaks, allocator retries and host synchronisations
per step, counted by op and, on CUDA, by CUDA's sync-debug mode (each must stay ≤ 1: DeepSpeed's ZeRO
reads its gradient norm once per step; anything per micro-batch is a bug in the timed window), plus
the environment fingerprint of the first row.

    python benchmarks/gpu_check.py                                   # CUDA, gpt2-1.5b, bf16-mixed
    python benchmarks/gpu_check.py --device cpu --model small        # CI: the same code path on CPU, fp32

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

BACKENDS = {  # backend → the options that make it a like-for-like ZeRO-1-class data-parallel run
    "native": dict(backend="native", zero=1),
    "deepspeed": dict(backend="deepspeed", zero=1),
    "fsdp": dict(backend="fsdp", fsdp="full"),
}
SHAPE = {  # device → batch shape, dtype and steps: the GPU's fills an H200; the CPU's is CI-sized
    "cuda": dict(micro_batch=8, micro_batches=2, dtype="bf16-mixed", steps=5, warmup=2, timeout_s=300),
    "cpu": dict(micro_batch=2, micro_batches=2, dtype="fp32", steps=2, warmup=1, timeout_s=120),
}
COLUMNS = (("backend", "backend"), ("world_size", "world"), ("status", "status"), ("step_time_s", "step s"),
           ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("peak_mem_bytes", "alloc peak GiB"),
           ("peak_mem_reserved_bytes", "reserved peak GiB"), ("alloc_retries", "alloc retries"),
           ("host_syncs_per_step", "host syncs/step"), ("cuda_syncs_per_step", "CUDA syncs/step"),
           ("loss_first", "loss first"), ("loss_last", "loss last"))
FINGERPRINT = ("device_name", "device_count", "driver_version", "cuda_version", "nccl_version", "cpu_model",
               "torch_version", "deepspeed_version", "submitit_version", "git_sha")


def configs(device: str, model: str, world: int) -> list:
    from bench.config import RunConfig
    return [RunConfig(model=model, device=device, dp=world, **BACKENDS[name], **SHAPE[device]) for name in BACKENDS]


def run_all(device: str, model: str, worlds: list[int]) -> list[dict]:
    from bench.spawn import RankPool
    rows = []
    for world in worlds:
        with RankPool(world) as pool:
            for cfg in configs(device, model, world):
                t0 = time.monotonic()
                print(f"running {cfg.backend} world {world} ...", file=sys.stderr, flush=True)
                row = pool.run(cfg)
                row["wall_s"] = time.monotonic() - t0
                rows.append(row)
    return rows


def problems(row: dict) -> list[str]:
    """What is wrong with one row: not ok, a host sync per micro-batch, an MFU that cannot be."""
    if row.get("status") != "ok":
        return [f"{row.get('status')}: {(row.get('error') or '').strip().splitlines()[-1:]}"]
    out = []
    for key in ("host_syncs_per_step", "cuda_syncs_per_step"):
        if (row.get(key) or 0) > 1:
            out.append(f"{key} = {row[key]} (at most 1 expected)")
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
    issues = [f"- {r.get('backend')} world {r.get('world_size')}: {p}" for r in rows for p in problems(r)]
    lines += ["", f"total {wall_s:.0f} s; " + ("all checks passed" if not issues else "problems:"), *issues]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default=None, help="model preset (default: gpt2-1.5b on cuda, small on cpu)")
    ap.add_argument("--world", type=int, default=None,
                    help="the world-N run's size (default: every GPU on cuda, 2 on cpu; 1 skips it)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/gpu_check")
    args = ap.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    model = args.model or ("gpt2-1.5b" if args.device == "cuda" else "small")
    n = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    t0 = time.monotonic()
    rows = run_all(args.device, model, sorted({1, n}))
    text = summary(rows, time.monotonic() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    (out / "gpu_check.md").write_text(f"# gpu_check: {model} on {args.device}\n\n{text}\n")
    print(text)
    return 1 if any(problems(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
