"""Probe overhead on the native engine: step time with the probes off, with the timed-step probes on
(the step timer; on CUDA also the free peak-memory probe), and with the instruments the worker only ever runs on separate,
untimed steps (the pipeline busy/idle meter; the communication and host-sync counters).

Variants alternate step by step, so load on the machine hits them alike; medians are reported.

    .venv/bin/python benchmarks/probe_overhead.py --pp 2 --micro-batches 4 --rounds 15
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def _probe(cfg_dict: dict, rounds: int) -> dict | None:
    """Body of every rank (a RankPool call): step times of each variant, the slowest rank's on rank 0."""
    from bench.config import RunConfig
    from bench.distributed import rank_session
    from bench.worker import trainer_on_rank
    cfg = RunConfig.from_dict(cfg_dict)
    with rank_session("cpu") as device, trainer_on_rank(cfg, device) as (trainer, groups):
        return _probe_trainer(trainer, groups, rounds)


def _probe_trainer(trainer, groups, rounds: int) -> dict | None:
    import torch
    import torch.distributed as dist
    from bench.metrics.comm import CommCounter
    from bench.metrics.sync import HostSyncCounter
    from bench.metrics.timer import StepTimer
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = trainer.batch(0)  # built once: the worker builds each step's batch outside the timer too
    for _ in range(2):
        trainer.train(batch)
    times = {"off": [], "probes": [], "meter": [], "counter": []}

    def timed(name, *probes):
        dist.barrier()
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for probe in probes:
                stack.enter_context(probe)
            trainer.train(batch)
        times[name].append(time.perf_counter() - t0)

    for _ in range(rounds):
        timed("off")
        timed("probes", StepTimer(torch.device("cpu")))  # what wraps a timed step on CPU
        timed("meter", trainer.meter())
        timed("counter", CommCounter.for_groups(groups), HostSyncCounter())
    slowest = [None] * world
    dist.all_gather_object(slowest, times)
    return {k: [max(t[k][i] for t in slowest) for i in range(rounds)] for k in times} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    from bench.config import RunConfig
    from bench.spawn import RankPool
    cfg = RunConfig(model=args.model, tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches)
    with RankPool(cfg.world) as pool:
        times = pool.call(_probe, cfg.to_dict(), args.rounds, timeout_s=1800)[0]
    base = statistics.median(times["off"])
    print(f"model {args.model} tp={args.tp} pp={args.pp} dp={args.dp} m={args.micro_batches}, "
          f"{args.rounds} rounds, median step (slowest rank):")
    for name, label in (("off", "probes off"), ("probes", "step timer (timed steps)"),
                        ("meter", "pipeline bubble meter (its own untimed step)"),
                        ("counter", "comm + host-sync counters (untimed step only)")):
        med = statistics.median(times[name])
        print(f"  {label:<44}{med * 1e3:>9.2f} ms  {100 * (med / base - 1):+6.1f} %")


if __name__ == "__main__":
    main()
