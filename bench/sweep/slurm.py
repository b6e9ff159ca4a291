"""Slurm launcher: one Slurm job per run through submitit, runs of one shape submitted as a job array.

Each run is a job of `nodes` × `tasks_per_node` tasks (one task per rank). Every task calls
`slurm_task`, which leaves torch.distributed to `bench.distributed.init_from_env` (submitit's
TorchDistributedEnvironment maps the SLURM_* variables to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR
and draws MASTER_PORT from the job id): no torchrun inside the job. Rank 0 writes the
run's row to the results store itself, so a sweep process that dies loses no finished run; the sweep
writes only the rows of jobs that ended without one (failed, timeout, oom, cancelled: a time limit, an
scancel or a preemption, with Slurm's own state as the reason). A sweep that stops (Ctrl-C, an error)
cancels every job it has not collected and waits until Slurm has ended them.

Cluster settings live in named profiles, slurm/profiles/<name>.yaml (keys: PROFILE_KEYS); a sweep file
may override any of them under `launcher:`. A profile is a pydantic dataclass (strict types, bounds
in the annotations; see bench/typed_yaml.py for why pydantic): the file and the overrides are checked
by the same types, and a mistake names its file and key.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Callable

import pydantic
from annotated_types import Ge, Gt
from pydantic import Strict

from bench.config import RunConfig
from bench.analysis.estimate import with_predictions
from bench.results import Status, classify_error, failure_row
from bench.sweep.launcher import Launcher
from bench.results.store import ResultStore
from bench.typed_yaml import FileError, file_error, known_keys, load_yaml, suggest

PROFILE_DIR = Path(__file__).resolve().parents[2] / "slurm" / "profiles"


Count = Annotated[int, Ge(0)]
Positive = Annotated[int, Ge(1)]
Lines = Annotated[tuple[str, ...], Strict(False)]  # YAML lists become tuples (the profile is frozen)


@pydantic.dataclasses.dataclass(frozen=True, config=pydantic.ConfigDict(strict=True, extra="forbid",
                                                                       allow_inf_nan=False))
class SlurmProfile:
    name: str = "local"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    ranks_per_node: Positive = 8
    """Most ranks (tasks) one node runs: a run of world size W takes ceil(W / ranks_per_node) nodes
    (with gpus_per_node set, one rank per GPU: ceil(W / gpus_per_node))."""
    nodes: Positive | None = None
    """Fixed node count (overrides ranks_per_node); the world size must be a multiple of it."""
    gpus_per_node: Count = 0
    """GPUs requested per node, one rank each (0: request none); it must divide every larger world size."""
    cpus_per_task: Count = 1
    mem_gb: Annotated[float, Gt(0)] | None = None
    time_min: Count | None = None
    """Job time limit; default: the run's timeout_s in minutes, rounded up, plus 2 for start-up."""
    max_parallel: Positive = 8
    """Concurrency cap of each job array (the %N of --array)."""
    exclusive: bool = False
    """Whole nodes per job (--exclusive): use for timed runs."""
    requeue: bool = False
    """A preempted job goes back to the queue and runs again (--requeue; the row's slurm_attempts counts the
    starts); false: it ends, a cancelled row (--no-requeue). Needs an output folder every node sees."""
    setup: Lines = ()
    """Shell lines run in the batch script before the tasks start (module load, venv activation…)."""
    env: dict = field(default_factory=dict)
    """Environment variables exported before the tasks start."""
    srun_args: Lines = ("--kill-on-bad-exit=1",)
    """A rank that fails takes the others down instead of leaving them in a collective."""
    signal_delay_s: Count = 30
    """Seconds before the time limit that Slurm signals the job (USR2, submitit's handler); Slurm sends it up to
    30 s earlier still, so keep it well below the time limit (with a 1-minute limit: 0, none)."""
    slurm_additional_parameters: dict = field(default_factory=dict)
    """Any other sbatch option, e.g. {reservation: my-res}."""
    poll_s: Annotated[float, Gt(0)] = 1.0
    """How often the sweep looks at its jobs (result files; sacct at most every 2 s)."""

    def shape(self, cfg: RunConfig) -> tuple[int, int]:
        """(nodes, tasks per node) of a run."""
        nodes = self.nodes or math.ceil(cfg.world / (self.gpus_per_node or self.ranks_per_node))
        return nodes, math.ceil(cfg.world / nodes)

    def problem(self, cfg: RunConfig, cluster_nodes: int) -> str | None:
        """Why no run of this shape can go to this cluster, as one line naming the key and the fix (the
        sweep is refused before anything is submitted); `cluster_nodes`: the partition's node count."""
        nodes, _ = self.shape(cfg)
        if self.gpus_per_node and cfg.world > self.gpus_per_node and cfg.world % self.gpus_per_node:
            return (f"slurm profile {self.name}: gpus_per_node = {self.gpus_per_node} does not divide world size "
                    f"{cfg.world} (one rank per GPU, whole nodes): choose gpus_per_node dividing {cfg.world}, or a "
                    f"world size that is a multiple of {self.gpus_per_node}")
        if nodes > cluster_nodes:
            per_node = "gpus_per_node" if self.gpus_per_node else "ranks_per_node"
            asked, fix = ((f"nodes = {nodes}", f"set nodes ≤ {cluster_nodes}") if self.nodes else
                          (f"world size {cfg.world} at {per_node} = {getattr(self, per_node)} needs {nodes} nodes",
                           f"raise {per_node} or use a smaller world size"))
            return (f"slurm profile {self.name}: {asked}, but partition {self.partition or '(default)'} has "
                    f"{cluster_nodes}: {fix}")
        return None

    def unsupported(self, cfg: RunConfig) -> str | None:
        nodes, per_node = self.shape(cfg)
        if nodes * per_node != cfg.world:
            return (f"slurm profile {self.name}: world size {cfg.world} does not split evenly over {nodes} "
                    f"node(s); pick nodes dividing the world size")
        if self.gpus_per_node and per_node > self.gpus_per_node:
            return (f"slurm profile {self.name}: {per_node} ranks per node but gpus_per_node is "
                    f"{self.gpus_per_node}")
        return None

    def time_limit(self, cfg: RunConfig) -> int:
        return self.time_min or math.ceil(cfg.timeout_s / 60) + 2


PROFILE_KEYS = tuple(f.name for f in fields(SlurmProfile) if f.name != "name")


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name: str, overrides: dict | None = None, source: str = "<launcher>",
                 prefix: str = "launcher.", from_cli: bool = False) -> SlurmProfile:
    """slurm/profiles/<name>.yaml (or a path to a YAML file) with the sweep file's overrides on top.
    Errors name the sweep file and key (`source`, `prefix`), the profile file, or `--profile` (from_cli)."""
    path = Path(name) if str(name).endswith((".yaml", ".yml")) else PROFILE_DIR / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        known = profile_names()
        where = ("--profile", "") if from_cli else (source, f"{prefix}profile")
        raise FileError(*where, f"unknown slurm profile {name!r}{suggest(name, known)} "
                                f"(profiles in {PROFILE_DIR}: {', '.join(known) or 'none'})")
    data = load_yaml(path, "slurm profile") or {}
    if not isinstance(data, dict):
        raise FileError(str(path), "", "a profile is a mapping of keys: " + ", ".join(PROFILE_KEYS))
    profile = _profile(path.stem, data, str(path), "")  # the file alone first: its own mistakes name it
    return _profile(path.stem, {**data, **overrides}, source, prefix) if overrides else profile


def _profile(name: str, values: dict, source: str, prefix: str) -> SlurmProfile:
    unknown = known_keys("slurm profile key", PROFILE_KEYS)
    if "name" in values:  # the file's name is the profile's name
        raise FileError(source, f"{prefix}name", unknown(("name",)))
    try:
        return SlurmProfile(name=name, **{str(k): v for k, v in values.items()})
    except pydantic.ValidationError as e:
        raise file_error(e, source, prefix, unknown, values) from None


def slurm_task(cfg_dict: dict, store: ResultStore, submitted: float) -> dict | None:
    """Body of every Slurm task (one per rank). Rank 0 writes the row to `store` and returns it; the others
    return None. `submitted`: time.time() when the sweep submitted the job."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # sbatch exports the submitter's environment: never inherit a rank
    import torch
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from bench import worker
    cfg = RunConfig.from_dict(cfg_dict)
    row = worker.run(cfg)
    if row is None:
        return None
    row = with_predictions(cfg, row)
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    row["slurm_job_id"] = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID")
    row["slurm_attempts"] = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    row["wall_s"] = time.time() - submitted  # includes waiting in the array (the cluster's clocks agree)
    return store.write(row)  # at once, and only here: the row survives a sweep process that died meanwhile


class SlurmLauncher(Launcher):
    kind = "slurm"

    def __init__(self, profile: SlurmProfile, store: ResultStore, sweep: str):
        """`store`: the ResultStore each run's rank 0 writes its row to (its folder also holds the job logs)."""
        self.profile, self.store, self.out, self.sweep = profile, store, store.out, sweep
        self.jobs: list = []

    def unsupported(self, cfg: RunConfig) -> str | None:
        return self.profile.unsupported(cfg)

    def check_ready(self, runs: list[RunConfig]) -> None:
        """Fail before anything is written when this machine cannot submit (and watch) Slurm jobs, or when
        the profile asks for what the cluster cannot give these runs (`SlurmProfile.problem`)."""
        import shutil
        missing = [tool for tool in ("sbatch", "srun", "sacct", "scancel", "sinfo") if shutil.which(tool) is None]
        if missing:
            raise ValueError(f"the slurm launcher needs {', '.join(missing)} on PATH (no Slurm here?); start the "
                             "local test cluster with slurm/local-cluster/start.sh, or use --launcher local")
        hosts = partition_hosts(self.profile.partition)
        for cfg in runs:
            problem = self.profile.problem(cfg, len(hosts))
            if problem:
                raise ValueError(problem)
        if self.profile.requeue and runs:
            problem = unshared_reason(self.out, hosts)
            if problem:
                raise ValueError(f"slurm profile {self.profile.name}: requeue = true, but {problem}: put --out on a "
                                 "file system every node mounts, or set requeue: false")

    def _executor(self, cfg: RunConfig, count: int):
        import submitit

        p = self.profile
        nodes, per_node = p.shape(cfg)
        ex = submitit.AutoExecutor(folder=self.out / "slurm" / "%j", cluster="slurm")
        params = dict(name=f"bench-{self.sweep}", nodes=nodes, tasks_per_node=per_node,
                      cpus_per_task=p.cpus_per_task, timeout_min=p.time_limit(cfg),
                      slurm_array_parallelism=min(p.max_parallel, count),
                      slurm_setup=[*(f"export {k}={v}" for k, v in p.env.items()), *p.setup],
                      slurm_srun_args=list(p.srun_args), slurm_signal_delay_s=p.signal_delay_s,
                      slurm_additional_parameters=dict(p.slurm_additional_parameters))
        if p.gpus_per_node:
            params["gpus_per_node"] = p.gpus_per_node
        if p.mem_gb:
            params["mem_gb"] = p.mem_gb
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(p, key):
                params[f"slurm_{key}"] = getattr(p, key)
        if p.exclusive:  # submitit writes --exclusive=False for False, which sbatch rejects
            params["slurm_exclusive"] = True
        params["slurm_additional_parameters"]["requeue" if p.requeue else "no-requeue"] = True  # Slurm's default: requeue
        ex.update_parameters(**params)
        return ex

    def launch(self, runs: list[RunConfig], started: Callable, finished: Callable) -> None:
        """Submit every run (one array per job shape), then report each as it starts and ends."""
        groups: dict[tuple, list[RunConfig]] = {}
        for cfg in runs:
            groups.setdefault((*self.profile.shape(cfg), self.profile.time_limit(cfg)), []).append(cfg)
        pending = []
        try:
            for cfgs in groups.values():
                ex = self._executor(cfgs[0], len(cfgs))
                now = time.time()
                with ex.batch():
                    jobs = [ex.submit(slurm_task, cfg.to_dict(), self.store, now) for cfg in cfgs]
                submitted = time.monotonic()
                pending += [_Tracked(cfg, job, submitted, self.profile.requeue) for cfg, job in zip(cfgs, jobs)]
            self.jobs = [t.job for t in pending]
            self._watch(pending, started, finished)
        except BaseException:  # Ctrl-C or an error here: do not leave jobs running unattended
            cancel_and_wait([t.job.job_id for t in pending if not t.collected])
            raise

    def _watch(self, pending: list["_Tracked"], started: Callable, finished: Callable) -> None:
        last_sacct = 0.0
        while any(not t.collected for t in pending):
            if time.monotonic() - last_sacct > 2:
                pending[0].job.watcher.update()  # one sacct call for every job of the sweep
                last_sacct = time.monotonic()
            for t in pending:
                if t.collected:
                    continue
                state = t.state()
                if not t.started and state not in ("PENDING", "UNKNOWN", "READY", "REQUEUED"):
                    t.started = time.monotonic()
                    started(t.cfg)
                row = t.outcome(state)
                if row is not None:
                    t.collected = True
                    written = row["status"] == Status.OK  # by the task itself
                    if not written:
                        row["wall_s"] = time.monotonic() - t.submitted  # includes waiting in the array
                        self.store.discard_partial(row["run_id"])  # a rank 0 killed while writing its row
                    finished(t.cfg, row, written)
            time.sleep(self.profile.poll_s)

    def close(self) -> None:
        pass


@dataclass
class _Tracked:
    cfg: RunConfig
    job: object
    submitted: float
    requeue: bool
    """Whether Slurm requeues the job when preempted (else PREEMPTED is its end)."""
    started: float = 0.0
    """monotonic time the job was first seen running (0: not yet)"""
    collected: bool = False

    def state(self) -> str:
        return self.job.watcher.get_state(self.job.job_id, mode="cache").upper()

    def _outcomes(self) -> list:
        """Per task: (outcome, value, written-at) from submitit's result pickle, or None."""
        from submitit.core.utils import pickle_load
        tasks = [self.job.task(i) for i in range(self.job.num_tasks)] if self.job.num_tasks > 1 else [self.job]
        out = []
        for task in tasks:
            path = task.paths.result_pickle
            try:
                out.append((*pickle_load(path), path.stat().st_mtime) if path.exists() else None)
            except (EOFError, OSError, ValueError):  # being written right now
                out.append(None)
        return out

    def outcome(self, state: str) -> dict | None:
        """The run's row once it is known, else None."""
        outcomes = self._outcomes()
        finished_state = state not in ("PENDING", "RUNNING", "UNKNOWN", "READY", "REQUEUED", "COMPLETING",
                                       "CONFIGURING", "SUSPENDED", "", *(("PREEMPTED",) if self.requeue else ()))
        if all(o is not None and o[0] == "success" for o in outcomes):
            return outcomes[0][1]  # the row rank 0 wrote
        if not finished_state:
            return None
        return {**failure_row(self.cfg, *self._failure(state, outcomes)), **self._ids()}

    def _failure(self, state: str, outcomes: list) -> tuple:
        # the first rank to fail is the cause; the others fail after it (a peer closed the connection)
        errors = sorted(((o[2], rank, o[1]) for rank, o in enumerate(outcomes) if o is not None and o[0] == "error"))
        errors = [(rank, text) for _, rank, text in errors]
        log = f"(Slurm state {state}; logs: {self.job.paths.stderr})"  # Slurm's reason, as sacct words it
        if state.startswith("CANCELLED"):
            return "cancelled", f"Slurm job {self.job.job_id} was cancelled {log}", None
        if state == "PREEMPTED":
            return "cancelled", f"Slurm job {self.job.job_id} was preempted and not requeued {log}", None
        if state == "TIMEOUT" or any("timed-out" in str(text) for _, text in errors):  # submitit's USR2 handler
            return "timeout", f"Slurm job {self.job.job_id} reached its time limit {log}", None
        if state == "OUT_OF_MEMORY":
            return "oom", f"Slurm job {self.job.job_id} ran out of memory {log}", None
        if errors:
            rank, text = errors[0]
            text = str(text)[-4000:]
            return classify_error(text), f"rank {rank} failed:\n{text}", rank
        return "failed", f"Slurm job {self.job.job_id} ended {state.lower()} without a result {log}", None

    def _ids(self) -> dict:
        job_id = str(self.job.job_id)
        return {"slurm_job_id": job_id, "slurm_array_task_id": job_id.split("_")[1] if "_" in job_id else None}


def partition_hosts(partition: str | None) -> dict[str, str]:
    """Node name → host name of every node of `partition` (None: the default one, sinfo's `*`), from sinfo."""
    import subprocess
    args = ["sinfo", "-h", "-N", "-o", "%N %n %P"]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"the slurm launcher cannot list the cluster's nodes ({' '.join(args)}: {e}); "
                         "is slurmctld up? (slurm/local-cluster/start.sh starts the local one)") from None
    wanted = partition or next((p for *_, p in map(str.split, out.splitlines()) if p.endswith("*")), "")
    return {node: host for node, host, p in map(str.split, out.splitlines()) if p.rstrip("*") == wanted.rstrip("*")}


NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "cifs", "smb3", "glusterfs",
                        "fuse.sshfs", "wekafs", "orangefs")


def unshared_reason(folder: Path, hosts: dict[str, str]) -> str | None:
    """Why a job requeued onto another node might not find `folder` (its pickled task, its row's home),
    or None: every node is this host (the emulated cluster), or the folder is on a network file system."""
    import socket
    if set(hosts.values()) <= {socket.gethostname(), socket.gethostname().split(".")[0]}:
        return None
    fs = mount_type(folder)
    if fs in NETWORK_FILE_SYSTEMS:
        return None
    return f"the output folder {folder} is on a local file system ({fs}) and the nodes are other hosts"


def mount_type(folder: Path) -> str:
    """File-system type of the mount holding `folder` (the longest mount point above it, /proc/mounts)."""
    path, best = str(Path(folder).resolve()), ("", "unknown")
    for line in Path("/proc/mounts").read_text().splitlines():
        point, fs = line.split()[1:3]
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
            best = (point, fs)
    return best[1]


def cancel_and_wait(job_ids: list[str], limit_s: float = 60.0) -> None:
    """scancel every job (an array task, or a whole array by its id) and wait until squeue no longer lists
    them, so that no job, and no task process, outlives the sweep that submitted it."""
    import subprocess
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return
    subprocess.run(["scancel", *ids], capture_output=True, timeout=30)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        listed = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True,
                                timeout=30)
        if listed.returncode == 0 and not listed.stdout.strip():
            return
        time.sleep(0.5)
