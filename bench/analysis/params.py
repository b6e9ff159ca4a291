"""Every parameter a rank holds, in registration order, with its local shape: what the engines
bucket (native ZeRO-1 pads each bucket to a multiple of dp) and shard (FSDP2 pads dim 0 of each
parameter to a multiple of the shard size). Exact byte predictions need this level of detail;
everything else in the cost model works on totals.

The parameters come from the model's parameter table (`models.config.param_table`): each entry here
is (name, local shape, tp_split), the local shape cut from the full one by the parameter's tp kind;
tp_split is False for parameters replicated over tp (norms, row-parallel biases, the position table:
under sequence parallel their gradients are partial per sequence chunk and get summed over tp).
"""
from __future__ import annotations

from functools import lru_cache

from bench import conventions
from bench.capabilities import engine
from bench.conventions import grad_bytes
from bench.analysis.zero3 import Gathers, gpt_tree, replay
from bench.schedule import partition, rank_chunks
from models.config import GPTConfig, ParamSpec, block_table, embed_table, final_table, head_spec, role_spec

Param = tuple[str, tuple[int, ...], bool]


def data_ranks(cfg) -> int:
    """The ranks that hold the same parameters and reduce their gradients together: dp × cp (each cp
    rank trained on a share of the same sequences; Megatron's data-parallel group with context parallel,
    DeepSpeed's sequence-data-parallel group, torchtitan's FSDP mesh dp_shard × cp). Every dp-sized
    gradient reduction and state shard of the cost model is over these ranks."""
    return cfg.dp * cfg.cp


def _local(spec: ParamSpec, tp: int, vocab_parallel: bool) -> Param:
    """`spec` as one of `tp` ranks holds it; vocab_parallel False keeps vocab-split tables whole."""
    if spec.tp == "replicated" or (spec.tp == "vocab" and not vocab_parallel):
        return spec.name, spec.shape, False
    return spec.name, spec.local_shape(tp), True


def _locals(specs: tuple[ParamSpec, ...], tp: int, vocab_parallel: bool = True) -> list[Param]:
    return [_local(s, tp, vocab_parallel) for s in specs]


@lru_cache(maxsize=65536)
def _block(m: GPTConfig, i: int, tp: int) -> tuple[Param, ...]:
    return tuple(_locals(block_table(m, i), tp))


def chunk_params(m: GPTConfig, tp: int, first: bool, last: bool, layer_ids: list[int], tied_here: bool,
                 vocab_parallel: bool = True) -> list[Param]:
    """A model chunk: embedding (first), blocks, final norm and head (last). `vocab_parallel`: the
    token table and head split over tp (native); False: replicated (the fsdp backend's DTensor plan)."""
    out: list[Param] = _locals(embed_table(m), tp, vocab_parallel) if first else []
    for i in layer_ids:
        out += _block(m, i, tp)
    if last:
        out += _locals(final_table(m), tp)
        if not tied_here:
            out.append(_local(head_spec(m), tp, vocab_parallel))
    return out


def stage_chunk_params(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int,
                       vocab_parallel: bool = True) -> list[list[Param]]:
    """The chunks pipeline rank `stage` holds, each as its parameter list."""
    parts = partition(m.layers, pp * virtual_stages)
    out = []
    for c in rank_chunks(stage, pp, virtual_stages):
        first, last = c == 0, c == len(parts) - 1
        out.append(chunk_params(m, tp, first, last, parts[c], first and last and m.tie_embeddings, vocab_parallel))
    return out


@lru_cache(maxsize=65536)
def stage_param_sizes(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int) -> tuple[int, ...]:
    """Element counts of every parameter pipeline rank `stage` holds, in registration order."""
    return tuple(numel(s) for chunk in stage_chunk_params(m, tp, pp, virtual_stages, stage) for _, s, _ in chunk)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lru_cache(maxsize=4096)
def native_buckets(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int, sequence_parallel: bool,
                   bucket_mb: float, ep: int = 1) -> tuple[tuple[int, ...], int]:
    """(element counts of the gradient buckets, of the sequence-parallel bucket) as bench.native
    builds them: parameters in reverse order, a new bucket when the next would pass bucket_mb. At ep > 1
    the expert weights are not in them: `native_expert_buckets`."""
    params = _reversed_params(m, tp, pp, virtual_stages, stage)
    sp = [p for p in params if sequence_parallel and not p[2]]
    hooked = [p for p in params if not (sequence_parallel and not p[2]) and not (ep > 1 and _is_expert(p[0]))]
    return _fill_buckets([numel(shape) for _, shape, _ in hooked], bucket_mb), sum(numel(s) for _, s, _ in sp)


@lru_cache(maxsize=4096)
def native_expert_buckets(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int, bucket_mb: float,
                          ep: int) -> tuple[int, ...]:
    """Element counts of the native engine's expert-weight buckets at ep > 1 (this rank's E/ep experts,
    reduced over the expert-data-parallel group); () at ep = 1."""
    if ep == 1:
        return ()
    params = _reversed_params(m, tp, pp, virtual_stages, stage)
    return _fill_buckets([numel(shape) // ep for name, shape, _ in params if _is_expert(name)], bucket_mb)


def _reversed_params(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int) -> list[Param]:
    chunks = stage_chunk_params(m, tp, pp, virtual_stages, stage)
    return [p for chunk in reversed(chunks) for p in reversed(chunk)]


def _is_expert(name: str) -> bool:
    return role_spec(name).ep == "expert"


def _fill_buckets(sizes: list[int], bucket_mb: float) -> tuple[int, ...]:
    """Consecutive sizes, a new bucket whenever the next would pass bucket_mb (fp32 gradients)."""
    cap, buckets, size = bucket_mb * 2**20, [], 0
    for n in sizes:
        if buckets and size + n * 4 > cap:
            buckets.append(0)
            size = 0
        if not buckets:
            buckets.append(0)
        buckets[-1] += n
        size += n * 4
    return tuple(buckets)


@lru_cache(maxsize=65536)
def native_padded_buckets(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int, sequence_parallel: bool,
                          bucket_mb: float, dp: int, ep: int = 1) -> int:
    """Elements of the native engine's ZeRO-1 buckets (`native_buckets`, the sequence-parallel one
    included), each padded to a multiple of dp."""
    buckets, n_sp = native_buckets(m, tp, pp, virtual_stages, stage, sequence_parallel, bucket_mb, ep)
    return padded_total((*buckets, n_sp), dp)


def padded_total(sizes, n: int) -> int:
    """Elements of flat buffers of `sizes` elements, each padded to a multiple of n (ZeRO-1's shards)."""
    return sum(-(-b // n) * n for b in sizes if b)


@lru_cache(maxsize=4096)
def fsdp_groups(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int) -> list[tuple[str, list[Param]]]:
    """FSDP2 communication groups of a stage's chunks: each block, then the chunk's remaining
    parameters (the root: embeddings, final norm, head), in the order FSDP wraps them."""
    out = []
    for chunk in stage_chunk_params(m, tp, pp, virtual_stages, stage, vocab_parallel=False):
        blocks: dict[str, list[Param]] = {}
        root: list[Param] = []
        for p in chunk:
            if p[0].startswith("blocks."):
                blocks.setdefault(p[0].split(".")[1], []).append(p)
            else:
                root.append(p)
        out += [("block", ps) for ps in blocks.values()] + ([("root", root)] if root else [])
    return out


def padded_numel(shape: tuple[int, ...], shards: int) -> int:
    """FSDP2 pads dim 0 of every parameter to a multiple of the shard count."""
    dim0 = -(-shape[0] // shards) * shards
    return dim0 * numel(shape[1:])


@lru_cache(maxsize=65536)
def fsdp_group_sizes(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int,
                     shard: int) -> tuple[tuple[str, int], ...]:
    """(kind, padded element count) of every FSDP2 group of a stage, sharded `shard` ways."""
    return tuple((kind, _padded_group(tuple(s for _, s, _ in ps), shard))
                 for kind, ps in fsdp_groups(m, tp, pp, virtual_stages, stage))


@lru_cache(maxsize=65536)
def _padded_group(shapes: tuple[tuple[int, ...], ...], shard: int) -> int:
    """Padded elements of one group of those shapes (cached: every block of a model has the same)."""
    return sum(padded_numel(s, shard) for s in shapes)


# --- DeepSpeed's view of the parameters -----------------------------------------------------------
def deepspeed_settings(cfg) -> dict:
    """The knobs of the DeepSpeed config the run gets (generated, then `ds_set`) that shape traffic
    and state: persistence threshold, bucket sizes (elements), pipeline partitioning. Defaults are
    DeepSpeed 0.19's. Cached on what it reads (the planner asks once per candidate and stage)."""
    return _deepspeed_settings(cfg.bucket_mb, grad_bytes(cfg), getattr(cfg, "ds_set", ()),  # the planner's shapes
                               conventions.zero3_knobs(cfg))                             # have none


_deepspeed_settings = lru_cache(maxsize=4096)(conventions.deepspeed_settings)


def deepspeed_bf16_optimizer(cfg) -> bool:
    """DeepSpeed's pipeline engine trains bf16 at ZeRO-0 through its BF16_Optimizer, which partitions
    the fp32 master over dp like ZeRO-1 (engine._do_optimizer_sanity_check)."""
    return engine(cfg).bf16_pipeline_optimizer and cfg.zero == 0 and cfg.dtype == "bf16-mixed" and cfg.pp > 1


def deepspeed_zero3_split(plan, stage: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(element counts of the persistent parameters, of the partitioned ones) of a rank: DeepSpeed
    keeps a parameter whole on every rank when numel ≤ stage3_param_persistence_threshold."""
    return _zero3_split(*plan._key(stage), deepspeed_settings(plan.cfg)["stage3_param_persistence_threshold"])


@lru_cache(maxsize=65536)
def _zero3_split(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int,
                 threshold: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    params = stage_param_sizes(m, tp, pp, virtual_stages, stage)
    return tuple(n for n in params if n <= threshold), tuple(n for n in params if n > threshold)


def zero3_padded_sums(plan, stage: int) -> tuple[int, int]:
    """(elements of the persistent, of the partitioned parameters of a rank) each padded to a multiple
    of dp (`zero3_padded`); cached per rank shape and dp."""
    threshold = deepspeed_settings(plan.cfg)["stage3_param_persistence_threshold"]
    return _zero3_padded_sums(*plan._key(stage), threshold, data_ranks(plan.cfg))


@lru_cache(maxsize=65536)
def _zero3_padded_sums(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int, threshold: int,
                       dp: int) -> tuple[int, int]:
    kept, parted = _zero3_split(m, tp, pp, virtual_stages, stage, threshold)
    return sum(zero3_padded(n, dp) for n in kept), sum(zero3_padded(n, dp) for n in parted)


def zero3_padded(numel: int, dp: int) -> int:
    """ZeRO-3 pads every parameter to a multiple of dp before it partitions it (ceil(numel/dp) each)."""
    return -(-numel // dp) * dp


def zero12_padded(numel: int, dp: int) -> int:
    """ZeRO-1/2 flatten a parameter group into one buffer padded to a multiple of 2·dp elements
    (`nccl_start_alignment_factor` 2 per rank); each rank owns 1/dp of it."""
    return -(-numel // (2 * dp)) * (2 * dp)


def zero3_gathers(plan, stage: int, recompute: str | None = None) -> Gathers:
    """The all-gathers DeepSpeed ZeRO-3 issues in one steady-state micro-batch, forward and backward (the
    backward re-gathers what the live-parameter budget or the reuse distance freed), by replaying its
    coordinator (`bench.analysis.zero3`) under the run's recomputation, or `recompute`. Cached per rank
    shape, dp and the settings it reads."""
    cfg, ds = plan.cfg, deepspeed_settings(plan.cfg)
    return _zero3_gathers(*plan._key(stage), data_ranks(cfg), ds["stage3_prefetch_bucket_size"],
                          ds["stage3_max_live_parameters"], ds["stage3_max_reuse_distance"],
                          ds["stage3_param_persistence_threshold"], recompute or cfg.recompute, cfg.cp > 1 and cfg.cp_comm == "ulysses")


@lru_cache(maxsize=65536)
def _zero3_gathers(m: GPTConfig, tp: int, pp: int, virtual_stages: int, stage: int, dp: int, bucket: int,
                   max_live: int, max_reuse: int, threshold: int, recompute: str, ulysses: bool) -> Gathers:
    params = [(name, numel(shape)) for chunk in stage_chunk_params(m, tp, pp, virtual_stages, stage)
              for name, shape, _ in chunk]
    names, sizes = tuple(n for n, _ in params), tuple(n for _, n in params)
    tied = names.index("embed.tok.weight") if m.tie_embeddings and "embed.tok.weight" in names else None
    persistent = frozenset(i for i, n in enumerate(sizes) if n <= threshold)
    return replay(gpt_tree(names, tied, recompute, ulysses), sizes, dp, persistent, bucket, max_live, max_reuse)
