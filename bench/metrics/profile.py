"""`--profile`: a torch.profiler trace of one extra, untimed step per rank, and where its time went.

The worker runs the profiled step after every measured one (the profiler slows what it records, so
it never touches a timed step), and each rank writes into the run's trace folder:

    trace_rank<r>.json   Chrome / Perfetto trace (open in https://ui.perfetto.dev or chrome://tracing)
    ops_rank<r>.md       where the step's time went, then the top ops by self time. CPU: the rank's main
                         thread's compute, communication (time inside collectives and P2P and the ops
                         that wait for them) and idle (the wall time outside any op: Python, the OS
                         scheduler, and the wait for an asynchronous collective, since `work.wait()` is
                         no op). An accelerator: its kernels, whose launches return at once, so CPU
                         self-time says nothing: compute (any compute kernel running), exposed
                         communication (only communication kernels running) and idle (no kernel)

`check_writable` runs before anything starts, so a folder the ranks cannot write is refused in one line.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

COMM_MARKERS = ("c10d::", "gloo:", "nccl:", "record_param_comms", "send", "recv", "wait", "all_reduce",
                "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "barrier")
"""Op names that are communication (the c10d ops, the backends' own ranges, P2P and work.wait)."""
TOP_OPS = 15


def check_writable(folder: str | os.PathLike) -> None:
    """Raise ValueError (one line) when the traces cannot be written under `folder`."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".profile-check-"):
            pass
    except OSError as e:
        raise ValueError(f"--profile: cannot write traces to {folder} ({e.strerror or e}); "
                         "choose a writable folder") from None


def is_comm(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


class StepProfile:
    """Context manager: profile what runs inside it on this rank, then write the trace and the op table."""

    def __init__(self, folder: str | os.PathLike, rank: int, device):
        self.folder, self.rank, self.device = Path(folder), rank, device

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        from bench import device as bench_device
        self._on_device = bench_device.for_device(self.device).is_accelerator
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync = lambda: bench_device.synchronize(self.device)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        wall_s = time.perf_counter() - self._t0
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.folder / f"trace_rank{self.rank}.json"))
            (self.folder / f"ops_rank{self.rank}.md").write_text(self.table(wall_s))

    def split(self, wall_s: float) -> dict[str, float]:
        if self._on_device:
            from torch.autograd import DeviceType
            kernels = [(e.name, e.time_range.start, e.time_range.end) for e in self._prof.events()
                       if e.device_type != DeviceType.CPU]
            return kernel_split(kernels, wall_s)
        return self.host_split(wall_s)

    def host_split(self, wall_s: float) -> dict[str, float]:
        """Seconds of compute, communication and idle on the main thread (the one the step started on),
        from each op's self time. An op that directly wraps a collective (an autograd Function around
        an all-reduce, say) counts as communication: its self time is mostly the wait for it."""
        events = sorted(self._prof.events(), key=lambda e: e.time_range.start)
        main = [e for e in events if e.thread == events[0].thread] if events else []
        comm = compute = 0.0
        for e in main:
            waits = is_comm(e.name) or any(is_comm(c.name) for c in e.cpu_children)
            comm, compute = (comm + e.self_cpu_time_total, compute) if waits else (comm, compute + e.self_cpu_time_total)
        comm, compute = comm / 1e6, compute / 1e6
        return {"compute": compute, "communication": comm, "idle": max(0.0, wall_s - comm - compute)}

    def table(self, wall_s: float) -> str:
        split = self.split(wall_s)
        lines = [f"# profiled step, rank {self.rank}: {wall_s * 1e3:.1f} ms wall", "",
                 "| part | ms | share |", "|---|---:|---:|"]
        lines += [f"| {part} | {s * 1e3:.1f} | {s / wall_s:.0%} |" for part, s in split.items()]
        lines += ["", f"## top {TOP_OPS} ops by self time (every thread)", "",
                  "| op | kind | calls | self ms | total ms |", "|---|---|---:|---:|---:|"]
        ops = sorted(self._prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_OPS]
        lines += [f"| `{a.key}` | {'comm' if is_comm(a.key) else 'compute'} | {a.count} | "
                  f"{a.self_cpu_time_total / 1e3:.1f} | {a.cpu_time_total / 1e3:.1f} |" for a in ops]
        return "\n".join(lines) + "\n"


def kernel_split(kernels: list[tuple[str, float, float]], wall_s: float) -> dict[str, float]:
    """Seconds of a device's step from its kernels, (name, start µs, end µs): compute (some compute
    kernel running, whatever else is), exposed communication (only communication kernels running:
    what overlap did not hide) and idle (no kernel: launch gaps, host syncs, waiting for a peer)."""
    compute = _union([(a, b) for name, a, b in kernels if not is_comm(name)])
    busy = _union([(a, b) for _, a, b in kernels])
    compute_s, busy_s = _length(compute) / 1e6, _length(busy) / 1e6
    return {"compute": compute_s, "communication": busy_s - compute_s, "idle": max(0.0, wall_s - busy_s)}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)
