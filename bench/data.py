"""Synthetic, deterministic token batches (built by `Trainer.batch`, outside the timed window).

The global batch of a step is a pure function of (seed, step, shape): the same whatever the layout.
Data-parallel rank r takes the r-th contiguous slice; the slice is then cut into micro-batches.
Under context parallel each cp rank keeps its share of every sequence (`sequence_share`).
Tokens follow a noisy affine recurrence, so the loss falls as the model learns it.
"""
from __future__ import annotations

import torch

from bench.layout import zigzag_tokens


def global_batch(seed: int, step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, seq) int64; targets are inputs shifted by one token."""
    gen = torch.Generator().manual_seed(seed * 7919 + step + 1)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    noise = torch.randint(0, 3, (batch, seq), generator=gen)
    tokens = [start[:, 0]]
    for t in range(seq):
        tokens.append((tokens[-1] * 5 + 7 + noise[:, t]) % vocab)
    seqs = torch.stack(tokens, dim=1)  # (batch, seq + 1)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def micro_batches(cfg, step: int, dp_rank: int, cp_rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of `step`: micro_batches × (micro_batch, seq / cp)."""
    x, y = global_batch(cfg.seed, step, cfg.global_batch, cfg.seq, cfg.model_config.vocab)
    per_rank = cfg.micro_batch * cfg.micro_batches
    lo = dp_rank * per_rank
    x, y = x[lo:lo + per_rank], y[lo:lo + per_rank]
    if cfg.cp > 1:
        share = sequence_share(cfg, cp_rank)
        x, y = x[:, share], y[:, share]
    return list(zip(x.split(cfg.micro_batch), y.split(cfg.micro_batch)))


def sequence_share(cfg, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions cp rank `cp_rank` holds: its zig-zag pair of chunks for ring attention, the
    r-th contiguous chunk for Ulysses (whose all-to-all hands every rank the whole sequence for its heads,
    so the causal work is balanced whatever the chunks, and the gathered sequence stays in order)."""
    if cfg.cp_comm == "ulysses":
        n = cfg.seq // cfg.cp
        return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)
    return zigzag_positions(cp_rank, cfg.cp, cfg.seq, device)


def zigzag_positions(rank: int, cp: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token ids (LongTensor, seq/cp) held by cp rank `rank` of a sequence of `seq` tokens: chunks r
    and 2·cp − 1 − r of 2·cp, so that under a causal mask every rank has the same attention work (an early
    chunk with few keys, a late one with many): Megatron's and torchtitan's load-balanced sharding."""
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in zigzag_tokens(rank, cp, seq)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """cp rank `rank`'s share of `x` along its sequence dimension `dim` (tokens or targets (B, S, …))."""
    return x.index_select(dim, zigzag_positions(rank, cp, x.shape[dim], x.device))
