"""Pipeline schedule maths: how layers split into stages, micro-batches in flight, the bubble.

Conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" = PTD-P, §2.2):
- p stages, m micro-batches, v model chunks per stage (interleaved). The bubble *time* relative to
  the ideal compute time is (p−1)/m for GPipe and 1F1B and (p−1)/(v·m) for the interleaved
  schedule; `bubble_fraction` is the share of the step spent idle: (p−1)/(m+p−1), resp.
  (p−1)/(v·m+p−1).
- Activations in flight on stage i: GPipe keeps all m micro-batches; 1F1B keeps min(p−i, m);
  the interleaved schedule keeps (p−i−1)·2 + (v−1)·p + 1 chunk-micro-batches (Megatron's warm-up
  count + the one in its steady state), each chunk holding L/(p·v) layers: on stage 0 that is
  L·(1 + (p−1)/(p·v)) layers' worth (Korthikanti et al. 2022, §4.2.3).
"""
from __future__ import annotations


def chunk_layers(layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers of each of the pp·v model chunks, in model order (earlier chunks take the remainder)."""
    chunks = pp * virtual_stages
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def stage_chunks(stage: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Chunk indices held by pipeline rank `stage` (chunk c lives on stage c mod pp)."""
    return [stage + k * pp for k in range(virtual_stages)]


def bubble_fraction(pp: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle share of a step: (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1)."""
    if pp == 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


def bubble_over_ideal(pp: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """PTD-P's form: bubble time / ideal compute time = (p−1)/m, interleaved (p−1)/(v·m)."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * micro_batches)


def in_flight_layers(stage: int, layers: int, pp: int, micro_batches: int, schedule: str,
                     virtual_stages: int = 1) -> float:
    """Layer-micro-batches whose activations stage `stage` holds at its peak."""
    chunks = chunk_layers(layers, pp, virtual_stages)
    mine = [chunks[c] for c in stage_chunks(stage, pp, virtual_stages)]
    if pp == 1:
        return float(sum(mine))  # gradient accumulation: one micro-batch at a time
    if schedule == "gpipe":
        return float(micro_batches * sum(mine))
    if schedule == "interleaved" and virtual_stages > 1:
        count = min(micro_batches * virtual_stages, (pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1)
        return count * sum(mine) / virtual_stages  # chunk-micro-batches × layers per chunk (average)
    return float(min(pp - stage, micro_batches) * sum(mine))


def in_flight_micro_batches(stage: int, pp: int, micro_batches: int, schedule: str) -> int:
    """Whole micro-batches in flight on a stage (non-interleaved view, for the head's activations)."""
    if pp == 1:
        return 1
    return micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)
