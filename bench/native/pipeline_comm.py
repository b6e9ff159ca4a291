"""Pipeline communication: activations forward and gradients backward between neighbouring stages.

Sends are asynchronous (isend, waited at the end of the schedule); receives are posted ahead
(`post_forward` / `post_backward`: the executor posts the next action's receive before the current
action's compute, so the transfer lands while this rank computes) and waited for only when the
action needs its input. A stage never waits to send, only for its input, so any schedule whose
dependencies form a DAG cannot deadlock.
Messages are matched by tag: an activation entering model chunk c has tag 2c, a gradient entering
chunk c has tag 2c + 1; within a tag both sides walk the micro-batches in the same order.
NCCL ignores tags and matches P2P in posting order per communicator, so on CUDA gradients travel
on a second group over the same ranks (`grad_group`): activations and gradients never share a
channel, and within each the order is the same on both sides (interleaved pp = 2 needs this).

Payload per message: one micro-batch's hidden states (b, s, h), or (b, s/tp, h) under sequence
parallel, in the activation dtype (the autocast dtype under mixed precision).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class PipeComm:
    def __init__(self, group, ranks: list[int], index: int, grad_group=None):
        self.group, self.ranks, self.index, self.size = group, ranks, index, len(ranks)
        self.grad_group = grad_group or group
        self._sends: list = []

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def _group(self, tag: int):
        return self.grad_group if tag % 2 else self.group

    def _send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        x = x.detach().contiguous()
        self._sends.append((dist.isend(x, dst=dst, group=self._group(tag), tag=tag), x))  # keep x alive

    def _recv(self, shape, dtype, device, src: int, tag: int) -> Posted:
        out = torch.empty(shape, dtype=dtype, device=device)
        return Posted(dist.irecv(out, src=src, group=self._group(tag), tag=tag), out)

    def post_forward(self, shape, dtype, device, chunk: int) -> Posted:
        """Post the receive of (b, s[/tp], h) activations ← the previous stage, into chunk `chunk`."""
        return self._recv(shape, dtype, device, self.prev, 2 * chunk)

    def post_backward(self, shape, dtype, device, chunk: int) -> Posted:
        """Post the receive of (b, s[/tp], h) output gradients ← the next stage, into chunk `chunk`."""
        return self._recv(shape, dtype, device, self.next, 2 * chunk + 1)

    def send_forward(self, act: torch.Tensor, to_chunk: int) -> None:
        """(b, s[/tp], h) activations → the next stage's chunk `to_chunk`."""
        self._send(act, self.next, 2 * to_chunk)

    def send_backward(self, grad: torch.Tensor, to_chunk: int) -> None:
        """(b, s[/tp], h) input gradients → the previous stage's chunk `to_chunk`."""
        self._send(grad, self.prev, 2 * to_chunk + 1)

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


class Posted:
    """A receive in flight: `wait()` returns its tensor once it has arrived."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor
