"""Context parallel: ring attention (native engine) against Ulysses (DeepSpeed) against cp = 1.

For each sequence length and world size: the same global batch of sequences (micro_batch 1), trained at
cp = 1 on one rank, and at cp = world by ring (native, zig-zag shards, K/V passed round the group) and
by Ulysses (DeepSpeed's all-to-all of heads). The configs are run in turn, repeat after repeat
(interleaved: this machine is shared, so only ratios measured side by side mean anything), and each
prints the median step time over the repeats and its spread (max / min), tokens/s, the peak step memory
of the worst rank measured beside the analytic model's, and the predicted step time, so the ring's and
the all-to-all's costs are seen next to what the model says they cost.

    .venv/bin/python benchmarks/context_parallel.py                      # small, seq 1024 2048 4096, world 2 4
    .venv/bin/python benchmarks/context_parallel.py --seq 1024 --world 2 --repeats 2
"""
from __future__ import annotations

import argparse
import statistics

from bench.config import RunConfig
from bench.spawn import RankPool


def configs(args, seq: int, world: int) -> dict[str, RunConfig]:
    # the model's position table covers the sequence (small's own is 128 tokens)
    common = dict(model=args.model, model_overrides=(f"seq_len={seq}",), seq=seq, micro_batch=1, steps=args.steps,
                  warmup=args.warmup)
    out = {"cp 1": RunConfig(backend="native", **common)}
    out[f"ring cp {world}"] = RunConfig(backend="native", cp=world, **common)
    out[f"ulysses cp {world}"] = RunConfig(backend="deepspeed", cp=world, **common)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    print(f"{'seq':>6}{'world':>6}  {'config':<14}{'step ms':>9}{'spread':>8}{'tok/s':>9}"
          f"{'peak MiB':>10}{'pred MiB':>10}{'pred ms':>9}  status")
    pools: dict[int, RankPool] = {}
    try:
        for seq in args.seq:
            for world in args.world:
                cfgs = configs(args, seq, world)
                rows = {name: [] for name in cfgs}
                for _ in range(args.repeats):
                    for name, cfg in cfgs.items():
                        pool = pools.setdefault(cfg.world, RankPool(cfg.world))
                        rows[name].append(pool.run(cfg))
                for name, runs in rows.items():
                    print(line(seq, world, name, runs), flush=True)
    finally:
        for pool in pools.values():
            pool.close()


def line(seq: int, world: int, name: str, runs: list[dict]) -> str:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return f"{seq:>6}{world:>6}  {name:<14}  {runs[-1]['status']}: {str(runs[-1].get('error')).splitlines()[-1]}"
    times = [r["step_time_s"] for r in ok]
    last = ok[-1]  # the rank pool's rows carry the predictions
    return (f"{seq:>6}{world:>6}  {name:<14}{statistics.median(times) * 1e3:>9.1f}{max(times) / min(times):>8.2f}"
            f"{statistics.median(r['tokens_per_s'] for r in ok):>9.0f}{last['peak_mem_bytes'] / 2**20:>10.1f}"
            f"{(last.get('pred_peak_mem_bytes') or float('nan')) / 2**20:>10.1f}"
            f"{(last.get('pred_step_time_s') or float('nan')) * 1e3:>9.1f}  ok ({len(ok)}/{len(runs)})")


if __name__ == "__main__":
    main()
