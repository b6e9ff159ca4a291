"""Predicted vs measured step time and step peak memory for one set of configs, measured and predicted in
one run.

The default set is issue 11's world-≤ 2 set on the `small` model: native dp 2, tp 2, pp 2 (1F1B, m 4),
ddp dp 2, fsdp full dp 2, deepspeed ZeRO-1 and ZeRO-3 dp 2. Each config runs on a RankPool of its world
size (one thread per rank, as `bench run`), in interleaved rounds (--repeats, 3: one step time drifts
5-10 % between runs here), and each config's median round is compared; the prediction uses the
profile measured on this machine when there is one (`bench calibrate`, or a sweep's own; else the
built-in), exactly as the result row's pred_* columns. Beside the time table it prints the measured step peak memory
(peak_mem_bytes: live tensor bytes a step adds, torch.profiler's allocation records on CPU)
against the predicted one (pred_peak_mem_bytes: what is live at the step's largest moment,
bench.analysis.memory.step_peak), per config and per rank.

    bench calibrate                                      # once per machine (< 2 min)
    .venv/bin/python benchmarks/predict_vs_measure.py
    .venv/bin/python benchmarks/predict_vs_measure.py --set quickstart   # 4 ranks of tiny on 2 cores
    .venv/bin/python benchmarks/predict_vs_measure.py --recompute full --steps 2 --warmup 1   # memory only: quick
    .venv/bin/python benchmarks/predict_vs_measure.py --calibrate --out results/predict && bench report results/predict
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench.capabilities import unsupported_reason
from bench.config import RunConfig
from bench.spawn import RankPool

SETS = {
    "world2": [dict(backend="native", dp=2), dict(backend="native", tp=2), dict(backend="native", pp=2,
               schedule="1f1b", micro_batches=4), dict(backend="ddp", dp=2), dict(backend="fsdp", fsdp="full", dp=2),
               dict(backend="deepspeed", zero=1, dp=2), dict(backend="deepspeed", zero=3, dp=2)],
    # the quickstart sweep's native layouts (sweeps/quickstart.yaml: tiny, micro-batch 2, global batch 8)
    "quickstart": [dict(dp=4, micro_batches=1), dict(tp=2, dp=2, micro_batches=2), dict(pp=2, dp=2, micro_batches=2),
                   dict(tp=2, pp=2, micro_batches=4), dict(micro_batches=4)],
}
MODEL = {"world2": "small", "quickstart": "tiny"}


def configs(name: str, steps: int, warmup: int, dtype: str, recompute: str = "none") -> list[RunConfig]:
    """The set's configs that their backend can run (recompute modes differ by backend)."""
    cfgs = [RunConfig(model=MODEL[name], steps=steps, warmup=warmup, dtype=dtype, device="cpu", recompute=recompute,
                      **kw) for kw in SETS[name]]
    for cfg in cfgs:
        if (why := unsupported_reason(cfg)) is not None:
            print(f"{describe(cfg):<44}skipped: {why}")
    return [cfg for cfg in cfgs if unsupported_reason(cfg) is None]


def describe(cfg: RunConfig) -> str:
    extra = f" zero{cfg.zero}" if cfg.backend == "deepspeed" else (f" {cfg.fsdp}" if cfg.backend == "fsdp" else "")
    recompute = f" rc-{cfg.recompute}" if cfg.recompute != "none" else ""
    return f"{cfg.backend}{extra} tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} m{cfg.micro_batches}{recompute}"


def measure(cfgs: list[RunConfig], repeats: int) -> list[list[dict]]:
    """Every config `repeats` times, interleaved (round k of every config before round k+1 of any: drift
    on a shared machine hits every config alike); per config its rows, one per round."""
    rows, pools = [[] for _ in cfgs], {}
    try:
        for k in range(repeats):
            for i, cfg in enumerate(cfgs):
                pool = pools.setdefault(cfg.world, RankPool(cfg.world))
                rows[i].append(pool.run(RunConfig.from_dict({**cfg.to_dict(), "repeat": k})))
    finally:
        for pool in pools.values():
            pool.close()
    return rows


def median_row(rows: list[dict]) -> dict:
    """The round with the median step time (its own prediction and memory come with it), the spread of
    the rounds beside it; a failed round if none finished."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["step_time_s"])
    if not ok:
        return rows[0]
    times = [r["step_time_s"] for r in ok]
    return {**ok[(len(ok) - 1) // 2], "spread": f"[{times[0] * 1e3:.0f}–{times[-1] * 1e3:.0f}]"}


TERMS = ("compute", "overhead", "comm_exposed_tp", "comm_exposed_pp", "comm_exposed_dp", "bubble", "optimizer")


def print_table(cfgs, rows) -> list[float]:
    print(f"{'config':<44}{'measured ms':>12}{'[min–max]':>12}{'predicted':>10}{'error':>8}   terms (ms): "
          + " ".join(t.replace("comm_exposed_", "") for t in TERMS))
    errors = []
    for cfg, row in zip(cfgs, rows):
        if row["status"] != "ok":
            print(f"{describe(cfg):<44}{row['status']}: {str(row.get('error'))[-200:]}")
            continue
        pred = row.get("pred_step_time_s")
        if pred is None:
            print(f"{describe(cfg):<44}{row['step_time_s'] * 1e3:>12.1f}  no prediction: {row.get('pred_error')}")
            continue
        err = pred / row["step_time_s"] - 1
        errors.append(err)
        terms = " ".join(f"{row[f'pred_{t}_s'] * 1e3:.1f}" for t in TERMS)
        print(f"{describe(cfg):<44}{row['step_time_s'] * 1e3:>12.1f}{row['spread']:>12}{pred * 1e3:>10.1f}"
              f"{err:>+8.1%}   {terms}")
    print_spread("|error|", errors, f" (profile: {rows[0].get('pred_profile')})")
    return errors


def print_memory_table(cfgs, rows) -> list[float]:
    """Measured step peak (max over ranks) against the predicted one (max over pipeline stages)."""
    MiB = 2**20
    print(f"\n{'config':<44}{'measured MiB':>13}{'predicted':>10}{'error':>8}   per rank measured (MiB)")
    errors = []
    for cfg, row in zip(cfgs, rows):
        pred, measured = row.get("pred_peak_mem_bytes"), row.get("peak_mem_bytes")
        if row["status"] != "ok" or pred is None or not measured:
            continue
        err = pred / measured - 1
        errors.append(err)
        per_rank = " ".join(f"{b / MiB:.1f}" for b in json.loads(row["peak_mem_bytes_per_rank"]))
        print(f"{describe(cfg):<44}{measured / MiB:>13.1f}{pred / MiB:>10.1f}{err:>+8.1%}   {per_rank}")
    print_spread("peak memory |error|", errors)
    return errors


def print_spread(label: str, errors: list[float], note: str = "") -> None:
    if errors:
        absolute = [abs(e) for e in errors]
        print(f"{label}: median {statistics.median(absolute):.1%}, max {max(absolute):.1%} over {len(errors)} "
              f"configs{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted(SETS), default="world2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds; each config's median round is compared (one step time drifts 5-10 %%)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                    help="run the set with this activation recomputation (configs whose backend lacks it are skipped)")
    ap.add_argument("--calibrate", action="store_true",
                    help="first run `bench calibrate --world W` (W: the set's largest world) into a temporary "
                         "profiles folder, so that the profile sees the machine as the measurement does")
    ap.add_argument("--out", default=None, help="also write the rows to OUT/runs/<run_id>.json (for `bench report OUT`)")
    args = ap.parse_args()
    cfgs = configs(args.set, args.steps, args.warmup, args.dtype, args.recompute)
    if args.calibrate:
        calibrate_now(max(c.world for c in cfgs))
    rounds = measure(cfgs, args.repeats)
    rows = [median_row(r) for r in rounds]
    print_table(cfgs, rows)
    print_memory_table(cfgs, rows)
    if args.out:
        from bench.results.store import ResultStore
        store = ResultStore(args.out)
        for row in (row for config_rounds in rounds for row in config_rounds):
            store.write(row)


def calibrate_now(world: int) -> None:
    import os
    import tempfile

    from bench.calibrate import calibrate, write_profile
    folder = tempfile.mkdtemp(prefix="parabench-profiles-")
    os.environ["PARABENCH_PROFILES"] = folder  # the rank pools started next inherit it
    path = write_profile(calibrate(world))
    print(f"calibrated: {path}")


if __name__ == "__main__":
    main()
