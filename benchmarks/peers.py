"""Native vs its peers, side by side: the same configs on every backend that can run them, in one
invocation, repeats interleaved (repeat k of every run before repeat k+1 of any: drift on a shared
machine hits every backend alike), and per layout the median step time, its spread over the repeats
and the ratio native / best peer (< 1: native leads).

Layouts (`small` model): world 2 — dp 2 (m 2), pp 2 1f1b (m 4), tp 2 (m 4); with --world4 also
tp 2·pp 2, pp 2·dp 2, tp 2·dp 2 (4 ranks on a 2-core machine: oversubscribed, so those numbers rank
the engines' overheads under contention rather than their speed). The peers of a layout are the
backends that can run it (bench.capabilities; the others become skipped rows). Each shape runs at
micro-batch 2 and 4, fp32 and bf16-mixed, since the ranking changes with the shape.

    .venv/bin/python benchmarks/peers.py                               # 5 repeats, everything
    .venv/bin/python benchmarks/peers.py --layouts tp2 --dtypes fp32 --micro-batch 4 --repeats 3
    .venv/bin/python benchmarks/peers.py --profile                     # + each run once more, profiled: overhead
    .venv/bin/python benchmarks/peers.py --summary results/peers       # re-read a finished invocation

Rows land in OUT (default results/peers/<time>) like any sweep's; `bench report OUT` renders them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

LAYOUTS = {  # name → (world, tp, pp, dp, micro-batches per step)
    "dp2": (2, 1, 1, 2, 2), "pp2": (2, 1, 2, 1, 4), "tp2": (2, 2, 1, 1, 4),
    "tp2pp2": (4, 2, 2, 1, 4), "pp2dp2": (4, 1, 2, 2, 4), "tp2dp2": (4, 2, 1, 2, 2),
}
WORLD2 = ("dp2", "pp2", "tp2")
BACKENDS = ("native", "ddp", "fsdp", "deepspeed")


def sweep_data(args, repeats: int | None = None, profile: bool = False) -> dict:
    layouts = [LAYOUTS[name] for name in args.layouts]
    # backend innermost but for the layout: one shape's backends run minutes apart at most
    grid = {"micro_batch": args.micro_batch, "dtype": args.dtypes, "backend": list(BACKENDS)}
    return {
        "name": "peers", "model": args.model,
        "base": {"steps": args.steps, "warmup": args.warmup, "device": "cpu", "schedule": "1f1b", "timeout_s": 300.0,
                 "profile": profile},
        "grid": grid,
        "zip": [{"world_size": [w for w, *_ in layouts], "tp": [t for _, t, *_ in layouts],
                 "pp": [p for _, _, p, *_ in layouts], "dp": [d for *_, d, _ in layouts],
                 "micro_batches": [m for *_, m in layouts]}],
        "repeats": repeats or args.repeats, "repeat_order": "interleaved", "launcher": "local",
    }


def layout_name(row) -> str:
    return next(name for name, (w, t, p, d, _) in LAYOUTS.items()
                if (w, t, p, d) == (row.world_size, row.tp, row.pp, row.dp))


def summarise(df) -> list[dict]:
    """Per layout × micro-batch × dtype (× profile): each backend's median step time and spread; native / best peer."""
    ok = df[df.status == "ok"].copy()
    ok["layout"] = [layout_name(r) for r in ok.itertuples()]
    keys = ["layout", "micro_batch", "dtype"]
    out = []
    for key, shape in ok.groupby(keys, sort=False):
        times = {b: sorted(g.step_time_s.astype(float)) for b, g in shape.groupby("backend")}
        stats = {b: {"median": statistics.median(t), "min": t[0], "max": t[-1], "n": len(t)} for b, t in times.items()}
        peers = {b: s for b, s in stats.items() if b != "native"}
        best = min(peers, key=lambda b: peers[b]["median"]) if peers else None
        ratio = stats["native"]["median"] / peers[best]["median"] if best and "native" in stats else None
        # Interference only ever adds time, so on a busy machine the fastest repeat is the least disturbed
        # one: the ratio of minima is printed beside the ratio of medians (the headline).
        best_min = min(peers, key=lambda b: peers[b]["min"]) if peers else None
        ratio_min = stats["native"]["min"] / peers[best_min]["min"] if best_min and "native" in stats else None
        out.append({**dict(zip(keys, key)), "stats": stats, "best_peer": best, "ratio": ratio, "ratio_min": ratio_min})
    return out


def print_summary(summary: list[dict], load: str) -> None:
    print(f"median step ms [min–max over repeats]; ratio = native / best peer (≤ 0.95: native leads); {load}")
    for s in summary:
        shape = f"{s['layout']:<7} mb {s['micro_batch']} {s['dtype']:<10}"
        cells = "  ".join(f"{b} {v['median'] * 1e3:.0f} [{v['min'] * 1e3:.0f}–{v['max'] * 1e3:.0f}] n{v['n']}"
                          for b, v in sorted(s["stats"].items()))
        ratio = f"{s['ratio']:.3f} vs {s['best_peer']}" if s["ratio"] is not None else "-"
        ratio_min = f"{s['ratio_min']:.3f}" if s["ratio_min"] is not None else "-"
        print(f"{shape}  ratio {ratio:<18} (of minima {ratio_min})  {cells}")
    by_layout: dict[str, list[float]] = {}
    for s in summary:
        if s["ratio"] is not None:
            by_layout.setdefault(s["layout"], []).append(s["ratio"])
    print("per layout, ratio over shapes (max / median): " + "  ".join(
        f"{k} {max(v):.3f} / {statistics.median(v):.3f}" for k, v in by_layout.items()))


def print_profile_overhead(plain: list[dict], profiled: list[dict]) -> None:
    """The profiled step is extra and untimed: step times with and without profile should agree within noise."""
    shape = lambda s: (s["layout"], s["micro_batch"], s["dtype"])  # noqa: E731
    base = {shape(s): s for s in plain}
    print("step time with profile / without (median over repeats; 1 = no overhead):")
    for s in profiled:
        if shape(s) in base:
            print(f"  {s['layout']:<7} mb {s['micro_batch']} {s['dtype']:<10} " + "  ".join(
                f"{b} {v['median'] / base[shape(s)]['stats'][b]['median']:.3f}"
                for b, v in sorted(s["stats"].items()) if b in base[shape(s)]["stats"]))


def run_with_and_without_profile(args, out: Path) -> None:
    """A profiled run has the same run id as the plain one (the profiled step is extra), so the two go to
    OUT/plain and OUT/profiled, round by round: repeat k of both before repeat k+1 of either."""
    from bench.sweep.runner import prepare, run_sweep
    from bench.sweep.spec import parse_sweep
    from bench.results.store import load_results
    for k in range(args.repeats):
        for profile in (False, True):
            spec = parse_sweep(sweep_data(args, repeats=k + 1, profile=profile), source="benchmarks/peers.py")
            run_sweep(prepare(spec, out / ("profiled" if profile else "plain")), resume=k > 0)  # runs repeat k only
    plain, profiled = (summarise(load_results(out / part)) for part in ("plain", "profiled"))
    print_summary(plain, load_line())
    print_profile_overhead(plain, profiled)


def load_line() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=list(WORLD2), choices=list(LAYOUTS))
    ap.add_argument("--world4", action="store_true", help="add the world-4 layouts (oversubscribed on 2 cores)")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16-mixed"])
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true",
                    help="every run also with profile: true, in OUT/profiled (prints the step-time ratio)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--summary", type=Path, default=None, help="only summarise the rows of a finished invocation")
    args = ap.parse_args()
    from bench.results.store import load_results
    if args.summary:
        print_summary(summarise(load_results(args.summary)), "(re-read)")
        return
    if args.world4:
        args.layouts = list(dict.fromkeys([*args.layouts, "tp2pp2", "pp2dp2", "tp2dp2"]))
    from bench.sweep.runner import prepare, run_sweep
    from bench.sweep.spec import parse_sweep
    out = args.out or Path("results/peers") / time.strftime("%Y%m%dT%H%M%S")
    if args.profile:
        run_with_and_without_profile(args, out)
        return
    before = load_line()
    run_sweep(prepare(parse_sweep(sweep_data(args), source="benchmarks/peers.py", default_name="peers"), out))
    print(f"rows in {out}; git {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    print_summary(summarise(load_results(out)), f"{load_line()} (before: {before})")


if __name__ == "__main__":
    main()
