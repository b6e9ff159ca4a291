"""Local launcher: a run of world size N as N real processes on this machine.

`RankPool` keeps N rank processes warm across runs (imports and interpreter start-up are most of a
small run on this machine); each run gets a fresh port and fresh process groups. A run that fails
or hangs gets its processes killed, and the pool starts new ones for the next run.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time

from bench.config import RunConfig
from bench.metrics.memory import MALLOC_ENV
from bench.results import classify_error, failure_row

_RANK_ENV = {**MALLOC_ENV, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Body of one rank process: run configs from `tasks` until told to stop."""
    _die_with_parent()
    if log:  # a sweep keeps the terminal for its progress; library chatter goes to the log
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)  # N ranks on 2 cores: more threads only oversubscribe
    from bench import worker
    results.put((rank, "ready", None))  # imports done: the run's time limit starts after this
    while (task := tasks.get()) is not None:
        cfg_dict, port = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            results.put((rank, "ok", worker.run(RunConfig.from_dict(cfg_dict))))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
            results.put((rank, "error", worker.format_exception(exc)))


class RankPool:
    def __init__(self, world: int, log: str | os.PathLike | None = None):
        """`log`: a file that receives the ranks' stdout and stderr (default: inherited)."""
        self.world = world
        self.log = str(log) if log else None
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        saved = {k: os.environ.get(k) for k in _RANK_ENV}
        os.environ.update(_RANK_ENV)  # inherited by the children at start (malloc reads it then)
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

    def run(self, cfg: RunConfig) -> dict:
        """Run `cfg` on the pool; always returns a row (status ok, failed, oom or timeout)."""
        if cfg.world != self.world:
            raise ValueError(f"pool of {self.world} ranks cannot run world size {cfg.world}")
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.kill()
            self._start()
            failed = self._wait_ready(cfg)
            if failed is not None:
                return failed
        port = free_port()
        for q in self._tasks:
            q.put((cfg.to_dict(), port))
        deadline, done, row = time.monotonic() + cfg.timeout_s, 0, None
        while done < self.world:
            try:
                rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    self.kill()
                    return failure_row(cfg, "oom" if code == -9 else "failed",
                                       f"rank {dead[0]} exited with code {code}"
                                       + (" (killed: out of memory?)" if code == -9 else ""), dead[0])
                if time.monotonic() > deadline:
                    self.kill()
                    return failure_row(cfg, "timeout", f"run exceeded timeout_s={cfg.timeout_s:g} s; "
                                       "processes killed (a hung collective or a slow run)")
                continue
            if status == "error":
                self.kill()  # the others may wait forever in a collective
                return failure_row(cfg, classify_error(payload), f"rank {rank} failed:\n{payload}", rank)
            done += 1
            row = payload if rank == 0 else row
        if row is None:  # never hand a caller None: the row is the record of the run
            return failure_row(cfg, "failed", "rank 0 finished without a result row", 0)
        return row

    def _wait_ready(self, cfg: RunConfig, limit_s: float = 300.0) -> dict | None:
        """Wait until every new rank has imported torch and the suite (seconds on a busy machine), so
        that start-up never counts against a run's timeout_s. Returns a failure row if a rank dies."""
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
                    return failure_row(cfg, "failed", why, dead[0] if dead else None)
        return None

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


def run_local(cfg: RunConfig) -> dict:
    """One run in fresh processes."""
    with RankPool(cfg.world) as pool:
        return pool.run(cfg)


def run_debug(cfg: RunConfig) -> dict:
    """In this process, world size 1: for debuggers and profilers."""
    if cfg.world != 1:
        raise ValueError(f"the debug launcher runs world size 1 only, not {cfg.world}")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    from bench import worker
    try:
        return worker.run(cfg)
    except Exception as exc:  # noqa: BLE001
        text = worker.format_exception(exc)
        return failure_row(cfg, classify_error(text), f"rank 0 failed:\n{text}", 0)
