"""Data-parallel gradient reduction of the native engine: bucketed and overlapped vs one all-reduce.

Small buckets launch from backward hooks as soon as their gradients are complete, so reduction
overlaps the rest of backward; one huge bucket fills only when backward ends, i.e. a single
all-reduce after backward. Same traffic (comm_bytes_dp), different ops and step time.

    .venv/bin/python benchmarks/native_dp_overlap.py --model small --dp 2 --buckets-mb 1 1000000
"""
from __future__ import annotations

import argparse

from bench.config import RunConfig
from bench.spawn import RankPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--buckets-mb", type=float, nargs="+", default=[1.0, 1e6])
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="alternate the variants this many times")
    args = ap.parse_args()
    print(f"{'bucket MiB':>12}{'buckets':>9}{'step ms':>10}{'p10':>8}{'p90':>8}{'dp MiB':>9}")
    with RankPool(args.dp) as pool:
        for _ in range(args.repeats):
            for mb in args.buckets_mb:
                cfg = RunConfig(model=args.model, backend="native", dp=args.dp, bucket_mb=mb,
                                micro_batch=args.micro_batch, steps=args.steps, warmup=1)
                row = pool.run(cfg)
                if row["status"] != "ok":
                    print(f"{mb:>12g}  {row['status']}: {row['error']}")
                    continue
                print(f"{mb:>12g}{row['dp_buckets']:>9.0f}{row['step_time_s'] * 1e3:>10.1f}"
                      f"{row['step_time_p10_s'] * 1e3:>8.1f}{row['step_time_p90_s'] * 1e3:>8.1f}"
                      f"{row['comm_bytes_dp'] / 2**20:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
