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
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Annotated

from bench.config import check_number
from bench.typed_yaml import FileError, file_error, known_keys, load_yaml


class _Quantity:
    """Annotation of a size or rate: a number, or text with a unit suffix, read by `parse_quantity`
    when pydantic validates a file (the pydantic hook imports pydantic only then), then checked to be
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

    def __post_init__(self):
        if "fp32" not in self.peak_flops:  # the fallback of `peak` for a dtype without its own figure
            raise ValueError("peak_flops must map dtypes to FLOP/s and include fp32, e.g. {bf16: 989T, fp32: 67T}")

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype_key(dtype)) or self.peak_flops["fp32"]


GiB = 1024**3
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    # NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction; HDR InfiniBand 200 Gb/s per GPU.
    Hardware("a100-80gb", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80 * GiB, 300e9, 25e9,
             match=("A100",)),
    # NVLink 4: 900 GB/s bidirectional; NDR InfiniBand 400 Gb/s per GPU.
    Hardware("h100-sxm", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 80 * GiB, 450e9, 50e9,
             match=("H100",)),
    Hardware("h200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 141 * GiB, 450e9, 50e9,
             match=("H200",)),
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


def dtype_key(dtype: str) -> str:
    """RunConfig dtype → the peak-FLOP/s key: mixed precision runs its matmuls in the low precision."""
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(dtype, "fp32")


# --- user profiles (YAML) ------------------------------------------------------------------------
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


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
    """A profile from a file's mapping; errors name `source` and the key (after `prefix`)."""
    import pydantic
    known = tuple(f.name for f in fields(Hardware))
    try:
        return _file_schema().validate_python({"source": source, **data})
    except pydantic.ValidationError as e:
        raise file_error(e, source, prefix, known_keys("hardware field", known), data) from None


def load_profiles(path: str | Path) -> dict[str, Hardware]:
    path = Path(path)
    data = load_yaml(path, "hardware file") or {}
    several = isinstance(data, dict) and "profiles" in data
    items = data["profiles"] if several else [data]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise FileError(str(path), "profiles" if several else "", "expected a profile mapping or `profiles:` "
                                                                   "with a list of them")
    return {p.name: p for p in (hardware_from_dict(item, str(path), f"profiles[{i}]." if several else "")
                                for i, item in enumerate(items))}


def known_profiles() -> dict[str, Hardware]:
    extra = os.environ.get("PARABENCH_HARDWARE")
    return {**PROFILES, **(load_profiles(extra) if extra else {})}


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
                         "(or a YAML file, see bench/analysis/hardware.py)")
    return profiles[spec]
