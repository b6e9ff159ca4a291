"""Expert parallelism: each ep rank holds E/ep whole experts and every rank's tokens visit them by all-to-all.

Layout (bench.layout): the ep group is a block of ep ranks inside dp × cp; ep rank j holds experts
[j·E/ep, (j+1)·E/ep) as `experts.fc1` / `experts.fc2` (the full model's names: `bench.surgery` fills
them from their flat range of the full value). The router, the shared experts and every dense weight
stay whole on every ep rank.

Dispatch, per MoE layer and micro-batch (Megatron's AlltoAll token dispatcher, DeepSpeed-MoE's
`_AllToAll`), after the model routed and sorted its assignments by expert (`models.gpt.Experts`' contract):
1. counts: all_to_all_single of the (E,) rows per expert (int64, 8·E bytes): rank j learns how many rows
   each peer sends each of its experts;
2. dispatch: all_to_all_single of the rows with uneven splits (this rank's rows for rank j's experts);
3. the local experts run on what arrived, regrouped from (source, expert) to (expert, source) order;
4. combine: the results go back the way they came (all_to_all_single, splits swapped).
Backward is the conjugate of 2 and 4 (two more all-to-alls of the same sizes): 5 ops per layer and
micro-batch, 3 forward and 2 backward, and 8·E + 4·N·h·β bytes sent by a rank that routes N rows of
width h at β bytes (the analytic model's `ep` traffic). Rows a rank sends to its own experts count too:
all_to_all_single's payload is the whole input, as the comm counter sees it.

Gradients: an expert's gradient on its rank is already the sum over the ep group's tokens (the
combine's backward brings them home), so it is reduced over the expert-data-parallel group (edp: the
ranks holding the same experts); the loss's 1/(dp·cp) makes that sum the batch mean (bench.native.data).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from models.gpt import Experts, moe_modules


class _AllToAll(torch.autograd.Function):
    """Rows (N, h) → rows (Σ out_splits, h): `in_splits[j]` rows to rank j of `group`, `out_splits[i]`
    from rank i. Backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallelExperts(Experts):
    """`Experts` holding experts [rank·E/ep, (rank+1)·E/ep) of ep; `forward` keeps Experts' contract
    (rows sorted by expert over all E experts, `counts` (E,) on the host) across the ep group."""

    def __init__(self, cfg, group, ep: int, ep_rank: int, device=None):
        nn.Module.__init__(self)
        self.swiglu, self.group, self.ep = cfg.activation == "swiglu", group, ep
        self.local = cfg.experts // ep
        self.first_expert = ep_rank * self.local  # bench.surgery fills experts [first, first + local)
        self.fc1 = nn.Parameter(torch.empty(self.local, cfg.experts_fc1_out, cfg.hidden, device=device))
        self.fc2 = nn.Parameter(torch.empty(self.local, cfg.hidden, cfg.expert_ffn, device=device))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.local
        send = counts.view(ep, local)  # send[j, e]: this rank's rows for rank j's expert e
        recv = torch.empty_like(send, device=rows.device)  # recv[i, e]: rows from rank i for my expert e
        dist.all_to_all_single(recv, send.to(rows.device), group=self.group)  # NCCL needs device tensors
        recv = recv.cpu()  # the splits are host ints: one sync per layer, as Megatron's dispatcher has
        to_peers, from_peers = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = _AllToAll.apply(rows, from_peers, to_peers, self.group)  # (source, expert) order
        by_expert = _expert_major(recv).to(rows.device)
        out = self.compute(arrived.index_select(0, by_expert), recv.sum(0))
        back = torch.empty_like(by_expert).index_copy_(0, by_expert, torch.arange(len(by_expert)))
        return _AllToAll.apply(out.index_select(0, back), to_peers, from_peers, self.group)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows laid out by (source i, expert e) segments of sizes recv[i, e] into
    (expert, source) order: each expert's rows together, its sources in rank order."""
    sizes = recv.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    ep, local = recv.shape
    pieces = [torch.arange(int(starts[i * local + e]), int(starts[i * local + e] + sizes[i * local + e]))
              for e in range(local) for i in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def apply_expert_parallel(model: nn.Module, groups) -> None:
    """Replace every MoE block's experts by this rank's ep share (call on meta, before materializing)."""
    ep = groups.size("ep")
    if ep == 1:
        return
    ep_rank = groups.ranks["ep"].index(groups.rank)
    for moe in moe_modules(model):
        moe.experts = ExpertParallelExperts(moe.cfg, groups.ep, ep, ep_rank, moe.experts.fc1.device)


def expert_parameters(modules) -> set[int]:
    """ids of the expert-parallel weights of `modules` (reduced over edp, not dp × cp)."""
    return {id(p) for m in modules for sub in m.modules() if isinstance(sub, ExpertParallelExperts)
            for p in sub.parameters()}
