"""Gradient buckets: one flat fp32 buffer per group of parameters, reduced over dp in one op.

Each parameter's gradient lands in a view of its bucket's buffer: the first micro-batch's is copied
there and later ones added (so the buffer is never zeroed: a pass over every gradient saved), and the
bucket is reduced in place. After the reduction each `.grad` is that view again, for the optimizer.
With ZeRO-1 the buffer is padded to a multiple of dp (at most dp − 1 zeros) and each dp rank owns
one contiguous shard of it:

    zero 0: all_reduce(grads (N,))                           payload 4·N bytes
    zero 1: reduce_scatter(grads (N_pad,)) → shard (N_pad/dp,); optimizer updates the shard;
            all_gather(shard) → params (N_pad,)               payload 4·N_pad bytes each

ZeRO-1 keeps no copy: the shard the optimizer steps on is a view of this rank's slice of the flat
parameter buffer, and its gradient a view of the same slice of the gradient buffer, so the rank
holds params 4·N_pad + grads 4·N_pad + Adam 8·N_pad/dp. The engine keeps fp32 weights under
mixed precision too (torch.autocast casts inside the matmuls), so no fp32 master is ever needed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class Bucket:
    def __init__(self, params: list[nn.Parameter], dp_group, dp: int, dp_rank: int, zero: int):
        self.params, self.group, self.dp, self.zero = params, dp_group, dp, zero
        self.numel = sum(p.numel() for p in params)
        padded = -(-self.numel // dp) * dp if zero else self.numel
        device = params[0].device
        self.grads = torch.zeros(padded, dtype=torch.float32, device=device)
        self.pending: set[int] = set()  # parameters still to get this step's last gradient
        self.landed: set[int] = set()  # parameters whose first gradient of this step is in the buffer
        self.work = None
        if zero:
            self._shard_params(dp_rank, padded)
        self.views = dict(zip(map(id, params), self._views(self.grads)))
        self.expose_grads()

    def _views(self, flat: torch.Tensor):
        offset = 0
        for p in self.params:
            yield flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _shard_params(self, dp_rank: int, padded: int) -> None:
        """Params become views of one flat buffer; this rank's optimizer owns the shard `self.shard`."""
        self.flat_params = torch.zeros(padded, dtype=torch.float32, device=self.params[0].device)
        for p, view in zip(self.params, self._views(self.flat_params)):
            view.copy_(p.detach())
            p.data = view
        size = padded // self.dp
        self.span = slice(dp_rank * size, (dp_rank + 1) * size)
        self.shard = nn.Parameter(self.flat_params[self.span])  # a view: updated in place
        self.shard.grad = self.grads[self.span]  # reduce-scattered into its own slice

    def start_step(self) -> None:
        """Backward's first gradient of each parameter is copied into the buffer, so no zeroing."""
        for p in self.params:
            p.grad = None
        self.pending = {id(p) for p in self.params}
        self.landed = set()
        self.work = None

    def take_grad(self, p, first: bool) -> None:
        """Move the gradient autograd just accumulated into `p.grad` into the bucket (copy on the step's
        first pass, add on later ones) and free it."""
        view = self.views[id(p)]
        view.copy_(p.grad) if first else view.add_(p.grad)
        p.grad = None
        self.landed.add(id(p))

    def zero_untouched(self) -> None:
        """Gradients backward never produced this step (unused parameters) are zero, not last step's."""
        for p in self.params:
            if id(p) not in self.landed:
                self.views[id(p)].zero_()

    def expose_grads(self) -> None:
        """`.grad` is each parameter's view of the buffer again: what the optimizer and the memory
        counters read."""
        for p in self.params:
            p.grad = self.views[id(p)]

    def mark_ready(self, p) -> bool:
        """Record that `p` has its full gradient for this step; True when the whole bucket has."""
        self.pending.discard(id(p))
        return not self.pending

    def launch(self) -> None:
        """Start the asynchronous reduction over dp (no-op for dp = 1)."""
        if self.dp == 1 or self.work is not None:
            return
        if self.zero:  # (N_pad,) → (N_pad/dp,) this rank's shard, summed over dp, written into its own
            # slice of the input (in place: NCCL documents it; on gloo the ZeRO-1 parity tests check it)
            self.work = dist.reduce_scatter_single(self.shard.grad, self.grads, group=self.group, async_op=True)
        else:  # (N,) summed over dp, in place
            self.work = dist.all_reduce(self.grads, group=self.group, async_op=True)

    def wait(self) -> None:
        """Finish the reduction. The sum is already the mean over dp replicas: backward starts from the
        loss × 1/dp (`Pipeline.grad_scale`), which saves a pass over every gradient after the reduction."""
        if self.dp == 1:
            return
        self.launch()
        self.work.wait()

    def gather_params(self) -> None:
        """ZeRO-1, after the optimizer step: every rank's updated shard → all params (N_pad,)."""
        if not self.zero or self.dp == 1:  # dp = 1: the shard is the whole buffer, already updated
            return
        with torch.no_grad():  # this rank's slice is both input and output (in place, as NCCL allows)
            dist.all_gather_single(self.flat_params, self.shard.detach(), group=self.group)


def split_into_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters, a new bucket whenever the next one would exceed `cap_bytes`."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * 4
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return buckets + ([current] if current else [])
