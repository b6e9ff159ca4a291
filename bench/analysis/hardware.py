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
`PARABENCH_HARDWARE` at it to add its profiles to the known names. Sizes accept suffixes
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
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict  # dtype ("fp32", "bf16", "fp16") → FLOP/s per device
    memory_bytes: float
    intra_node_bw: float  # bytes/s per device, one direction (NVLink)
    inter_node_bw: float  # bytes/s per device, one direction (InfiniBand / RoCE)
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    gpus_per_node: int = 8
    compute_efficiency: float = 0.6
    """Sustained fraction of peak FLOP/s for the model's matmuls (achieved MFU of ~50 % at scale
    on A100/H100 in Megatron-LM and Llama 2 reports implies ~0.6 before bubbles and comm)."""
    source: str = "vendor datasheet"
    match: tuple = ()  # substrings of torch.cuda.get_device_name() that identify the device

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


def parse_quantity(value, key: str) -> float:
    """12.5, "80GiB", "450GB", "989T", "1.5e9" → a number (B and /s suffixes are ignored)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]?(?:i?[bB])?)?\s*(?:/s)?\s*", str(value))
    unit = (m.group(2) or "").lower().rstrip("b") if m else None
    if not m or unit not in _SUFFIX:
        raise ValueError(f"hardware field {key}: cannot read {value!r} as a number (e.g. 80GiB, 450GB, 989T)")
    return float(m.group(1)) * _SUFFIX[unit]


def hardware_from_dict(data: dict, where: str = "profile") -> Hardware:
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown hardware field(s) {unknown}; known: {sorted(known)}")
    missing = sorted({"name", "peak_flops", "memory_bytes", "intra_node_bw", "inter_node_bw"} - set(data))
    if missing:
        raise ValueError(f"{where}: missing hardware field(s) {missing}")
    if not isinstance(data["peak_flops"], dict) or "fp32" not in data["peak_flops"]:
        raise ValueError(f"{where}: peak_flops must map dtypes to FLOP/s and include fp32, "
                         "e.g. {bf16: 989T, fp32: 67T}")
    out = dict(data, source=data.get("source", where), match=tuple(data.get("match", ())))
    out["peak_flops"] = {k: parse_quantity(v, f"peak_flops.{k}") for k, v in data["peak_flops"].items()}
    for key in ("memory_bytes", "intra_node_bw", "inter_node_bw", "intra_node_latency_s",
                "inter_node_latency_s", "compute_efficiency"):
        if key in out:
            out[key] = parse_quantity(out[key], key)
    if "gpus_per_node" in out:
        out["gpus_per_node"] = int(out["gpus_per_node"])
    return Hardware(**out)


def load_profiles(path: str | Path) -> dict[str, Hardware]:
    import yaml
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"hardware profile file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    items = data.get("profiles", [data]) if isinstance(data, dict) else data
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{path}: expected a profile mapping or `profiles:` with a list of them")
    return {p.name: p for p in (hardware_from_dict(i, str(path)) for i in items)}


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
