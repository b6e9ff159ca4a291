"""Hardware profiles: peak dense FLOP/s by dtype, memory, and link bandwidths. Pure data.

The peak used for MFU is declared here, once: the vendor's dense (no sparsity) tensor-core peak
for bf16/fp16, and the non-tensor-core peak for fp32 (Megatron's and torchtitan's convention).
On CPU the peak is measured (`bench.metrics.flops.cpu_peak_flops`), not looked up.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict  # dtype ("fp32", "bf16") → FLOP/s per device
    memory_bytes: float
    intra_node_bw: float  # bytes/s per GPU, one direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU, one direction (InfiniBand / RoCE)
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    gpus_per_node: int = 8
    match: tuple = ()  # substrings of torch.cuda.get_device_name() that identify the device


GiB = 1024**3
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    Hardware("a100-80gb", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80 * GiB, 300e9, 25e9,
             match=("A100",)),
    Hardware("h100-sxm", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 80 * GiB, 450e9, 50e9,
             match=("H100",)),
    Hardware("h200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 141 * GiB, 450e9, 50e9,
             match=("H200",)),
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
