"""Pipeline schedules of the native engine: GPipe vs 1F1B vs interleaved.

For pp ∈ {2, 4} and micro-batches m: step time, tokens/s, peak step memory (max over ranks) and the
measured bubble (idle / (busy + idle) per pipeline rank, averaged) beside the ideal: the cost
model's, simulated from the same action lists the engine runs (bench.schedule): (p − 1)/(m + p − 1),
interleaved (p − 1)/(v·m + p − 1).

    .venv/bin/python benchmarks/native_pipeline.py --pp 2 4 --micro-batches 1 2 4 8 16
    .venv/bin/python benchmarks/native_pipeline.py --model small --pp 2 --micro-batches 8 --micro-batch 4
"""
from __future__ import annotations

import argparse

from bench.config import RunConfig
from bench.schedule import schedule_step
from bench.spawn import RankPool


def ideal_bubble(cfg: RunConfig) -> float:
    return schedule_step(cfg.schedule, cfg.micro_batches, cfg.pp, cfg.virtual_stages).bubble_fraction


def configs(args) -> list[RunConfig]:
    out = []
    for pp in args.pp:
        for m in args.micro_batches:
            for schedule in args.schedules:
                v = 2 if schedule == "interleaved" else 1
                if schedule == "interleaved" and m % pp:
                    continue
                out.append(RunConfig(model=args.model, model_overrides=tuple(args.set), backend="native", pp=pp,
                                     schedule=schedule, virtual_stages=v, micro_batches=m,
                                     micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--set", nargs="*", default=["layers=8"], help="model overrides KEY=VALUE")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    print(f"{'sched':<12}{'pp':>3}{'m':>4}{'step ms':>10}{'tok/s':>10}{'peak MiB':>10}"
          f"{'bubble':>9}{'ideal':>8}  status")
    pools: dict[int, RankPool] = {}
    try:
        for cfg in configs(args):
            pool = pools.setdefault(cfg.world, RankPool(cfg.world))
            row = pool.run(cfg)
            if row["status"] != "ok":
                print(f"{cfg.schedule:<12}{cfg.pp:>3}{cfg.micro_batches:>4}  {row['status']}: "
                      f"{str(row['error']).splitlines()[-1]}")
                continue
            print(f"{cfg.schedule:<12}{cfg.pp:>3}{cfg.micro_batches:>4}{row['step_time_s'] * 1e3:>10.1f}"
                  f"{row['tokens_per_s']:>10.0f}{row['peak_mem_bytes'] / 2**20:>10.1f}"
                  f"{row['bubble_fraction']:>9.3f}{ideal_bubble(cfg):>8.3f}"
                  f"  ok", flush=True)
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
