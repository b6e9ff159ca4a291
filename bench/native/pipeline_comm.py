"""Pipeline communication: activations forward and gradients backward between neighbouring stages.

Sends are asynchronous (isend, waited at the end of the schedule); receives are posted ahead
(`post_forward` / `post_backward`: the executor posts the next action's receive before the current
action's compute, so the transfer lands while this rank computes) and waited for only when the
action needs its input.

Channels: every directed stage boundary has one 2-rank group per message kind (`channel_edges`):
activations a → b, gradients b → a, and with interleaved chunks the wrap edge from the last rank to the
first. NCCL ignores tags and matches P2P in posting order per communicator, running all of a
communicator's ops on one stream, where a send and its receive complete only together: on a channel
shared by both directions or both kinds, a rank's queued send can wait behind a receive that its peer
satisfies only later (the interleaved schedule deadlocked on the shared pp group at every pp). On a
channel of its own each message kind flows one way, and both ends walk it in the same order, so the
k-th send is the k-th receive. The same channels run on gloo, untagged, so CPU parity tests match
messages by position exactly as NCCL does. tests/test_nccl_order.py replays the executor's call order
through a model of NCCL's streams (tests/support/nccl_model.py) for every schedule.

Payload per message: one micro-batch's hidden states (b, s, h), or (b, s/tp, h) under sequence
parallel, in the activation dtype (the autocast dtype under mixed precision).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ACT, GRAD = "act", "grad"  # message kinds: activations flow forward, gradients backward
Edge = tuple[str, int, int]  # (kind, sending rank, receiving rank): one channel


def channel_edges(pp_ranks: list[int], virtual_stages: int) -> list[Edge]:
    """Every channel of the pipeline over `pp_ranks`, in the order every rank creates them: per stage
    boundary activations forward and gradients back; the wrap edge (last rank → first, where chunk j
    feeds chunk j + 1) only with interleaved chunks."""
    p = len(pp_ranks)
    if p == 1:
        return []
    boundaries = p if virtual_stages > 1 else p - 1
    edges = []
    for i in range(boundaries):
        a, b = pp_ranks[i], pp_ranks[(i + 1) % p]
        edges += [(ACT, a, b), (GRAD, b, a)]
    return edges


class PipeComm:
    """This rank's channels to its pipeline neighbours. `channels`: edge → the group it travels on
    (`build` makes them; tests pass their own)."""

    def __init__(self, ranks: list[int], index: int, channels: dict[Edge, object]):
        self.ranks, self.index, self.size = ranks, index, len(ranks)
        self.me, self.channels = ranks[index], channels
        self._sends: list = []

    @classmethod
    def build(cls, groups, virtual_stages: int) -> "PipeComm":
        """Create every pipeline's channels and keep this rank's. new_group is collective: every rank
        creates every group, in the same order, including the pipelines it is not part of."""
        mine = {}
        for ranks in groups.layout.groups("pp"):
            for edge in channel_edges(ranks, virtual_stages):
                group = dist.new_group(sorted(edge[1:]))
                if groups.rank in edge[1:]:
                    mine[edge] = group
        return cls(groups.ranks["pp"], groups.coord.pp, mine)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def _send(self, x: torch.Tensor, kind: str, dst: int) -> None:
        x = x.detach().contiguous()
        self._sends.append((self._isend(x, dst, self.channels[kind, self.me, dst]), x))  # keep x alive

    def _recv(self, shape, dtype, device, kind: str, src: int) -> Posted:
        out = torch.empty(shape, dtype=dtype, device=device)
        return Posted(self._irecv(out, src, self.channels[kind, src, self.me]), out)

    def _isend(self, x: torch.Tensor, dst: int, group):  # the only torch.distributed calls: tests record them
        return dist.isend(x, dst=dst, group=group)

    def _irecv(self, out: torch.Tensor, src: int, group):
        return dist.irecv(out, src=src, group=group)

    # `chunk` / `to_chunk` name the receiving chunk; a channel's messages need no name (both ends post
    # them in schedule order), but the call says which message it is (tests check NCCL's matching)
    def post_forward(self, shape, dtype, device, chunk: int) -> Posted:
        """Post the receive of (b, s[/tp], h) activations ← the previous stage, into chunk `chunk`."""
        return self._recv(shape, dtype, device, ACT, self.prev)

    def post_backward(self, shape, dtype, device, chunk: int) -> Posted:
        """Post the receive of (b, s[/tp], h) output gradients ← the next stage, into chunk `chunk`."""
        return self._recv(shape, dtype, device, GRAD, self.next)

    def send_forward(self, act: torch.Tensor, to_chunk: int) -> None:
        """(b, s[/tp], h) activations → the next stage's chunk `to_chunk`."""
        self._send(act, ACT, self.next)

    def send_backward(self, grad: torch.Tensor, to_chunk: int) -> None:
        """(b, s[/tp], h) input gradients → the previous stage's chunk `to_chunk`."""
        self._send(grad, GRAD, self.prev)

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
