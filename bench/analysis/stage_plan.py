"""The stage plan of one config: what each pipeline rank holds and runs, worked out once and read
by the memory, communication and time models (`bench.analysis.memory`, `.comm`, `.estimate`).

Per pipeline rank (its tp·cp·dp peers are alike): the model chunks and their layers, whether it holds
the embedding (chunk 0) or the head (the last chunk), its parameters (its tp shard, before dp
sharding), and the activations in flight at its peak — read off the action lists its backend runs
(`bench.schedule`), as is the step's bubble. Per config: how the dp group shards the model state.
The per-parameter detail (native gradient buckets, FSDP2 groups, ZeRO-3 parameter sizes) is
looked up on demand through the plan (cached per rank shape), since each backend needs only its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, partial

from bench.analysis.memory import rank_params, sharding
from bench.analysis.params import (data_ranks, fsdp_group_sizes, native_buckets, native_expert_buckets,
                                   native_padded_buckets, stage_param_sizes)
from bench.capabilities import engine
from bench.schedule import Step, partition, rank_chunks, rank_peak, schedule_step
from models.config import GPTConfig


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank."""

    stage: int  # its pipeline rank
    chunks: tuple[int, ...]  # global chunk ids, in local order
    layer_ids: tuple[tuple[int, ...], ...]  # per local chunk
    first: bool  # holds chunk 0: the embedding
    last: bool  # holds the last chunk: final norm, head and loss
    params: float  # parameters of its tp shard, before dp sharding
    in_flight: int  # chunk-micro-batches whose activations it holds at its peak
    layers_in_flight: float  # layer-micro-batches at that peak
    head_in_flight: int  # micro-batches whose logits and loss the last chunk holds (0 if not last)

    @cached_property
    def layers(self) -> int:  # the cost model reads it per candidate; the cached ranks are shared
        return sum(map(len, self.layer_ids))


@dataclass(frozen=True)
class StagePlan:
    """One config's plan: the schedule its backend runs, the simulated step, the dp sharding, and
    the planned pipeline ranks."""

    cfg: object  # the RunConfig-like config planned
    gpus_per_node: int | None  # None: one machine
    schedule: str  # the action lists its backend runs
    fill_when_m_is_p: bool  # see bench.schedule.interleaved
    sharding: str  # what dp shards: none | optimizer | grads | params
    shard: int  # over how many ranks
    ranks: dict[int, RankPlan]  # the planned pipeline ranks, by stage

    @cached_property
    def step(self) -> Step:
        """The simulated step at unit costs: bubble, critical path (simulated when first read: the
        planner times only the candidates that can reach its top)."""
        c = self.cfg
        return schedule_step(self.schedule, c.micro_batches, c.pp, c.virtual_stages, self.fill_when_m_is_p)

    @property
    def n_chunks(self) -> int:
        return self.cfg.pp * self.cfg.virtual_stages

    @property
    def state_divisors(self) -> tuple[int, int, int]:
        """Divisors of (params, grads, optimizer) bytes from the sharding."""
        n = self.shard
        return {"none": (1, 1, 1), "optimizer": (1, 1, n), "grads": (1, n, n), "params": (n, n, n)}[self.sharding]

    def _key(self, stage: int) -> tuple:
        c = self.cfg
        return c.model_config, c.tp, c.pp, c.virtual_stages, stage

    def buckets(self, stage: int) -> tuple[tuple[int, ...], int]:
        """(element counts of the native engine's gradient buckets, of its sequence-parallel bucket); at
        ep > 1 without the expert weights (`expert_buckets`)."""
        return native_buckets(*self._key(stage), self.cfg.sequence_parallel, self.cfg.bucket_mb, self.cfg.ep)

    def padded_buckets(self, stage: int) -> int:
        """Elements of those buckets, each padded to a multiple of dp·cp (ZeRO-1's flat buffers)."""
        return native_padded_buckets(*self._key(stage), self.cfg.sequence_parallel, self.cfg.bucket_mb,
                                     data_ranks(self.cfg), self.cfg.ep)

    def expert_buckets(self, stage: int) -> tuple[int, ...]:
        """Element counts of the native engine's expert-weight buckets (ep > 1; reduced over edp)."""
        return native_expert_buckets(*self._key(stage), self.cfg.bucket_mb, self.cfg.ep)

    def fsdp_groups(self, stage: int, shard: int) -> tuple[tuple[str, int], ...]:
        """(kind, padded element count) of each FSDP2 group of a rank, sharded `shard` ways."""
        return fsdp_group_sizes(*self._key(stage), shard)

    def param_sizes(self, stage: int) -> list[int]:
        """Element counts of every parameter a rank holds, in registration order."""
        return list(stage_param_sizes(*self._key(stage)))


def executed_schedule(cfg) -> tuple[str, bool]:
    """(schedule, fill_when_m_is_p) of the action lists the backend runs (its Engine record). Without a
    pipeline an engine accumulates gradients one micro-batch at a time (1F1B at p = 1) unless it runs
    its schedule's order even then (native); torch.distributed.pipelining does not fill at m = p."""
    eng = engine(cfg)
    if cfg.pp == 1 and not eng.runs_schedule_without_pipeline:
        return "1f1b", True
    return cfg.schedule, eng.fills_when_m_is_p


@lru_cache(maxsize=65536)
def rank_plan(mc: GPTConfig, tp: int, pp: int, virtual_stages: int, micro_batches: int, schedule: str,
              fill_when_m_is_p: bool, stage: int, ep: int = 1) -> RankPlan:
    """One pipeline rank's share (cached: the planner asks for the same ranks under many dp sizes
    and backends)."""
    chunks, layer_ids, first, last, peaks = _rank_shape(mc.layers, pp, virtual_stages, micro_batches, schedule,
                                                        fill_when_m_is_p, stage)
    return RankPlan(stage, chunks, layer_ids, first, last,
                    rank_params(mc, tp, pp, [i for ids in layer_ids for i in ids], first, last, ep), *peaks)


@lru_cache(maxsize=65536)
def _rank_shape(n_layers: int, pp: int, virtual_stages: int, micro_batches: int, schedule: str,
                fill_when_m_is_p: bool, stage: int) -> tuple:
    """(chunks, layer ids, first, last, (in flight, layers in flight, head in flight)) of a rank: the
    same under every tp size and model width (cached apart from the parameters: the planner's
    candidates of 4 or 5 tp sizes share each rank's schedule)."""
    p, m, v = pp, micro_batches, virtual_stages
    parts = partition(n_layers, p * v)
    chunks = tuple(rank_chunks(stage, p, v))
    layer_ids = tuple(tuple(parts[c]) for c in chunks)
    first, last = 0 in chunks, len(parts) - 1 in chunks
    layers = tuple(len(ids) for ids in layer_ids)
    head = tuple(int(j == v - 1) for j in range(v))
    peak = partial(rank_peak, schedule, m, p, stage, v, fill_when_m_is_p)
    return chunks, layer_ids, first, last, (peak(), peak(layers), peak(head) if last else 0)


def stage_plan(cfg, gpus_per_node: int | None = None, stages=None) -> StagePlan:
    """The plan of `cfg` for the listed pipeline ranks (all by default). `gpus_per_node`: where FSDP
    hybrid's shard groups end (None: one machine holds every dp rank)."""
    name, fill = executed_schedule(cfg)
    shape = (cfg.model_config, cfg.tp, cfg.pp, cfg.virtual_stages, cfg.micro_batches, name, fill)
    stages = range(cfg.pp) if stages is None else stages
    return StagePlan(cfg, gpus_per_node, name, fill, *sharding(cfg, gpus_per_node),
                     {s: rank_plan(*shape, s, cfg.ep) for s in stages})
