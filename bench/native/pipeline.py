"""Pipeline parallelism: stage partition, schedules (GPipe, 1F1B, interleaved) and their executor.

The model is cut into p·v contiguous *stages* (v = virtual stages per rank, 1 unless interleaved).
Stage k runs on pipeline rank k mod p as that rank's chunk k div p; the embedding lives on stage 0,
the final norm, head and loss on stage p·v − 1.

A schedule is this rank's list of actions ("F" | "B", chunk, micro-batch); one executor runs any
of them. The bubble meter times compute (busy) against the rest of the pipeline phase (waiting
for a neighbour: idle) on one extra step the worker meters, never on a timed one; the ideal bubble
is (p − 1)/(m + p − 1), divided by v when interleaved.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from bench.native.pipeline_comm import PipeComm
from bench.native.tensor import vocab_parallel_cross_entropy


def partition(layers: int, stages: int) -> list[list[int]]:
    """Contiguous, balanced: sizes differ by at most one (earlier stages take the remainder)."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


class Stage(nn.Module):
    """One contiguous slice of the GPT. Parameter names are the full model's ("blocks.5.mlp.fc1.weight")."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool, recompute: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) or hidden (b, s[/tp], h) → hidden, or vocab-sharded logits (b, s, V/tp) if last."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


# --- schedules: this rank's ordered actions -------------------------------------------------------
def gpipe(m: int, p: int, r: int) -> list[tuple[str, int, int]]:
    """All forwards, then all backwards: m micro-batches in flight."""
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def one_f_one_b(m: int, p: int, r: int) -> list[tuple[str, int, int]]:
    """Warm-up of p − r − 1 forwards, steady one-forward-one-backward, cool-down: ≤ p in flight."""
    warm = min(p - r - 1, m)
    out = [("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", 0, warm + i), ("B", 0, i)]
    return out + [("B", 0, i) for i in range(m - warm, m)]


def interleaved(m: int, p: int, r: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of p (m % p == 0)."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warm = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [("F", *unit(k, False)) for k in range(warm)]
    for k in range(total - warm):
        out += [("F", *unit(warm + k, False)), ("B", *unit(k, True))]
    return out + [("B", *unit(k, True)) for k in range(total - warm, total)]


def schedule(name: str, m: int, p: int, r: int, v: int) -> list[tuple[str, int, int]]:
    if name == "interleaved" and p > 1:
        return interleaved(m, p, r, v)
    return gpipe(m, p, r) if name == "gpipe" else one_f_one_b(m, p, r)


def _grad_group(groups, device):
    """CUDA only: a second group over the pp ranks for gradients (NCCL matches P2P by order, not tag)."""
    if device.type != "cuda" or groups.size("pp") == 1:
        return None
    import torch.distributed as dist
    mine = None
    for ranks in groups.layout.groups("pp"):  # new_group is collective: every rank creates every group
        group = dist.new_group(ranks)
        mine = group if groups.rank in ranks else mine
    return mine


class BubbleMeter:
    """Busy (compute) and idle (everything else in the pipeline phase) seconds over metered steps.

    Off unless inside `metering()`: the worker meters one extra step of its own, never a timed one,
    because on CUDA the device is synchronised around each compute section (so busy time is kernel
    time, not launch time), which would also stall the timed stream."""

    def __init__(self, device=None):
        self.busy_s = self.idle_s = 0.0
        self.on, self._step_busy = False, 0.0
        self._cuda = device is not None and torch.device(device).type == "cuda"

    def _sync(self):
        if self._cuda:
            torch.cuda.synchronize()

    @contextmanager
    def metering(self):
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    @contextmanager
    def step(self):
        if not self.on:
            yield
            return
        self._step_busy = 0.0
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.busy_s += self._step_busy
        self.idle_s += time.perf_counter() - t0 - self._step_busy

    @contextmanager
    def compute(self):
        if not self.on:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self._step_busy += time.perf_counter() - t0

    @property
    def fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0


class Pipeline:
    """Runs a schedule over this rank's chunks; returns the micro-batch losses (last stage only)."""

    def __init__(self, chunks: list[Stage], run_cfg, groups, device, autocast_dtype):
        self.chunks, self.cfg, self.device = chunks, run_cfg, device
        self.p, self.r, self.v = groups.size("pp"), groups.coord.pp, len(chunks)
        self.tp_group, self.autocast_dtype = groups.tp, autocast_dtype
        self.comm = PipeComm(groups.pp, groups.ranks["pp"], self.r, _grad_group(groups, device))
        self.order = schedule(run_cfg.schedule, run_cfg.micro_batches, self.p, self.r, self.v)
        self.meter = BubbleMeter(device)
        seq = run_cfg.seq // (groups.size("tp") if run_cfg.sequence_parallel else 1)
        self.act_shape = (run_cfg.micro_batch, seq, run_cfg.model_config.hidden)
        self.act_dtype = autocast_dtype or torch.float32

    def _sid(self, chunk: int) -> int:
        return chunk * self.p + self.r

    @property
    def last_sid(self) -> int:
        return self.p * self.v - 1

    def _next_chunk(self, chunk: int) -> int:  # the receiver's chunk index for a forward send
        return chunk if self.r < self.p - 1 else chunk + 1

    def _prev_chunk(self, chunk: int) -> int:  # the receiver's chunk index for a backward send
        return chunk if self.r > 0 else chunk - 1

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One step over `batches` (on the device); the last stage's micro-batch losses, each already
        divided by the micro-batch count, as device tensors (never read here: no host sync)."""
        saved, losses = {}, []
        with self.meter.step():
            for kind, chunk, mb in self.order:
                if kind == "F":
                    saved[chunk, mb] = self._forward(chunk, mb, batches, losses)
                else:
                    self._backward(chunk, saved.pop((chunk, mb)))
            self.comm.wait_sends()
        return losses

    def _forward(self, chunk: int, mb: int, batches, losses: list[torch.Tensor]):
        sid = self._sid(chunk)
        if sid == 0:
            x = batches[mb][0]
        else:
            x = self.comm.recv_forward(self.act_shape, self.act_dtype, self.device, chunk).requires_grad_()
        with self.meter.compute(), torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                                  enabled=self.autocast_dtype is not None):
            out = self.chunks[chunk](x)
            if sid == self.last_sid:
                out = vocab_parallel_cross_entropy(out, batches[mb][1], self.tp_group)
                out = out / self.cfg.micro_batches
            else:
                out = out.to(self.act_dtype)  # (b, s[/tp], h): what travels to the next stage
        if sid == self.last_sid:
            losses.append(out.detach())
        else:
            self.comm.send_forward(out, self._next_chunk(chunk))
        return x, out

    def _backward(self, chunk: int, saved) -> None:
        x, out = saved
        sid = self._sid(chunk)
        grad = None
        if sid != self.last_sid:
            grad = self.comm.recv_backward(out.shape, out.dtype, self.device, chunk)
        with self.meter.compute():
            torch.autograd.backward(out, grad)
        if sid != 0:
            self.comm.send_backward(x.grad, self._prev_chunk(chunk))


def stage_layers_json(parts: list[list[int]]) -> str:
    return json.dumps(parts, separators=(",", ":"))
