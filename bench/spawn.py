"""The one process spawner: N rank processes on this machine, kept warm, that run a function on every rank.

`RankPool(world).call(fn, *args)` runs `fn(*args)` on every rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR set, a fresh MASTER_PORT per call) and returns what each rank returned; `run(cfg)` runs the
benchmark worker on a RunConfig and always returns its row. The local launcher, the tests' parity
harness and the benchmarks all start their processes here.

The ranks stay warm across calls (interpreter start-up and imports are most of a small run on this
machine); each call brings its own process groups. A call that fails or hangs gets its processes
killed, and the pool starts new ones for the next call. `fn` must be importable by name (a module-level
function) and its arguments and results picklable; return numpy arrays rather than torch tensors,
which would travel as shared memory that dies with the rank.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import socket
import time
from typing import Callable

from bench.config import RunConfig
from bench.analysis.estimate import with_predictions
from bench.results import classify_error, failure_row

MAX_RANK_THREADS = 64
"""A warm rank holds about 7-11 threads between runs (torch's own and a cached gloo group or two);
past this bound something leaks, and the rank is retired."""
_RANK_ENV = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    """A call that did not finish on every rank; `status` is the row status it maps to."""

    def __init__(self, status: str, message: str, rank: int | None = None):
        super().__init__(message)
        self.status, self.rank = status, rank


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launching process dies, even by SIGKILL (a killed sweep leaves no ranks)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before prctl took effect
        os._exit(1)


def _rank_main(rank: int, world: int, tasks: mp.Queue, results: mp.Queue, log: str | None = None) -> None:
    """Body of one rank process: run the calls from `tasks` until told to stop."""
    _die_with_parent()
    if log:  # a sweep keeps the terminal for its progress; library chatter goes to the log
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)  # N ranks on 2 cores: more threads only oversubscribe
    from bench import worker  # imported before "ready", so that it never counts against a run's time
    worker.keep_freed_memory()  # every call on the pool (runs, calibration) meets the same allocator
    results.put((rank, "ready", None))
    while (task := tasks.get()) is not None:
        fn, args, port = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            results.put((rank, "ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
            results.put((rank, "error", worker.format_exception(exc)))
        # A run's process groups sit in reference cycles (engines, hooks, meshes), and each gloo group
        # keeps a device loop and two worker threads until it is freed: without a collection after every
        # call a warm rank gathered hundreds of threads over the test suite, which then ran 3x slower.
        gc.collect()


def _worker_row(cfg_dict: dict, trace_dir: str | None = None) -> dict | None:
    """One benchmark run on this rank (the row on rank 0)."""
    from bench import worker
    return worker.run(RunConfig.from_dict(cfg_dict), trace_dir)


class RankPool:
    def __init__(self, world: int, log: str | os.PathLike | None = None):
        """`log`: a file that receives the ranks' stdout and stderr (default: inherited)."""
        self.world = world
        self.log = str(log) if log else None
        self._procs: list[mp.Process] = []

    def run(self, cfg: RunConfig, trace_dir: str | None = None, hardware=None) -> dict:
        """Run `cfg` on the pool; always returns a row (status ok, failed, oom or timeout). `trace_dir`:
        where a profiled run (cfg.profile) writes its traces; `hardware`: the profile to predict it on
        (default: `estimate.row_hardware`'s)."""
        if cfg.world != self.world:
            raise ValueError(f"pool of {self.world} ranks cannot run world size {cfg.world}")
        try:
            row = self.call(_worker_row, cfg.to_dict(), trace_dir, timeout_s=cfg.timeout_s)[0]
        except RankFailure as failure:
            return failure_row(cfg, failure.status, str(failure), failure.rank)
        if row is None:  # never hand a caller None: the row is the record of the run
            return failure_row(cfg, "failed", "rank 0 finished without a result row", 0)
        return with_predictions(cfg, row, hardware)

    def call(self, fn: Callable, *args, timeout_s: float = 600.0) -> list:
        """`fn(*args)` on every rank; the value each rank returned, by rank. Raises RankFailure (and
        kills the ranks, which may wait forever in a collective) when a rank fails, dies or runs past
        `timeout_s` (counted after start-up)."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.kill()
            self._start()
            self._wait_ready()
        port = free_port()
        for q in self._tasks:
            q.put((fn, args, port))
        values, deadline = {}, time.monotonic() + timeout_s
        while len(values) < self.world:
            try:
                rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self.kill()
                    raise RankFailure("timeout", f"run exceeded timeout_s={timeout_s:g} s; processes killed "
                                                 "(a hung collective or a slow run)") from None
                continue
            if status == "error":
                self.kill()
                raise RankFailure(classify_error(payload), f"rank {rank} failed:\n{payload}", rank)
            values[rank] = payload
        self._retire_if_bloated()
        return [values[r] for r in range(self.world)]

    def _retire_if_bloated(self) -> None:
        """Stop the ranks once one holds more than MAX_RANK_THREADS threads (the next call starts fresh
        ones): a group held from torch's C++ side (a tensor hook that keeps its engine: bench.native.data)
        escapes the collection, and a warm rank must not slow every run after it."""
        import psutil
        try:
            threads = max(psutil.Process(p.pid).num_threads() for p in self._procs)
        except psutil.Error:
            return
        if threads > MAX_RANK_THREADS:
            self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        saved = {k: os.environ.get(k) for k in _RANK_ENV}
        os.environ.update(_RANK_ENV)  # inherited by the children at start
        try:
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(self.world)]
            self._procs = [ctx.Process(target=_rank_main, args=(r, self.world, self._tasks[r], self._results, self.log),
                                       daemon=True, name=f"bench-rank{r}") for r in range(self.world)]
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def _wait_ready(self, limit_s: float = 300.0) -> None:
        """Wait until every new rank has imported torch and the suite (seconds on a busy machine), so
        that start-up never counts against a call's timeout. Raises RankFailure if a rank dies."""
        ready, deadline = 0, time.monotonic() + limit_s
        while ready < self.world:
            try:
                rank, status, payload = self._results.get(timeout=0.2)
                ready += status == "ready"
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    why = (f"rank {dead[0]} exited during start-up" if dead
                           else f"ranks not ready after {limit_s:g} s of start-up")
                    raise RankFailure("failed", why, dead[0] if dead else None)

    def _check_alive(self) -> None:
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            code = self._procs[dead[0]].exitcode
            self.kill()
            raise RankFailure("oom" if code == -9 else "failed", f"rank {dead[0]} exited with code {code}"
                              + (" (killed: out of memory?)" if code == -9 else ""), dead[0])

    def kill(self) -> None:
        import psutil
        for p in self._procs:
            if p.is_alive():
                try:
                    for child in psutil.Process(p.pid).children(recursive=True):
                        child.kill()
                except psutil.Error:
                    pass
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []

    def close(self) -> None:
        if self._procs:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
