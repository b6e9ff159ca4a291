"""Communication per step: every collective and send a rank issues, per parallel dimension.

The counting convention is the worker's (`bench.metrics.comm`, DESIGN.md), so predictions and
measurements compare exactly: payload per rank per optimizer step (all-reduce: its input;
all-gather: its output; reduce-scatter: its input; send/recv: the bytes sent), averaged over all
ranks; wire bytes as a ring moves them, all-reduce 2(n−1)/n, all-gather and reduce-scatter
(n−1)/n of the full tensor, a send its size.

What each dimension moves (b sequences × s tokens per micro-batch, hidden h, X = b·s·h elements):
- tp, per micro-batch, without sequence parallel (Megatron's f/g pairs; Narayanan et al. 2021 §3.2):
  per layer 2 forward all-reduces (after attention proj and fc2) and 2 backward all-reduces (at the
  attention and MLP inputs) of X; stage 0: 1 forward all-reduce of X (vocab-parallel embedding);
  last stage: 1 backward all-reduce of X (head input) and 3 forward all-reduces of b·s fp32
  (vocab-parallel cross-entropy: max, sum of exponentials, target logit).
- tp with sequence parallel (Korthikanti et al. 2022 §4.2.2): each all-reduce becomes an all-gather
  and a reduce-scatter of X (per layer 4 of each; the embedding reduce-scatters forward and
  all-gathers backward; the head all-gathers forward and reduce-scatters backward), plus, once per
  step, an all-reduce of the gradients of the parameters that see sequence shards (norms,
  row-parallel biases) in fp32.
- pp, per micro-batch and boundary: X (÷ t with sequence parallel) forward and the same backward,
  over p−1 boundaries (p·v−1 with the interleaved schedule); averaged over the p ranks.
- dp, per step: one all-reduce of the local gradients (native, ddp, deepspeed ZeRO-0); ZeRO-1/2:
  reduce-scatter of the gradients + all-gather of the parameters; ZeRO-3 / FSDP full, per
  micro-batch: all-gather of the root parameters (embeddings, head) once and of each block twice
  (forward, and re-gathered for backward) + reduce-scatter of all gradients; FSDP grad-op: one
  all-gather of all parameters + reduce-scatter per micro-batch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from bench.analysis.memory import block_params_local, precision, sharding, stage_params
from bench.analysis.schedule import chunk_layers, stage_chunks

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")
FP32 = 4


@dataclass(frozen=True)
class Traffic:
    """`ops` calls of one kind on one dimension per step, `payload` bytes each (per rank)."""

    dim: str
    kind: str
    payload: float
    ops: int
    group: int  # ranks in the group
    what: str
    per: str = "micro-batch"  # "micro-batch" (on the pipeline's critical path) or "step"

    @property
    def total(self) -> float:
        return self.payload * self.ops

    @property
    def wire(self) -> float:
        return wire_bytes(self.kind, self.payload, self.group) * self.ops


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one rank moves under a ring algorithm (same rule as bench.metrics.comm)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * payload
    return float(payload)


def _sp_params_local(m, layers: int, last: bool) -> int:
    """Replicated parameters that see sequence shards under sequence parallel (grads all-reduced)."""
    norm = m.hidden * (2 if m.norm == "layernorm" else 1)
    per_layer = 2 * norm + (2 * m.hidden if m.bias else 0)
    return layers * per_layer + (norm if last else 0)


def tp_traffic(cfg, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    m, prec, t = cfg.model_config, precision(cfg.dtype, mixed_state), cfg.tp
    if t == 1:
        return []
    chunks = chunk_layers(m.layers, cfg.pp, cfg.virtual_stages)
    mine = stage_chunks(stage, cfg.pp, cfg.virtual_stages)
    layers, first, last = sum(chunks[c] for c in mine), 0 in mine, len(chunks) - 1 in mine
    x, mb = cfg.micro_batch * cfg.seq * m.hidden, cfg.micro_batches
    out = []
    if not cfg.sequence_parallel:
        out.append(Traffic("tp", "all_reduce", x * prec.comm_fwd, 2 * layers * mb, t, "block outputs (fwd)"))
        out.append(Traffic("tp", "all_reduce", x * prec.comm_bwd, 2 * layers * mb, t, "block input grads (bwd)"))
        if first:
            out.append(Traffic("tp", "all_reduce", x * prec.comm_embed, mb, t, "vocab-parallel embedding (fwd)"))
        if last:
            out.append(Traffic("tp", "all_reduce", x * prec.comm_bwd, mb, t, "head input grad (bwd)"))
    else:
        out.append(Traffic("tp", "all_gather", x * prec.comm_bwd, 2 * layers * mb, t, "sequence → full (fwd)"))
        out.append(Traffic("tp", "reduce_scatter", x * prec.comm_fwd, 2 * layers * mb, t, "full → sequence (fwd)"))
        out.append(Traffic("tp", "reduce_scatter", x * prec.comm_bwd, 2 * layers * mb, t, "grads of gathers (bwd)"))
        out.append(Traffic("tp", "all_gather", x * prec.comm_fwd, 2 * layers * mb, t, "grads of scatters (bwd)"))
        if first:
            out.append(Traffic("tp", "reduce_scatter", x * prec.comm_embed, mb, t, "embedding (fwd)"))
            out.append(Traffic("tp", "all_gather", x * prec.comm_pp, mb, t, "embedding grad (bwd)"))
        if last:
            out.append(Traffic("tp", "all_gather", x * prec.comm_pp, mb, t, "head input (fwd)"))
            out.append(Traffic("tp", "reduce_scatter", x * prec.comm_bwd, mb, t, "head input grad (bwd)"))
        n = _sp_params_local(m, layers, last)
        out.append(Traffic("tp", "all_reduce", n * FP32, 1, t, "sequence-parallel param grads", "step"))
    if last:
        out.append(Traffic("tp", "all_reduce", cfg.micro_batch * cfg.seq * FP32, 3 * mb, t,
                           "vocab-parallel cross-entropy (fwd)"))
    return out


def pp_traffic(cfg, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    if cfg.pp == 1:
        return []
    m, prec = cfg.model_config, precision(cfg.dtype, mixed_state)
    n_chunks = cfg.pp * cfg.virtual_stages
    msg = cfg.micro_batch * cfg.seq * m.hidden * prec.comm_pp / (cfg.tp if cfg.sequence_parallel else 1)
    mine = stage_chunks(stage, cfg.pp, cfg.virtual_stages)
    fwd = sum(1 for c in mine if c < n_chunks - 1)
    bwd = sum(1 for c in mine if c > 0)
    mb, out = cfg.micro_batches, []
    if fwd:
        out.append(Traffic("pp", "send", msg, fwd * mb, 2, "activations to next stage"))
    if bwd:
        out.append(Traffic("pp", "send", msg, bwd * mb, 2, "grads to previous stage"))
    # the counter sees each receive as an op of 0 bytes
    out.append(Traffic("pp", "recv", 0, (fwd + bwd) * mb, 2, "receives (counted as ops)"))
    return out


def dp_traffic(cfg, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    m, prec = cfg.model_config, precision(cfg.dtype, mixed_state)
    what, shard = sharding(cfg)
    if cfg.dp == 1:
        return []
    n = stage_params(m, cfg.tp, cfg.pp, cfg.virtual_stages, stage)
    grads, params = n * prec.grad_comm, n * prec.param_comm
    if what == "none":
        return [Traffic("dp", "all_reduce", grads, 1, cfg.dp, "gradients", "step")]
    if what in ("optimizer",) or (what == "grads" and cfg.backend != "fsdp"):
        return [Traffic("dp", "reduce_scatter", grads, 1, cfg.dp, "gradients", "step"),
                Traffic("dp", "all_gather", params, 1, cfg.dp, "updated parameters", "step")]
    mb = cfg.micro_batches
    if what == "grads":  # FSDP grad-op: parameters stay gathered from forward to backward
        gathered = n * prec.param_comm
    else:  # root (the stage's parameters outside blocks) once, blocks forward + backward
        layers = sum(chunk_layers(m.layers, cfg.pp, cfg.virtual_stages)[c]
                     for c in stage_chunks(stage, cfg.pp, cfg.virtual_stages))
        blocks = layers * block_params_local(m, cfg.tp)
        gathered = (n + blocks) * prec.param_comm
    out = [Traffic("dp", "all_gather", gathered, mb, shard, "parameters"),
           Traffic("dp", "reduce_scatter", grads, mb, shard, "gradients")]
    if shard < cfg.dp:  # hybrid: shards all-reduced across replicas
        out.append(Traffic("dp", "all_reduce", grads / shard, mb, cfg.dp // shard, "gradient shards"))
    return out


def stage_traffic(cfg, stage: int, mixed_state: str = "zero") -> list[Traffic]:
    return tp_traffic(cfg, stage, mixed_state) + pp_traffic(cfg, stage, mixed_state) + \
        dp_traffic(cfg, stage, mixed_state)


def comm_summary(cfg, mixed_state: str = "zero") -> dict:
    """Row columns like the worker's, averaged over ranks (every stage has tp·dp ranks)."""
    out: dict[str, float] = defaultdict(float)
    for dim in ("tp", "pp", "dp"):
        out[f"comm_bytes_{dim}"] = out[f"comm_wire_bytes_{dim}"] = out[f"comm_ops_{dim}"] = 0.0
    for stage in range(cfg.pp):
        for tr in stage_traffic(cfg, stage, mixed_state):
            out[f"comm_bytes_{tr.dim}"] += tr.total / cfg.pp
            out[f"comm_wire_bytes_{tr.dim}"] += tr.wire / cfg.pp
            out[f"comm_ops_{tr.dim}"] += tr.ops / cfg.pp
            out[f"comm_{tr.dim}_{tr.kind}_bytes"] += tr.total / cfg.pp
            out[f"comm_{tr.dim}_{tr.kind}_ops"] += tr.ops / cfg.pp
    return dict(out)
