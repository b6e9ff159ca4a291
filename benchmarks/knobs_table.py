"""The small-model table of the knobs: backend × recompute × compile at world 1, on this machine.

Prints, per config, the median step time, compile_s, the measured step peak (peak_mem_bytes: RSS on CPU)
and the cost model's activation + transient bytes (bench.analysis.memory, `suite` activations, autocast
state), as a Markdown table. `python benchmarks/knobs_table.py [--steps 3] [--backends native,ddp]`.
"""
from __future__ import annotations

import argparse

from bench.analysis.estimate import estimate
from bench.config import ConfigError, RunConfig
from bench.spawn import RankPool

MiB = 2**20


def configs(backends: list[str], steps: int) -> list[RunConfig | tuple[dict, str]]:
    out = []
    for backend in backends:
        for compile_ in (False, True):
            for recompute in ("none", "selective", "full"):
                kw = dict(model="small", backend=backend, recompute=recompute, compile=compile_, steps=steps,
                          warmup=1, micro_batch=8)
                try:
                    out.append(RunConfig(**kw))
                except ConfigError as e:
                    out.append((kw, str(e)))
    return out


def predicted_bytes(cfg: RunConfig) -> float:
    est = estimate(cfg, mixed_state="autocast", activations="suite")
    return max(s["activation_bytes"] + s["transient_bytes"] for s in est["stages"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backends", default="native,fsdp,ddp,deepspeed")
    args = parser.parse_args()
    print("| backend | recompute | compile | step time (s) | compile_s | measured peak (MiB) | predicted (MiB) |")
    print("|---|---|---|--:|--:|--:|--:|")
    pool = RankPool(1)
    try:
        for item in configs(args.backends.split(","), args.steps):
            if isinstance(item, tuple):
                kw, why = item
                print(f"| {kw['backend']} | {kw['recompute']} | {kw['compile']} | refused: {why} | | | |", flush=True)
                continue
            row = pool.run(item)
            if row["status"] != "ok":
                print(f"| {item.backend} | {item.recompute} | {item.compile} | {row['status']}: "
                      f"{str(row['error'])[-120:]} | | | |", flush=True)
                continue
            compile_s = f"{row['compile_s']:.1f}" if row.get("compile_s") is not None else ""
            print(f"| {item.backend} | {item.recompute} | {item.compile} | {row['step_time_s']:.3f} | {compile_s} | "
                  f"{row['peak_mem_bytes'] / MiB:.1f} | {predicted_bytes(item) / MiB:.1f} |", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
