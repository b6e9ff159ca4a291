"""How fast `bench plan` answers, against issue 22's targets: Llama-2-70B on 1,024 H100s under 0.5 s and
Llama-3.1-405B on 16,384 H100s (Meta's batch: 2,048 sequences of 8,192 tokens) under 1 s, both with
`--engines any` (the larger search space), as a fresh `bench` process (interpreter start-up and imports
count, as a user waits for them). Also the planner alone, in-process: `plan()` timed in a fresh
interpreter each repeat (its caches start cold, as in the CLI; wall and its own CPU time), and `bench
layout` of one GPU (the start-up floor).

Each command runs `--repeats` times; the median and the fastest wall time are printed (the fastest is
the least disturbed by other jobs on a shared machine), and the CPU time (user + system) of the
fastest, which load does not inflate as much. The verdict reads the median.

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
PLANS = (  # (name, plan() arguments, target seconds of the CLI)
    ("plan llama2-70b on 1,024 GPUs", ("llama2-70b", 1024, 8, "h100-sxm", 1024, 4096), 0.5),
    ("plan llama3.1-405b on 16,384", ("llama3.1-405b", 16384, 8, "h100-sxm", 2048, 8192), 1.0),
)


def cli_args(model: str, gpus: int, per_node: int, hardware: str, batch: int, seq: int) -> list[str]:
    return ["plan", "--model", model, "--gpus", str(gpus), "--gpus-per-node", str(per_node), "--hardware", hardware,
            "--global-batch", str(batch), "--seq", str(seq), "--top", "5", "--engines", "any"]


def bench_command() -> list[str]:
    """The installed entry point beside this interpreter, else `python -m bench.cli`."""
    script = Path(sys.executable).parent / "bench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "bench.cli"]


def times(command: list[str], repeats: int) -> list[tuple[float, float, str]]:
    """(wall, cpu) seconds and stdout of each run of `command` (the in-process runs print their own time)."""
    out = []
    for _ in range(repeats):
        cpu0, t0 = _children_cpu(), time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
        out.append((time.perf_counter() - t0, _children_cpu() - cpu0, done.stdout))
    return out


def in_process(args: tuple, repeats: int) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of `plan(*args)` alone, each in a fresh interpreter (imports not counted, caches
    cold): the CPU time is the planner's own, which other jobs on a shared machine inflate less."""
    code = ("import time; from bench.analysis.planner import plan; t0, c0 = time.perf_counter(), time.process_time(); "
            f"plan(*{args!r}, top=5, engines='any'); print(time.perf_counter() - t0, time.process_time() - c0)")
    return [tuple(map(float, out.split())) for _, _, out in times([sys.executable, "-c", code], repeats)]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _line(name: str, runs: list[tuple[float, float]], target: float | None) -> str:
    median = statistics.median(w for w, _ in runs)
    fastest, cpu = min(runs)
    verdict = "" if target is None else f"< {target:g} s " + ("ok" if median < target else "MISSED")
    return f"{name:<40} {median:>7.3f}s {fastest:>7.3f}s {cpu:>7.3f}s  {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"{'command':<40} {'median':>8} {'fastest':>8} {'its cpu':>8}  target (median wall)")
    layout = times(bench_command() + ["layout", "--tp", "1", "--pp", "1", "--dp", "1"], repeats)
    print(_line("bench layout 1 GPU (start-up)", [r[:2] for r in layout], None))
    for name, args, target in PLANS:
        print(_line(f"{name}, in-process", in_process(args, repeats), None))
        print(_line(f"bench {name}", [r[:2] for r in times(bench_command() + cli_args(*args), repeats)], target))
    if Path("/proc/loadavg").exists():
        print(f"(load average {Path('/proc/loadavg').read_text().split()[0]} at the end)")


if __name__ == "__main__":
    main()
