"""Wall time of the pure-maths commands, each as a fresh `bench` process (interpreter start-up and
imports count, as a user waits for them): `bench layout` of one GPU, `bench plan` for Llama-2-70B on
1,024 H100s (target < 1 s) and for GPT-3 175B on 16,384 A100s (target < 3 s).

Each command runs `--repeats` times; the median and the fastest wall time are printed (the fastest
is the least disturbed by other jobs on a shared machine), and the CPU time (user + system) of the
fastest, which load does not inflate as much.

    .venv/bin/python benchmarks/plan_speed.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = (  # (name, arguments, target seconds or None)
    ("layout 1 GPU", ["layout", "--tp", "1", "--pp", "1", "--dp", "1"], None),
    ("plan llama2-70b on 1,024 GPUs", ["plan", "--model", "llama2-70b", "--gpus", "1024", "--gpus-per-node", "8",
                                       "--hardware", "h100-sxm", "--global-batch", "1024", "--seq", "4096"], 1.0),
    ("plan gpt3-175b on 16,384 GPUs", ["plan", "--model", "gpt3-175b", "--gpus", "16384", "--gpus-per-node", "8",
                                       "--hardware", "a100-80gb", "--global-batch", "1536", "--seq", "2048"], 3.0),
)


def bench_command() -> list[str]:
    """The installed entry point beside this interpreter, else `python -m bench.cli`."""
    script = Path(sys.executable).parent / "bench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "bench.cli"]


def times(args: list[str], repeats: int) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each run."""
    out = []
    for _ in range(repeats):
        cpu0, t0 = _children_cpu(), time.perf_counter()
        subprocess.run(bench_command() + args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        out.append((time.perf_counter() - t0, _children_cpu() - cpu0))
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"{'command':<32} {'median':>8} {'fastest':>8} {'its cpu':>8}  target (fastest wall)")
    for name, args, target in CASES:
        runs = times(args, repeats)
        fastest, cpu = min(runs)
        verdict = "" if target is None else f"< {target:.0f} s " + ("ok" if fastest < target else "MISSED")
        print(f"{name:<32} {statistics.median(w for w, _ in runs):>7.2f}s {fastest:>7.2f}s {cpu:>7.2f}s  {verdict}")
    if Path("/proc/loadavg").exists():
        print(f"(load average {Path('/proc/loadavg').read_text().split()[0]} at the end)")


if __name__ == "__main__":
    main()
