"""Hardware profiles: peak dense FLOP/s by dtype, memory, link bandwidths and latencies. Pure data.

The peak used for MFU is declared here, once: the vendor's dense (no sparsity) tensor-core peak
for bf16/fp16, and the non-tensor-core peak for fp32 (Megatron's and torchtitan's convention).
On CPU the worker measures the peak (`bench.metrics.flops.cpu_peak_flops`); the `cpu` profile
below holds figures measured once on this machine for the planner.

Bandwidths are per device, one direction, as a ring collective sees them: `intra_node_bw` is the
NVLink/NVSwitch bandwidth a GPU reaches to its node's peers, `inter_node_bw` the network bandwidth
per GPU (one NIC per GPU). `compute_efficiency` is the fraction of the peak that large training
matmuls sustain; the cost model divides FLOPs by peak × efficiency.

User profiles: a YAML file with one profile (a mapping of the fields below) or several under
`profiles:`; pass its path as `--hardware my.yaml` (or `--hardware my.yaml:name`), or point
`PARABENCH_HARDWARE` at it to add its profiles to the known names. pydantic reads the file into
`Hardware` itself (its annotations are the schema; bench/typed_yaml.py says why pydantic), so a
mistake names the file and key; it is imported only when a file is read. Sizes accept suffixes
(`80GiB`, `450GB`, `989T`), e.g.:

    name: my-gpu
    peak_flops: {bf16: 400T, fp16: 400T, fp32: 50T}
    memory_bytes: 48GiB
    intra_node_bw: 200GB
    inter_node_bw: 25GB
    gpus_per_node: 4
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Annotated, Any

from bench.config import check_number
from bench.conventions import DEVICE_PEAKS, dtype_key
from bench.typed_yaml import FileError, file_error, known_keys, load_yaml


class _Quantity:
    """Annotation of a size or rate: a number, or text with a unit suffix, read by `parse_quantity`
    when pydantic validates a file, then checked to be
    finite and in `bounds` (bench.config.check_number: the rules of every number a user gives)."""

    def __init__(self, bounds: tuple = (0, 1e30, True)):
        self.bounds = bounds

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema
        return core_schema.no_info_before_validator_function(self._read, core_schema.float_schema(strict=True))

    def _read(self, value):
        number = parse_quantity(value)
        reason = check_number("value", number, False, self.bounds)
        if reason:
            raise ValueError(reason.replace("value must", "must", 1))
        return number


class _Count:
    """A whole number of things (GPUs per node) in a file: an integer ≥ 1, never 8.5 → 8."""

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema
        return core_schema.int_schema(strict=True, ge=1, le=1_000_000)


Quantity = Annotated[float, _Quantity()]
Latency = Annotated[float, _Quantity((0, 3600.0, False))]
Fraction = Annotated[float, _Quantity((0, 1.0, True))]
Fraction0 = Annotated[float, _Quantity((0, 1.0, False))]  # 0 allowed: "not given, use the fallback"
Rate0 = Annotated[float, _Quantity((0, 1e30, False))]
Count = Annotated[int, _Count()]


@dataclass(frozen=True)
class Hardware:
    __pydantic_config__ = {"strict": False, "extra": "forbid"}  # for files: unknown keys are mistakes

    name: str
    peak_flops: dict[str, Quantity]  # dtype ("fp32", "bf16", "fp16") → FLOP/s per device
    memory_bytes: Quantity
    intra_node_bw: Quantity  # bytes/s per device, one direction (NVLink)
    inter_node_bw: Quantity  # bytes/s per device, one direction (InfiniBand / RoCE)
    intra_node_latency_s: Latency = 5e-6
    inter_node_latency_s: Latency = 10e-6
    gpus_per_node: Count = 8
    compute_efficiency: Fraction = 0.6
    """Sustained fraction of peak FLOP/s for the model's matmuls (achieved MFU of ~50 % at scale
    on A100/H100 in Megatron-LM and Llama 2 reports implies ~0.6 before bubbles and comm)."""
    source: str = "vendor datasheet"
    match: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name() that identify the device
    # --- time-model figures (bench.analysis.time_model) ---
    memory_bw: Rate0 = 0.0
    """Device memory bandwidth, bytes/s (HBM datasheet); 0: memory-bound work is not modelled."""
    matmul_efficiency: Fraction0 = 0.0
    """Fraction of the peak the best-shaped matmul reaches in a burst; 0: use compute_efficiency."""
    sustained_clock: Fraction = 1.0
    """Share of that burst rate a board saturated at its power limit holds (training is one long run)."""
    intra_node_efficiency: Fraction = 1.0
    """Share of `intra_node_bw` a large ring collective reaches (its bus bandwidth over the link spec)."""
    inter_node_efficiency: Fraction = 1.0
    """The same for `inter_node_bw`."""
    calibration: Any = None
    """A `Calibration` measured on the machine by `bench calibrate` (then it replaces the figures above);
    read by `calibration_from_dict`, not by the file schema."""

    def __post_init__(self):
        if "fp32" not in self.peak_flops:  # the fallback of `peak` for a dtype without its own figure
            raise ValueError("peak_flops must map dtypes to FLOP/s and include fp32, e.g. {bf16: 989T, fp32: 67T}")

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype_key(dtype)) or self.peak_flops["fp32"]

    @property
    def large_matmul_efficiency(self) -> float:
        return (self.matmul_efficiency or self.compute_efficiency) * self.sustained_clock


GiB = 1024**3
# Share of the dense bf16 peak the best-shaped matmul reaches in a burst, measured ("Maximum Achievable
# Matmul FLOPS", S. Bekman, ml-engineering, compute/accelerator/README.md, MAMF table: A100 SXM 267.9 of
# 312 TFLOP/s, H100 SXM 792.1 of 989; the same project's "Counting FLOPs" video script, whose numbers
# come from that README's MAMF/MSMF tables: H200 834 of 989).
MAMF = {"a100-80gb": 267.9 / 312, "h100-sxm": 792.1 / 989, "h200": 834 / 989}
# A saturated board holds less than a burst (its power limit pulls the clock down): the sustained rate
# (MSMF) of that H200 is 755 TFLOP/s, "the one to use for training, which is one long saturated run".
# No MSMF is published for A100 or H100: they take H200's measured ratio. `bench calibrate` on the
# machine replaces both figures with the measured curve.
SUSTAINED = 755 / 834
# A ring collective never reaches the link's spec: NCCL's all-reduce bus bandwidth at 16 GiB, measured
# with nccl-tests / all_reduce_bench (S. Bekman, ml-engineering, network/README.md, "Real network
# throughput"): 8× A100 on NVLink 3, 234.89 of 300 GB/s; 8× H200 on NVLink 4 with the ring (NVLS off),
# 367.61 of 450 (H100 has the same NVLink 4). Networks: "expect about 80 %" of the advertised rate (ibid.).
RING_EFFICIENCY = {"a100-80gb": 234.89 / 300, "h100-sxm": 367.61 / 450, "h200": 367.61 / 450}
NETWORK_EFFICIENCY = 0.8
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    # NVIDIA A100 datasheet (SXM 80GB): peaks in bench.conventions.DEVICE_PEAKS, HBM2e 2,039 GB/s;
    # NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction; HDR InfiniBand 200 Gb/s per GPU.
    Hardware("a100-80gb", dict(DEVICE_PEAKS["a100-80gb"].flops), 80 * GiB, 300e9, 25e9,
             match=DEVICE_PEAKS["a100-80gb"].match, memory_bw=2039e9, matmul_efficiency=MAMF["a100-80gb"],
             sustained_clock=SUSTAINED, intra_node_efficiency=RING_EFFICIENCY["a100-80gb"],
             inter_node_efficiency=NETWORK_EFFICIENCY),
    # NVIDIA H100 datasheet (SXM5): peaks in DEVICE_PEAKS, HBM3 3.35 TB/s;
    # NVLink 4: 900 GB/s bidirectional; NDR InfiniBand 400 Gb/s per GPU.
    Hardware("h100-sxm", dict(DEVICE_PEAKS["h100-sxm"].flops), 80 * GiB, 450e9, 50e9,
             match=DEVICE_PEAKS["h100-sxm"].match, memory_bw=3.35e12, matmul_efficiency=MAMF["h100-sxm"],
             sustained_clock=SUSTAINED, intra_node_efficiency=RING_EFFICIENCY["h100-sxm"],
             inter_node_efficiency=NETWORK_EFFICIENCY),
    # H100 SXM5 with 96 GB HBM2e at a 500 W power limit: the GPUs of the torchtitan team's benchmarks
    # (Meta's Grand Teton; pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e,
    # "Hardware": 96GB HBM2e at 2.4 TB/sec, 400 Gb/s RDMA per GPU, NVLink within the host of 8, "the
    # default 500W power limit"). Peak: the SXM figure, which torchtitan's MFU uses too (its footnote:
    # "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value"); the
    # power limit's cost is not modelled (no published measurement of this board's sustained rate).
    Hardware("h100-hbm2e-500w", dict(DEVICE_PEAKS["h100-sxm"].flops), 96 * GiB, 450e9, 50e9,
             memory_bw=2.4e12, matmul_efficiency=MAMF["h100-sxm"], sustained_clock=SUSTAINED,
             intra_node_efficiency=RING_EFFICIENCY["h100-sxm"], inter_node_efficiency=NETWORK_EFFICIENCY,
             source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100 96GB HBM2e, 500 W)"),
    # NVIDIA H200 datasheet (SXM): H100's compute, 141 GB HBM3e at 4.8 TB/s.
    Hardware("h200", dict(DEVICE_PEAKS["h200"].flops), 141 * GiB, 450e9, 50e9,
             match=DEVICE_PEAKS["h200"].match, memory_bw=4.8e12, matmul_efficiency=MAMF["h200"],
             sustained_clock=SUSTAINED, intra_node_efficiency=RING_EFFICIENCY["h200"],
             inter_node_efficiency=NETWORK_EFFICIENCY),
    # Measured on this machine (2 cores, 24 GiB, torch 2.13 CPU, one thread per rank) by the script
    # quoted in /work/notes/issue-7.md: 512² matmul in one thread (fp32, bf16); gloo all-reduce of
    # 64 MiB between two processes (bus bandwidth) and of 4 bytes (latency). A "device" is one core;
    # a node is the machine (2 cores sharing 24 GiB); there is no second node, so inter = intra.
    # Measured: fp32 102 GFLOP/s, bf16 19 GFLOP/s, all-reduce bus bandwidth 0.79 GB/s, 4-byte
    # all-reduce 0.44 ms, 16 MiB send/recv 1.14 GB/s; 24 GiB shared by 2 cores → 12 GiB each.
    Hardware("cpu", {"bf16": 19e9, "fp16": 19e9, "fp32": 102e9}, 12 * GiB, 0.79e9, 0.79e9,
             intra_node_latency_s=440e-6, inter_node_latency_s=440e-6, gpus_per_node=2,
             compute_efficiency=0.5, source="measured here (2-core VM, 2026-11-29)"),
)}


def profile_for_device(device_name: str) -> Hardware | None:
    """The profile whose `match` names the CUDA device, or None (e.g. on CPU)."""
    for hw in PROFILES.values():
        if any(m in device_name for m in hw.match):
            return hw
    return None


# --- user profiles (YAML) ------------------------------------------------------------------------
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def format_bytes(n: float) -> str:
    """12_000_000 → "11.4 MiB": the reader's unit for a size (binary, as memory is counted)."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 0)):
        if n >= scale:
            return f"{n / scale:,.{digits}f} {unit}"
    return f"{n:g} B"


def parse_quantity(value, key: str = "") -> float:
    """12.5, "80GiB", "450GB", "989T", "1.5e9" → a number (B and /s suffixes are ignored)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]?(?:i?[bB])?)?\s*(?:/s)?\s*", str(value))
    unit = (m.group(2) or "").lower().rstrip("b") if m else None
    if not m or unit not in _SUFFIX:
        where = f"hardware field {key}: " if key else ""
        raise ValueError(f"{where}cannot read {value!r} as a number (e.g. 80GiB, 450GB, 989T)")
    return float(m.group(1)) * _SUFFIX[unit]


@cache
def _file_schema():
    from pydantic import TypeAdapter
    return TypeAdapter(Hardware)


def hardware_from_dict(data: dict, source: str = "profile", prefix: str = "") -> Hardware:
    """A profile from a file's mapping; errors name `source` and the key (after `prefix`). A measured
    profile's `calibration:` section is read by `calibration_from_dict` (its own checks and messages)."""
    import pydantic
    known = tuple(f.name for f in fields(Hardware))
    data = dict(data)
    calibration = data.pop("calibration", None)
    try:
        hw = _file_schema().validate_python({"source": source, **data})
    except pydantic.ValidationError as e:
        raise file_error(e, source, prefix, known_keys("hardware field", known), data) from None
    if calibration is None:
        return hw
    return replace(hw, calibration=calibration_from_dict(calibration, f"{source}: {prefix}".rstrip(": ")))


def load_profiles(path: str | Path) -> dict[str, Hardware]:
    """The profiles of one YAML file, parsed once per version of it: every prediction looks its profile
    up by name (a sweep's pruning once per config), and a calibrated profile is several ms to parse."""
    path = Path(path)
    try:
        version = (path.stat().st_mtime_ns, path.stat().st_size)
    except OSError:  # missing or unreadable: _parse_profiles says so in one line
        version = None
    return dict(_parse_profiles(path, path.resolve(), version))


@lru_cache(maxsize=64)
def _parse_profiles(path: Path, where: Path, version: tuple | None) -> dict[str, Hardware]:
    """`path` as given (messages name it), `where` and `version` tell files apart."""
    data = load_yaml(path, "hardware file") or {}
    several = isinstance(data, dict) and "profiles" in data
    items = data["profiles"] if several else [data]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise FileError(str(path), "profiles" if several else "", "expected a profile mapping or `profiles:` "
                                                                   "with a list of them")
    return {p.name: p for p in (hardware_from_dict(item, str(path), f"profiles[{i}]." if several else "")
                                for i, item in enumerate(items))}


def known_profiles() -> dict[str, Hardware]:
    """Built-in profiles, then calibrated ones (`bench calibrate`; they replace a built-in of the same
    name, e.g. `cpu`), then the file PARABENCH_HARDWARE names."""
    extra = os.environ.get("PARABENCH_HARDWARE")
    return {**PROFILES, **calibrated_profiles(), **(load_profiles(extra) if extra else {})}


def get_hardware(spec: str | Hardware) -> Hardware:
    """A profile by name, or from a YAML file (`path.yaml` or `path.yaml:name`)."""
    if isinstance(spec, Hardware):
        return spec
    path, name = spec, ""
    if re.search(r"\.ya?ml:[^/]+$", spec):
        path, name = spec.rsplit(":", 1)
    if path.endswith((".yaml", ".yml")):
        profiles = load_profiles(path)
        if name:
            if name not in profiles:
                raise ValueError(f"hardware {name!r} not in {path}; it holds {', '.join(profiles)}")
            return profiles[name]
        if len(profiles) != 1:
            raise ValueError(f"{path} holds several profiles ({', '.join(profiles)}); pick one as {path}:NAME")
        return next(iter(profiles.values()))
    profiles = known_profiles()
    if spec not in profiles:
        raise ValueError(f"unknown hardware {spec!r}; known profiles: {', '.join(profiles)} "
                         f"(or a YAML file, see bench/analysis/hardware.py; `bench calibrate --name {spec}` "
                         f"measures this machine into {profile_dir()})")
    return profiles[spec]


# --- calibration (bench calibrate; issue 11) -----------------------------------------------------
# A profile measured on its machine carries a `calibration:` section; the time model then reads the
# measured curves instead of the datasheet figures above. Files live in profile_dir(), one
# NAME.yaml per profile, and are found by name like the built-ins.


@dataclass(frozen=True)
class Calibration:
    """What `bench calibrate` measured (units: seconds, bytes, FLOP)."""

    machine: dict
    """Where it was measured: cpu_model, cores, device, torch, measured_at, quick."""
    matmul: dict
    """dtype → [[FLOP per call, achieved FLOP/s], ...] over a range of shapes, sorted by FLOP."""
    memory_bw: float
    """Bytes read + written per second by elementwise and norm kernels."""
    activation_bw: dict
    """MLP activation ("gelu": tanh GELU, "swiglu": SiLU × up) and the loss ("cross_entropy": forward +
    backward over the logits) → bytes read + written per second (the time model's byte counts)."""
    op_overhead_s: float
    """Seconds one small op costs in forward + autograd (dispatch, allocation), beyond its work."""
    optimizer_s_per_param: float
    """Seconds per fp32 parameter of one AdamW step, its state read from memory (not the caches)."""
    optimizer_s_per_tensor: float
    """Seconds per parameter tensor of that step beyond its elements (its ops' host cost)."""
    collectives: dict
    """op → {group size: {ranks running: [[payload bytes, seconds], ...]}}: one op's measured time over
    message sizes (a send: one direction) while that many ranks of the machine run (on a CPU, ranks
    beyond the cores slow every group's collectives). Between sizes the time is interpolated, beyond
    the largest it grows at the largest segment's rate: a mid-size message is not as fast as a line
    through the extremes says."""
    oversubscription: dict
    """ranks → slowdown of compute when that many ranks share the machine (1 when each has a core)."""
    memory_contention: dict
    """ranks → slowdown of memory-bound kernels (operands beyond the caches) when that many ranks run
    them at once: ranks on one CPU share its memory bandwidth (GPUs each have their own: ~1)."""
    reference_s: float
    """Seconds of a fixed small GPT's forward + backward (bench.calibrate.REFERENCE_MODEL)."""
    composition: float
    """That model's measured / modelled compute (≥ 1): the kernels of a step run slower one after another
    than each alone; the time model's compute is multiplied by it."""

    def matmul_rate(self, dtype: str, flops: float) -> float:
        """Achieved FLOP/s of a matmul of `flops`, interpolated in log FLOP on the measured curve."""
        from math import log
        curve = self.matmul.get(dtype) or self.matmul["fp32"]
        if flops <= curve[0][0]:
            return curve[0][1] * flops / curve[0][0]  # below the curve: fixed cost per call dominates
        for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
            if flops <= f1:
                w = (log(flops) - log(f0)) / (log(f1) - log(f0))
                return r0 + w * (r1 - r0)
        return curve[-1][1]

    def curve(self, kind: str, group: int, ranks: int | None = None) -> list | None:
        """The measured [[payload, seconds], ...] of `kind` in the measured group size nearest to `group`,
        measured with the number of ranks running nearest to `ranks` (default: the group alone); None:
        not measured."""
        table = self.collectives.get("all_reduce" if kind == "broadcast" else kind)
        if not table:
            return None
        by_ranks = table[min(table, key=lambda k: (abs(k - group), -k))]
        want = ranks or group
        return by_ranks[min(by_ranks, key=lambda k: (abs(k - want), k))]

    def collective_seconds(self, kind: str, group: int, payload: float, ranks: int | None = None) -> float | None:
        """Seconds of one `kind` op moving `payload` bytes while `ranks` ranks run, off its measured curve."""
        points = self.curve(kind, group, ranks)
        if points is None:
            return None
        if payload <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if payload <= b1:
                return t0 + (payload - b0) * (t1 - t0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2:] if len(points) > 1 else ((0.0, 0.0), points[-1])
        return t1 + (payload - b1) * (t1 - t0) / (b1 - b0)

    def slowdown(self, ranks: int) -> float:
        """Compute of `ranks` ranks at once / one rank's."""
        return _per_ranks(self.oversubscription, ranks)

    def memory_slowdown(self, ranks: int) -> float:
        """Memory-bound work of `ranks` ranks at once / one rank's."""
        return _per_ranks(self.memory_contention, ranks)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _per_ranks(measured: dict, ranks: int) -> float:
    """A slowdown measured at 1..k ranks, read at `ranks`."""
    table = {int(k): float(v) for k, v in measured.items()}
    if not table or ranks <= min(table):
        return 1.0 if not table else table[min(table)]
    below = max(k for k in table if k <= ranks)
    return table[below] * ranks / below  # past the measured counts: ranks share the cores evenly


_CAL_FIGURES = ("memory_bw", "op_overhead_s", "optimizer_s_per_param", "optimizer_s_per_tensor", "reference_s",
                "composition")


def calibration_from_dict(data: dict, where: str) -> Calibration:
    """Checked: every figure present and positive; one error names the file, the key and the fix."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: calibration must be a mapping; rerun `bench calibrate`")
    if "block_s" in data and "reference_s" not in data:  # a profile whose composition came from one block
        data = {("reference_s" if k == "block_s" else k): v for k, v in data.items()}
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown calibration key(s) {unknown}; known: {sorted(known)}")
    missing = sorted(known - set(data))
    if missing:
        raise ValueError(f"{where}: calibration.{missing[0]} is missing; rerun `bench calibrate`")
    for key in _CAL_FIGURES:
        if not isinstance(data[key], (int, float)) or data[key] < 0:
            raise ValueError(f"{where}: calibration.{key} is {data[key]!r}; it must be a number ≥ 0 "
                             "(rerun `bench calibrate`)")
    if not isinstance(data["activation_bw"], dict) or any(
            not isinstance(v, (int, float)) or v <= 0 for v in data["activation_bw"].values()):
        raise ValueError(f"{where}: calibration.activation_bw must map activations to bytes/s > 0 "
                         "(rerun `bench calibrate`)")
    for dtype, curve in data["matmul"].items():
        if not curve or any(len(p) != 2 or p[0] <= 0 or p[1] <= 0 for p in curve):
            raise ValueError(f"{where}: calibration.matmul.{dtype} must list [FLOP, FLOP/s] pairs > 0 "
                             "(rerun `bench calibrate`)")
    measured_on = int(data["machine"].get("world", 2)) if isinstance(data["machine"], dict) else 2
    collectives = {}
    for op, table in data["collectives"].items():
        for n, by_ranks in table.items():
            legacy = isinstance(by_ranks, list)  # a profile from before the ranks running were recorded
            for ranks, points in ({measured_on: by_ranks} if legacy else by_ranks).items():
                if not points or any(not isinstance(p, (list, tuple)) or len(p) != 2 or p[0] <= 0 or p[1] <= 0
                                     for p in points):
                    key = f"{op}.{n}" if legacy else f"{op}.{n}.{ranks}"
                    raise ValueError(f"{where}: calibration.collectives.{key} must list [payload bytes, seconds] "
                                     "pairs > 0 (rerun `bench calibrate`)")
                collectives.setdefault(op, {}).setdefault(int(n), {})[int(ranks)] = sorted(map(tuple, points))
    out = dict(data, matmul={k: sorted(map(tuple, v)) for k, v in data["matmul"].items()},
               collectives=collectives,
               oversubscription={int(k): float(v) for k, v in data["oversubscription"].items()},
               memory_contention={int(k): float(v) for k, v in data["memory_contention"].items()})
    return Calibration(**out)


def profile_dir() -> Path:
    """Where calibrated profiles live: $PARABENCH_PROFILES, else the user cache's profiles/
    ($XDG_CACHE_HOME/parabench/profiles, else ~/.cache/parabench/profiles)."""
    from bench.environment import cache_dir
    return Path(os.environ.get("PARABENCH_PROFILES") or cache_dir() / "profiles")


def measured_profile(identity: dict, worlds: tuple[int, ...] = (1,)) -> Hardware | None:
    """The best profile of profile_dir() measured on the machine `identity` names (its host, CPU, cores,
    torch and device: bench.environment.machine_identity), or None: one that `covers` these world sizes
    first, then a full calibration before a quick one, then the most ranks, then the newest."""
    folder = profile_dir()
    if not folder.is_dir():
        return None
    here = [hw for path in sorted(folder.glob("*.yaml")) for hw in load_profiles(path).values()
            if hw.calibration is not None and _measured_on(hw.calibration.machine, identity)]

    def rank(hw):
        m = hw.calibration.machine
        return covers(hw, worlds), not m.get("quick"), int(m.get("world", 2)), str(m.get("measured_at", ""))
    return max(here, key=rank, default=None)


def covers(hw: Hardware, worlds: tuple[int, ...]) -> bool:
    """Whether a calibrated profile measured what runs of these world sizes meet: the shared cores up to the
    largest, and the collectives with each world's ranks running."""
    cal = hw.calibration
    running = {r for table in cal.collectives.values() for by_ranks in table.values() for r in by_ranks}
    return max(worlds) <= max(map(int, cal.oversubscription), default=1) and \
        all(w in running for w in worlds if w >= 2)


def _measured_on(machine: dict, identity: dict) -> bool:
    return all(str(machine.get(k)) == str(v) for k, v in identity.items())


def profile_label(hw: Hardware) -> str:
    """Which profile a prediction used, for the row's `pred_profile` and the report's titles:
    "calibrated on HOST at TIME", "built-in NAME", or "NAME from FILE"."""
    if hw.calibration is not None:
        m = hw.calibration.machine
        quick = f", quick, {m.get('world', 2)} ranks" if m.get("quick") else f", {m.get('world', 2)} ranks"
        return f"calibrated on {m.get('hostname')} at {m.get('measured_at')} ({hw.name}{quick})"
    if PROFILES.get(hw.name) == hw:
        return f"built-in {hw.name}"
    return f"{hw.name} from {hw.source}"


def calibrated_profiles() -> dict[str, Hardware]:
    folder = profile_dir()
    if not folder.is_dir():
        return {}
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        out.update(load_profiles(path))
    return out


def hardware_to_dict(hw: Hardware) -> dict:
    """The YAML form `load_profiles` reads back."""
    out = {f.name: getattr(hw, f.name) for f in fields(hw)}
    out["match"] = list(hw.match)
    out["calibration"] = hw.calibration.to_dict() if hw.calibration else None
    if out["calibration"]:
        cal = out["calibration"]
        cal["matmul"] = {k: [list(p) for p in v] for k, v in cal["matmul"].items()}
        cal["collectives"] = {op: {int(n): {int(r): [list(x) for x in p] for r, p in by_ranks.items()}
                                   for n, by_ranks in t.items()} for op, t in cal["collectives"].items()}
    return out
