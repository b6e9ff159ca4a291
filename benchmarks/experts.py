"""Expert parallel on the native engine: ep 1, 2 and 4 of the same MoE model, side by side.

For each model: the same global batch on `--world` ranks (dp = world), with the experts whole on every
rank (ep 1) and split over 2 and 4 ranks. The configs run in turn, repeat after repeat (interleaved: this
machine is shared, so only ratios measured side by side mean anything); each line prints the median step
time and its spread (max / min), tokens/s, the ep all-to-all bytes per step and rank measured beside the
analytic model's (dropless: equal), the parameter bytes per rank (measured, predicted: the experts a
rank does not hold are gone), and the predicted step time.

    .venv/bin/python benchmarks/experts.py                        # tiny-moe and small-moe, world 4
    .venv/bin/python benchmarks/experts.py --model tiny-moe --repeats 2
"""
from __future__ import annotations

import argparse
import statistics

from bench.config import RunConfig
from bench.spawn import RankPool


def configs(args, model: str) -> dict[str, RunConfig]:
    common = dict(model=model, backend="native", dp=args.world, micro_batch=args.micro_batch, steps=args.steps,
                  warmup=args.warmup)
    return {f"ep {ep}": RunConfig(ep=ep, **common) for ep in (1, 2, 4) if args.world % ep == 0}


def line(model: str, name: str, runs: list[dict]) -> str:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return f"{model:<10}{name:<6}  {runs[-1]['status']}: {str(runs[-1].get('error')).splitlines()[-1]}"
    times, last = [r["step_time_s"] for r in ok], ok[-1]
    mib = lambda key: (last.get(key) or 0.0) / 2**20  # noqa: E731
    return (f"{model:<10}{name:<6}{statistics.median(times) * 1e3:>9.1f}{max(times) / min(times):>8.2f}"
            f"{statistics.median(r['tokens_per_s'] for r in ok):>9.0f}{mib('comm_bytes_ep'):>10.3f}"
            f"{mib('pred_comm_bytes_ep'):>10.3f}{mib('params_bytes'):>10.2f}{mib('pred_params_bytes'):>10.2f}"
            f"{(last.get('pred_step_time_s') or float('nan')) * 1e3:>9.1f}  ok ({len(ok)}/{len(runs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["tiny-moe", "small-moe"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    print(f"{'model':<10}{'ep':<6}{'step ms':>9}{'spread':>8}{'tok/s':>9}{'ep MiB':>10}{'pred':>10}"
          f"{'params':>10}{'pred':>10}{'pred ms':>9}  status")
    with RankPool(args.world) as pool:
        for model in args.model:
            cfgs = configs(args, model)
            rows = {name: [] for name in cfgs}
            for _ in range(args.repeats):
                for name, cfg in cfgs.items():
                    rows[name].append(pool.run(cfg))
            for name, runs in rows.items():
                print(line(model, name, runs), flush=True)


if __name__ == "__main__":
    main()
