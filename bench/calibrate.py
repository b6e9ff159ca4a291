"""`bench calibrate`: micro-benchmarks of this machine that become a hardware profile the time model
reads (bench.analysis.hardware.Calibration, bench.analysis.time_model).

Measured where the benchmark's ranks run: in RankPool ranks (one thread each, the same allocator),
with CUDA events and NCCL on a GPU node. Compute figures come from rank 0 alone; the
oversubscription factor from k ranks running the same reference block at once; the collectives from
groups of 2..world ranks among 2..world ranks running (`collective_shapes`: the other ranks sit the
call out).

    matmul            FLOP/s by dtype over square shapes, operands read cold (the efficiency curve)
    memory_bw         bytes/s of elementwise and norm kernels (add, layer norm; the median)
    activation_bw     bytes/s of each MLP activation (tanh GELU, SwiGLU) and of the loss (cross-entropy)
    composition       a fixed small GPT's forward + backward, measured / modelled from the above
    op_overhead_s     one aten op of forward + backward through tiny modules (module call, dispatch, autograd)
    optimizer         one AdamW step, per parameter (its state beyond the last-level cache) and per tensor
    collectives       seconds per op over message sizes, per op, group size and ranks running (every
                      group of those ranks busy at once)
    oversubscription  k ranks' reference-block time / one rank's
    memory_contention k ranks' time of a memory-bound kernel (operands beyond the caches) / one rank's

The profile is written to a temporary file and renamed into place: an interrupted calibration
leaves the previous profile (or none), never half of one. `for_this_machine` is the sweep's own: the
profile measured on this machine, or the quick calibration, cached under the machine's fingerprint.
"""
from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.analysis.hardware import PROFILES, Calibration, Hardware, hardware_to_dict, profile_dir

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def plan_sizes(quick: bool, cuda: bool = False) -> dict:
    """What to measure: fewer shapes, sizes and shorter timing windows with --quick; on a GPU the shapes
    and messages of a GPU's work (up to 8192² matmuls, 256 MiB messages, 256 MiB elementwise tensors)."""
    reps = (8, 4) if quick else (60, 24)  # a collective's calls per timed batch: small messages, ≥ 64 KiB
    if cuda:
        return {"matmul": (256, 1024, 4096) if quick else (128, 256, 512, 1024, 2048, 4096, 8192),
                "window_s": 0.05 if quick else 0.2, "elementwise": 1 << 26, "reps": reps,
                "comm_bytes": (4, 1 << 22, 1 << 26) if quick else (4, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)}
    return {"matmul": (32, 128, 512) if quick else (16, 32, 64, 128, 256, 512, 1024),
            "window_s": 0.03 if quick else 0.12, "elementwise": 1 << 20, "reps": reps,
            "comm_bytes": (4, 1 << 18, 1 << 22) if quick else (4, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 25)}


# --- timing ---------------------------------------------------------------------------------------
def per_call(fn, device, window_s: float, reps: int | None = None) -> float:
    """Median seconds of one call over three timed batches filling `window_s` (CUDA: events). Collectives
    pass `reps`: every rank must make the same number of calls."""
    from bench import device as bench_device
    fn()
    bench_device.synchronize(device)
    t0 = time.perf_counter()
    fn()
    bench_device.synchronize(device)
    one = max(time.perf_counter() - t0, 1e-7)
    reps = reps or max(1, int(window_s / 3 / one))
    samples = []
    for _ in range(3):
        start, end = bench_device.event(device), bench_device.event(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.seconds_until(end) / reps)
    return statistics.median(samples)


def _device():
    """This rank's device, made current (a rank above 0 would otherwise time GPU 0's idle stream)."""
    from bench.distributed import claim_device
    return claim_device("auto")


# --- compute (rank 0) -----------------------------------------------------------------------------
def matmul_curve(sizes, window_s: float) -> dict:
    """FLOP/s by dtype over square shapes, the operands cycling through enough copies (up to 64, some
    32 MiB in all) that each product reads them cold, as a training step's GEMMs do."""
    import torch
    dev = _device()
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        curve = []
        for n in sizes:
            copies = max(1, min(64, (32 << 20) // (2 * n * n * dtype.itemsize)))
            pairs = itertools.cycle([(torch.randn(n, n, device=dev, dtype=dtype),
                                      torch.randn(n, n, device=dev, dtype=dtype)) for _ in range(copies)])

            def product():
                a, b = next(pairs)
                return a @ b
            t = per_call(product, dev, window_s)
            curve.append([2.0 * n**3, 2.0 * n**3 / t])
        out[name] = curve
    return out


def memory_bandwidth(window_s: float, n: int = 1 << 20) -> dict:
    """Bytes read + written per second: `memory_bw` by plain elementwise and norm kernels (add, layer
    norm; the median), `activation_bw` by each MLP activation the model has (tanh GELU, SwiGLU's
    SiLU × up) and by the cross-entropy's forward + backward over fp32 logits (its softmax's exps and
    its fresh buffers: bytes as the time model counts them), which on a CPU are compute-bound at a
    fraction of that."""
    from bench.analysis.time_model import LOSS_BYTES_PER_LOGIT
    import torch
    import torch.nn.functional as F
    dev = _device()
    a, b, c = (torch.randn(n, device=dev) for _ in range(3))
    x = a.view(-1, 256)
    plain = [12 * n / per_call(lambda: torch.add(a, b, out=c), dev, window_s),
             8 * n / per_call(lambda: F.layer_norm(x, (256,)), dev, window_s)]
    activation = {"gelu": 8 * n / per_call(lambda: F.gelu(a, approximate="tanh"), dev, window_s),
                  "swiglu": 12 * n / per_call(lambda: F.silu(a) * b, dev, window_s)}
    logits = torch.randn(n // 4096, 4096, device=dev, requires_grad=True)  # a vocab of 4096
    targets = torch.randint(0, 4096, (n // 4096,), device=dev)
    loss_s = per_call(lambda: F.cross_entropy(logits, targets).backward(), dev, window_s)
    activation["cross_entropy"] = 2 * LOSS_BYTES_PER_LOGIT * n / loss_s
    return {"memory_bw": statistics.median(plain), "activation_bw": activation}


def op_overhead(window_s: float, blocks: int = 8) -> float:
    """Seconds per aten op of forward + backward through a stack of tiny modules (Linear, GELU,
    LayerNorm on 2×16 tensors): the work is nothing, so what is left is what every op of a model
    costs on the host (module call, dispatch, autograd, allocation)."""
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    dev = _device()
    model = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16))])
    model.to(dev)
    x = torch.randn(2, 16, device=dev)

    def step():
        model(x).sum().backward()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return per_call(step, dev, window_s) / Count.ops


def optimizer_cost(window_s: float, small: int = 64) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of AdamW, the suite's optimizer, as every backend
    runs it (no gradient clipping), fp32 state: a few large tensors give the first, many one-element
    tensors the second. Between two optimizer steps a training step's forward and backward sweep
    activations and gradients through the caches, so the optimizer meets its state in memory: the
    large tensors hold twice the last-level cache (parameter, gradient, m, v: 16 bytes a parameter)."""
    import torch
    from bench.training import make_optimizer
    dev = _device()

    def seconds(sizes):
        params = [torch.nn.Parameter(torch.randn(k, device=dev)) for k in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        return per_call(make_optimizer(params).step, dev, window_s)
    n = 8 * max(1 << 18, 2 * last_level_cache_bytes(dev) // 16 // 8)
    per_tensor = seconds([1] * small) / small
    return max(seconds([n // 8] * 8) - 8 * per_tensor, 0.0) / n, per_tensor


def last_level_cache_bytes(device) -> int:
    """The largest cache in front of the device's memory: a GPU's L2, a CPU's last level (sysfs; 32 MiB
    where it cannot be read)."""
    from bench import device as bench_device
    accel = bench_device.for_device(device)
    if accel.is_accelerator:
        return accel.l2_bytes(device)
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


def measure_compute(sizes: dict) -> dict | None:
    """Rank 0 only: every single-rank figure."""
    if int(os.environ.get("RANK", 0)) != 0:
        return None
    w = sizes["window_s"]
    per_param, per_tensor = optimizer_cost(w)
    return {"matmul": matmul_curve(sizes["matmul"], w), **memory_bandwidth(w, sizes["elementwise"]),
            "op_overhead_s": op_overhead(w), "optimizer_s_per_param": per_param, "optimizer_s_per_tensor": per_tensor,
            "reference_s": reference_seconds(8 * w)}  # ~0.1 s a call: a longer window


# A fixed transformer block, no preset of the suite: ranks running it at once give the oversubscription.
REFERENCE_BLOCK = dict(name="calibration-block", vocab=256, seq_len=256, layers=1, hidden=384, heads=6,
                       ffn_hidden=1536)


def block_seconds(window_s: float) -> float:
    """Forward + backward of REFERENCE_BLOCK (batch 1, fp32) through autograd."""
    import torch
    from models.config import GPTConfig
    from models.gpt import Block
    dev = _device()
    cfg = GPTConfig(**REFERENCE_BLOCK)
    block = Block(cfg, device=dev)
    x = torch.randn(1, cfg.seq_len, cfg.hidden, device=dev, requires_grad=True)
    return per_call(lambda: block(x).sum().backward(), dev, window_s)


# A fixed small GPT, no preset of the suite: the composition factor is the machine's, not a model's.
REFERENCE_MODEL = dict(name="calibration-model", vocab=4096, seq_len=256, layers=4, hidden=384, heads=6,
                       ffn_hidden=1536)


def reference_seconds(window_s: float) -> float:
    """Forward + backward of REFERENCE_MODEL (batch 1, fp32) through its loss: embedding, blocks, head
    and cross-entropy one after another, as a step runs them."""
    import torch
    from models.config import GPTConfig
    from models.gpt import build_model, loss_fn
    dev = _device()
    cfg = GPTConfig(**REFERENCE_MODEL)
    model = build_model(cfg, 0, dev)
    idx = torch.randint(0, cfg.vocab, (1, cfg.seq_len), device=dev)
    return per_call(lambda: loss_fn(model(idx), idx).backward(), dev, window_s)


def composition(cal: Calibration) -> float:
    """Measured / modelled forward + backward of REFERENCE_MODEL: what running a model's kernels one
    after another costs beyond each micro-benchmark alone (caches the neighbours evict, skinny operands,
    the fused attention's own rate). The time model multiplies compute by it; < 1 is taken as 1. A
    block alone, run over and over, reads ~10 % less than the blocks of a model do."""
    from types import SimpleNamespace

    from bench.analysis import time_model
    from models.config import GPTConfig
    mc = GPTConfig(**REFERENCE_MODEL)
    shape = SimpleNamespace(model_config=mc, tp=1, cp=1, cp_comm=None, micro_batch=1, seq=mc.seq_len, dtype="fp32",
                            sequence_parallel=False, recompute="none", world=1, backend="ddp")
    hw = profile_from(replace(cal, composition=1.0), None)
    c = time_model.part_costs(shape, hw, "suite")
    modelled = mc.layers * (c.layer_f + c.layer_b) + c.embed_f + c.embed_b + c.head_f + c.head_b
    overhead = time_model.Device(hw, shape).overhead(time_model.Work((), 0, mc.layers * c.layer_ops + c.head_ops))
    return max(1.0, (cal.reference_s - overhead) / modelled)


def memory_seconds(window_s: float, n: int = 1 << 23) -> float:
    """Seconds of an add over 3 × 32 MiB (beyond the caches): what the memory-bound kernels and the
    optimizer of a step meet, alone or with other ranks sharing the memory."""
    import torch
    dev = _device()
    a, b, c = (torch.randn(n, device=dev) for _ in range(3))
    return per_call(lambda: torch.add(a, b, out=c), dev, window_s)


def slowdowns(pool, world: int, seconds, window_s: float) -> dict:
    """k → the median of `seconds(window_s)` on k ranks at once / on one, for k = 1..world
    (REFERENCE_BLOCK: compute, which shares caches and cores; memory_seconds: the memory)."""
    out, base = {}, None
    for k in range(1, world + 1):
        t = statistics.median(v for v in pool.call(_on_first, k, seconds, window_s) if v is not None)
        base = base or t
        out[k] = max(1.0, t / base)
    return out


def _on_first(k: int, seconds, window_s: float) -> float | None:
    """Ranks < k run `seconds` at once; the others sit it out."""
    return seconds(window_s) if int(os.environ["RANK"]) < k else None


# --- collectives (ranks < group) ------------------------------------------------------------------
def measure_collectives(group: int, ranks: int, sizes: tuple, window_s: float, reps: tuple = (60, 24)) -> dict | None:
    """{op: [[payload bytes, seconds], ...]} in groups of `group` among the first `ranks` ranks, every
    group busy at once (as a layout's tp or dp groups run side by side); the other ranks idle, so that a
    run of `ranks` ranks meets the contention it has (on a CPU, ranks beyond the cores slow gloo too)."""
    rank = int(os.environ["RANK"])
    from bench.distributed import rank_session
    with rank_session("auto", timeout_s=120) as dev:
        return _time_collectives(dev, rank, group, ranks, sizes, window_s, reps)


def _time_collectives(dev, rank: int, group: int, ranks: int, sizes: tuple, window_s: float,
                      reps: tuple) -> dict | None:
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    blocks = [list(range(s, s + group)) for s in range(0, ranks - group + 1, group)]
    made = [dist.new_group(b) for b in blocks]  # collective: every rank makes every group
    mine = next((g for b, g in zip(blocks, made) if rank in b), None)
    timing = _AfterCompute(dev, window_s)
    out = {op: [] for op in OPS}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        n = -(-n // group) * group
        full, part = torch.ones(n, device=dev), torch.ones(n // group, device=dev)
        peer = rank ^ 1
        ops = {"all_reduce": lambda: dist.all_reduce(full, group=mine),
               "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=mine),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=mine),
               "send": lambda: _ping(full, peer, rank) if peer < world else None}
        calls = reps[0] if nbytes < 1 << 16 else reps[1]  # a mid-size op varies 2× between batches of 8 on a CPU
        for op, fn in ops.items():
            dist.barrier()
            if mine is not None:
                out[op].append([4.0 * n, timing.seconds(fn, calls)])
    return out if mine is not None else None


def progress_steps(world: int, running: tuple[int, ...] | None = None) -> int:
    """Ticks `calibrate` gives its progress callback: start-up, the single-rank figures, the two
    slowdowns, one per collective shape."""
    return 4 + len(collective_shapes(world, running))


def collective_shapes(world: int, running: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """(group size, ranks running) pairs to measure: groups of 2, 4, 8 and `world` among 2, 4, 8 and
    `world` ranks running (or only among `running`: the world sizes a sweep runs), wherever the groups
    tile the running ranks."""
    sizes = sorted({g for g in (2, 4, 8, world) if 2 <= g <= world})
    among = sizes if running is None else sorted({r for r in running if 2 <= r <= world})
    return [(g, r) for r in among for g in sizes if g <= r and r % g == 0]


class _AfterCompute:
    """Times a collective as a training step meets it on a CPU: after some compute (about a millisecond
    of matmuls), so its cost includes waking the waiting rank and gloo's thread, which back-to-back
    calls never pay. Only the collective is timed, call by call: the median of three batches' means
    (subtracting a separately timed compute would leave noise, or nothing, for a small message). On a
    GPU, back to back."""

    def __init__(self, dev, window_s: float):
        import torch
        from bench import device as bench_device
        self.dev, self.window_s = dev, window_s
        self.on_host = not bench_device.for_device(dev).is_accelerator
        if self.on_host:
            a = torch.randn(256, 256, device=dev)
            self.compute = lambda: [a @ a for _ in range(8)]

    def seconds(self, op, reps: int) -> float:
        if not self.on_host:
            return per_call(op, self.dev, self.window_s, reps)
        self.compute()
        op()  # warm: the group's first call sets up its connections
        means = []
        for _ in range(3):
            spent = 0.0
            for _ in range(reps):
                self.compute()
                t0 = time.perf_counter()
                op()
                spent += time.perf_counter() - t0
            means.append(spent / reps)
        return max(statistics.median(means), 1e-7)


def _ping(x, peer: int, rank: int) -> None:
    """One send each way between a pair: half of it is one send's time."""
    import torch.distributed as dist
    if rank % 2 == 0:
        dist.send(x, peer)
        dist.recv(x, peer)
    else:
        dist.recv(x, peer)
        dist.send(x, peer)


def collective_curve(op: str, points: list) -> list[list[float]]:
    """[[payload, seconds of one op], ...] by payload (a ping is two sends). A larger message is never
    faster than a smaller one, so a smaller one reading slower was delayed by something else: it gets
    the larger one's time (noise on a shared machine only ever adds time)."""
    scale = 0.5 if op == "send" else 1.0
    out, fastest = [], float("inf")
    for nbytes, seconds in sorted(points, reverse=True):
        fastest = min(fastest, seconds * scale)
        out.append([float(nbytes), fastest])
    return out[::-1]


# --- the whole calibration ------------------------------------------------------------------------
def machine() -> dict:
    """The machine identity the profile holds for (bench.environment.machine_identity) and when it was measured."""
    import torch
    from bench.environment import machine_identity
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {**machine_identity(device), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def calibrate(world: int = 2, quick: bool = False, name: str | None = None, progress=None,
              running: tuple[int, ...] | None = None, pool=None) -> Hardware:
    """Measure this machine on `world` ranks (collectives among `running` ranks only, when given); returns the
    calibrated profile (not yet written). `pool`: warm ranks of that world to measure on (a sweep's own,
    which then runs its runs), else fresh ones, closed after."""
    from contextlib import nullcontext

    from bench.spawn import RankPool
    sizes = plan_sizes(quick, _cuda_available())
    tick = progress or (lambda what: None)
    with nullcontext(pool) if pool is not None else RankPool(world) as pool:
        tick(f"starting {world} ranks")
        compute = pool.call(measure_compute, sizes)[0]
        tick("matmul, memory, ops, optimizer")
        slow = slowdowns(pool, world, block_seconds, sizes["window_s"])
        tick(f"1..{world} ranks computing at once")
        contention = slowdowns(pool, world, memory_seconds, sizes["window_s"])
        tick(f"1..{world} ranks sharing the memory")
        colls = {op: {} for op in OPS}
        for g, ranks in collective_shapes(world, running):
            got = pool.call(measure_collectives, g, ranks, sizes["comm_bytes"], sizes["window_s"], sizes["reps"])
            times = {op: [[b, max(r[op][i][1] for r in got if r)] for i, (b, _) in enumerate(got[0][op])] for op in OPS}
            for op in OPS:
                colls[op].setdefault(g, {})[ranks] = collective_curve(op, times[op])
            tick(f"collectives in groups of {g}, {ranks} ranks running")
    info = machine()
    info.update(quick=quick, world=world, steps=progress_steps(world, running))
    cal = Calibration(machine=info, collectives=colls, oversubscription=slow, memory_contention=contention,
                      composition=1.0, **compute)
    return profile_from(replace(cal, composition=composition(cal)), name)


def for_this_machine(worlds: tuple[int, ...], pool_of=None) -> tuple[Hardware, str]:
    """This CPU machine's profile for runs of these world sizes: the one measured here that covers them
    (`measured_profile`), or else the quick calibration, measured now (collectives among those world sizes'
    ranks; on `pool_of(world)`'s warm ranks when given) and cached in the profiles folder under the
    machine's fingerprint (redone when the host, CPU, cores or torch change). Returns the profile and one
    line saying which, and how long it took."""
    from bench.analysis.hardware import covers, measured_profile, profile_label
    from bench.environment import fingerprint, machine_identity
    identity = machine_identity("cpu")
    cached = measured_profile(identity, worlds)
    if cached is not None and covers(cached, worlds):
        return cached, f"predictions on the profile {profile_label(cached)}: cached, 0 s (`bench calibrate` remeasures)"
    world = max(2, *worlds)
    pool, started = pool_of(world) if pool_of and world in worlds else None, ""
    if pool is not None:  # the runs' own ranks: their start-up is no cost of calibrating
        t0 = time.monotonic()
        pool.call(os.getpid)
        started = f", after {time.monotonic() - t0:.1f} s starting the {world} ranks its runs then use"
    t0 = time.monotonic()
    hw = calibrate(world, quick=True, running=tuple(sorted({w for w in worlds if w >= 2} or {2})), pool=pool)
    path = write_profile(hw, profile_dir() / f"auto-{fingerprint(identity)}.yaml")
    return hw, (f"calibrated this machine in {time.monotonic() - t0:.1f} s ({world} ranks, quick{started}; once per "
                f"machine and torch version) into {path}: predictions on it")


def _cuda_available() -> bool:
    from bench import device as bench_device
    return bench_device.accelerator() is not None


def profile_from(cal: Calibration, name: str | None) -> Hardware:
    """A full profile: the device's datasheet entry (peak FLOP/s for MFU, memory, links) with the
    calibration attached; on CPU the peak is the largest measured matmul rate, memory the RAM per core."""
    from bench.analysis.hardware import profile_for_device
    device = cal.machine["device"]
    base = profile_for_device(device) if device != "cpu" else None
    if base is None and device != "cpu":  # a GPU measured with the CPU's rules would be nonsense
        raise ValueError(f"calibrate: {device} has no datasheet entry (bench/analysis/hardware.py PROFILES): "
                         "add its peak FLOP/s, memory and links, with `match` naming it")
    if base is not None:
        return replace(base, name=name or base.name, calibration=cal,
                       source=f"calibrated on {cal.machine['hostname']} {cal.machine['measured_at']}")
    cpu = PROFILES["cpu"]
    peak = {k: max(r for _, r in v) for k, v in cal.matmul.items()}
    peak["fp16"] = peak.get("bf16", peak["fp32"])
    lat, bw = link_figures(cal)
    return replace(cpu, name=name or "cpu", peak_flops=peak, memory_bytes=_ram() / max(cal.machine["cores"], 1),
                   intra_node_bw=bw, inter_node_bw=bw, intra_node_latency_s=lat, inter_node_latency_s=lat,
                   gpus_per_node=cal.machine["cores"], memory_bw=cal.memory_bw, calibration=cal,
                   source=f"calibrated on {cal.machine['hostname']} {cal.machine['measured_at']}")


def link_figures(cal: Calibration) -> tuple[float, float]:
    """(latency s, wire bytes/s) of a pair's all-reduce, from its curve's ends: the profile's summary
    figures for the layout explainer and whatever reads a link, not the time model (it reads the curve)."""
    from bench.conventions import wire_bytes
    points = cal.curve("all_reduce", 2)
    (_, small), (big_b, big_t) = points[0], points[-1]
    return small, wire_bytes("all_reduce", big_b, 2) / max(big_t - small, big_t / 2)


def _ram() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return float(PROFILES["cpu"].memory_bytes * 2)


def write_profile(hw: Hardware, path: str | Path | None = None) -> Path:
    """Write-then-rename: readers see the old file or the new one, never a part."""
    import yaml
    path = Path(path) if path else profile_dir() / f"{hw.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(hardware_to_dict(hw), f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
