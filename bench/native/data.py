"""Data parallelism: bucketed gradient reduction overlapped with backward, optional ZeRO-1.

Buckets hold parameters in reverse registration order (roughly the order backward produces
them). A post-accumulate-grad hook moves each gradient into its bucket and counts the parameter's
backward passes; after the last micro-batch's (`micro_batches` per step, whatever the pipeline
schedule) the parameter is ready, and a bucket whose parameters are all ready launches its
all-reduce (or ZeRO-1 reduce-scatter) asynchronously while backward goes on. `finish()` waits for
every bucket before the optimizer.

Sequence parallel: replicated parameters that act on sequence-sharded activations (norms, the
position table, row-parallel biases) get partial gradients on each tp rank. They form one extra
bucket, reduced at `finish()`: first one all-reduce over tp (the sum over sequence chunks,
4·N_sp bytes), then over dp like any bucket.

Context parallel: every bucket reduces over dp × cp (`ProcessGroups.dp_cp`), and ZeRO-1 shards over it.

Expert parallel: the expert weights (whole experts, bench.expert_parallel) form buckets of their own,
reduced (and ZeRO-1-sharded) over the expert-data-parallel group edp instead.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from bench.expert_parallel import expert_parameters
from bench.native import tensor_comm as comm
from bench.native.bucket import Bucket, split_into_buckets
from bench.native.tensor import sequence_parallel_params


class DataParallel:
    def __init__(self, chunks: list[nn.Module], run_cfg, groups):
        self.micro_batches, self.tp_group = run_cfg.micro_batches, groups.tp
        # dp × cp: each cp rank's gradient is the one of its share of the same sequences
        dp, dp_rank = groups.data_ranks, groups.data_rank
        params = _unique([p for chunk in reversed(chunks) for p in reversed(list(chunk.parameters()))])
        sp_ids = set()
        if run_cfg.sequence_parallel:
            sp_ids = {id(p) for chunk in chunks for _, p in sequence_parallel_params(chunk)}
        expert_ids = expert_parameters(chunks)
        hooked = [p for p in params if id(p) not in sp_ids | expert_ids]
        cap = run_cfg.bucket_mb * 2**20
        make = lambda ps: Bucket(ps, groups.dp_cp, dp, dp_rank, run_cfg.zero)  # noqa: E731
        self.buckets = [make(ps) for ps in split_into_buckets(hooked, cap)]
        # expert weights: reduced over the ranks holding the same experts (edp), in buckets of their own
        edp, edp_rank = len(groups.ranks["edp"]), groups.ranks["edp"].index(groups.rank)
        experts = [p for p in params if id(p) in expert_ids]
        self.buckets += [Bucket(ps, groups.edp, edp, edp_rank, run_cfg.zero) for ps in split_into_buckets(experts, cap)]
        sp_params = [p for p in params if id(p) in sp_ids]
        self.sp_bucket = make(sp_params) if sp_params else None
        self._bucket_of, self._passes = {}, {}
        for bucket in self.all_buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(_weak_hook(self._on_grad))

    @property
    def all_buckets(self) -> list[Bucket]:
        return self.buckets + ([self.sp_bucket] if self.sp_bucket else [])

    def shard_params(self) -> list[nn.Parameter]:
        """ZeRO-1: the flat shards the optimizer updates (one per bucket)."""
        return [b.shard for b in self.all_buckets]

    def start_step(self) -> None:
        for bucket in self.all_buckets:
            bucket.start_step()
        self._passes = {key: 0 for key in self._bucket_of}

    def _on_grad(self, p: torch.Tensor) -> None:
        self._passes[id(p)] += 1
        bucket = self._bucket_of[id(p)]
        bucket.take_grad(p, first=self._passes[id(p)] == 1)
        if self._passes[id(p)] == self.micro_batches and bucket is not self.sp_bucket:
            if bucket.mark_ready(p):
                bucket.launch()  # overlaps with the rest of backward

    def finish(self) -> None:
        """Wait for every bucket (launching any that never filled); SP grads summed over tp first."""
        for bucket in self.all_buckets:
            bucket.zero_untouched()
        for bucket in self.buckets:
            bucket.wait()
        if self.sp_bucket is not None:
            comm.all_reduce(self.sp_bucket.grads[:self.sp_bucket.numel], self.tp_group)  # (N_sp,) over tp
            self.sp_bucket.launch()
            self.sp_bucket.wait()
        for bucket in self.all_buckets:
            bucket.expose_grads()

    def after_step(self) -> None:
        for bucket in self.all_buckets:
            bucket.gather_params()


def _weak_hook(method):
    """A parameter's hook lives on torch's C++ side, where the garbage collector cannot see it: a hook
    that held this DataParallel (and so its buckets, parameters and dp group) would keep all of it
    alive after the run, gloo threads included. It holds it weakly."""
    ref = weakref.WeakMethod(method)
    return lambda p: ref()(p)


def _unique(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
