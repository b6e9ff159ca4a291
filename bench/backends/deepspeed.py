"""DeepSpeed backend: `deepspeed.initialize` on the shared GPT, ZeRO 0-3 or the pipeline engine.

- The DeepSpeed config is generated from the RunConfig (`deepspeed_config.final_config`), `ds_set`
  overrides applied, and recorded in the row (`ds_config`).
- ZeRO reduces over *our* dp group: DeepSpeed gets an `mpu` view of our ProcessGroups, as
  Megatron-DeepSpeed hands it Megatron's. The pipeline engine gets a ProcessTopology whose axis
  order is our Layout's rank order, so its grid's groups are exactly our tp/pp/dp groups.
- Stage 3 builds the GPT inside `deepspeed.zero.Init` (each module's weights are partitioned as soon
  as it is built) and writes each rank's partition from `models.init_value`: weights equal the
  reference and no rank ever holds the whole model.
- The pipeline is a `PipelineModule` of LayerSpecs over the shared model's own pieces (embedding,
  blocks, norm + head): a stage builds only its layers.
- Tensor parallel uses the native engine's TP layers (`bench.native.tensor`) inside DeepSpeed's
  engine, as Megatron-DeepSpeed does; the row's `tp_impl` says so.
- Context parallel is DeepSpeed Ulysses: every attention core runs inside
  `deepspeed.sequence.layer.DistributedAttention` over our cp group (`use_ulysses`), each rank holding a
  contiguous chunk of every sequence at its global positions. The `mpu` names our dp × cp group as
  DeepSpeed's sequence-data-parallel group, so ZeRO 0-3 reduce and shard over dp × cp; ZeRO 0-2 average
  over dp and sum over cp, so there each rank backpropagates its share of the sequence's mean loss
  (`_cp_loss_share`).
- Model-state bytes are DeepSpeed's own local tensors (flat parameter buffers or ZeRO-3 partitions,
  fp32 master partitions, optimizer moments, and the gradients its optimizer steps on), counted by
  the rule every backend is counted by (`bench.metrics.memory.state_bytes`).
- Warm rank processes: DeepSpeed keeps module-level state (its comm backend `cdb`, cached groups in
  `deepspeed.utils.groups`, the pipeline p2p grid, the comms logger). `cdb` follows
  torch.distributed (its `is_initialized` asks torch, and it holds no group), so it survives the
  worker's destroy/re-init; the rest is released in `close()` (see `_release_global_state`).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

from bench.backends.deepspeed_config import final_config
from bench.context_parallel import set_positions
from bench.data import sequence_share
from bench.device import comm_backend
from bench.distributed import ProcessGroups
from bench.metrics.memory import optimizer_tensors
from bench.surgery import fill_from_init, materialize, meta_module, transform_blocks
from bench.training import Batch, RunContext, Trainer, make_optimizer, whole_over_tp
from models import GPT, loss_fn
from models.gpt import Attention

# Our dims → DeepSpeed's topology axis names.
_AXIS = {"tp": "model", "pp": "pipe", "dp": "data"}


def gpt_name(name: str, pp: int) -> str:
    """The single-process GPT's name of a parameter of DeepSpeed's module: a PipelineModule (pp > 1)
    names it `<layer index>.<piece name>…`, the pieces' own names being the GPT's (blocks under their index)."""
    if pp == 1:
        return name
    rest = name.split(".", 1)[1]
    return f"blocks.{rest}" if rest[0].isdigit() else rest


def build(ctx: RunContext) -> Trainer:
    ds = _import_deepspeed(ctx)
    config = final_config(ctx.cfg)
    if ctx.cfg.pp > 1:
        return PipelineTrainer(ds, ctx, config)
    return ZeroTrainer(ds, ctx, config)


def _import_deepspeed(ctx: RunContext):
    wanted = "cuda" if ctx.device.type == "cuda" else "cpu"
    os.environ["DS_ACCELERATOR"] = wanted  # read at first import only
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != wanted:  # an earlier import in this process chose another
        raise RuntimeError(f"DeepSpeed was first imported in this process with accelerator "
                           f"{get_accelerator().device_name()!r}, this run needs {wanted!r}: run it in a fresh "
                           "process (the local launcher's ranks run one device type each)")
    # TorchBackend JIT-compiles a shared-memory op (gcc, minutes) used only for inference all-reduce.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    _release_global_state()  # a previous run in this process may have died before close()
    deepspeed.init_distributed(dist_backend=comm_backend(ctx.device), dist_init_required=False)
    return deepspeed


def _release_global_state() -> None:
    """Forget what DeepSpeed cached about the last run's process groups and logging."""
    from deepspeed import comm
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups
    groups._release_process_group_references(group=None)
    p2p._groups, p2p._grid, p2p._async = None, None, []
    comm.comms_logger.enabled = False
    comm.comms_logger.comms_dict = {}


class GroupsMpu:
    """DeepSpeed's `mpu` interface over our ProcessGroups (model parallel = tp, as with pp = 1; sequence
    parallel = cp, and DeepSpeed's sequence-data-parallel group, which ZeRO reduces and shards over, dp × cp)."""

    def __init__(self, groups: ProcessGroups):
        self.g = groups

    def get_data_parallel_group(self):
        return self.g.dp

    def get_data_parallel_world_size(self):
        return self.g.layout.dp

    def get_data_parallel_rank(self):
        return self.g.coord.dp

    def get_data_parallel_group_ranks(self):
        return list(self.g.ranks["dp"])

    def get_model_parallel_group(self):
        return self.g.tp

    def get_model_parallel_world_size(self):
        return self.g.layout.tp

    def get_model_parallel_rank(self):
        return self.g.coord.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self):
        return self.g.ranks["tp"][0]

    def get_pipeline_model_parallel_group(self):
        return self.g.pp

    def get_pipeline_model_parallel_world_size(self):
        return self.g.layout.pp

    def get_pipeline_model_parallel_rank(self):
        return self.g.coord.pp

    def get_sequence_parallel_group(self):
        return self.g.cp

    def get_sequence_parallel_world_size(self):
        return self.g.layout.cp

    def get_sequence_parallel_rank(self):
        return self.g.coord.cp

    def get_sequence_data_parallel_group(self):
        return self.g.dp_cp

    def get_sequence_data_parallel_world_size(self):
        return self.g.data_ranks

    def get_sequence_data_parallel_rank(self):
        return self.g.data_rank


def topology(layout):
    """DeepSpeed ProcessTopology with the rank order of `layout` (DeepSpeed lists axes slowest first)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    dims = list(reversed(layout.order.split("-")))  # e.g. tp-pp-dp → [dp, pp, tp]
    return ProcessTopology(axes=[_AXIS[d] for d in dims], dims=[getattr(layout, d) for d in dims])


# --- context parallel: DeepSpeed Ulysses -------------------------------------------------------------
class _BatchSeqHeads(nn.Module):
    """The model's core as DistributedAttention's local attention: q, k, v in its (B, T, heads/cp, hd)."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):  # (B, T, heads/cp, hd) ↔ the core's (B, heads/cp, T, hd)
        return self.core(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


class UlyssesAttention(nn.Module):
    """The model's attention core run over the cp group by DeepSpeed Ulysses (no parameters: names unchanged).

    DistributedAttention, batch first: one all-to-all each for Q, K and V scatters the heads and gathers
    the sequence, (B, T/cp, heads, hd) → (B, T, heads/cp, hd), in cp-rank order (so the gathered sequence
    is whole and in order: `bench.data.sequence_share` gives Ulysses contiguous chunks); the core attends
    causally over the whole sequence for its heads; one all-to-all of the output scatters the sequence
    back. Under GQA each rank gets nkv/cp K/V heads and the query heads that read them."""

    def __init__(self, core: nn.Module, cp_group):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention
        # scatter_idx 2: the heads of (B, T/cp, heads, hd); gather_idx 1: its sequence
        self.ulysses = DistributedAttention(_BatchSeqHeads(core), cp_group, scatter_idx=2, gather_idx=1)

    def forward(self, q, k, v):  # q (B, nh, T/cp, hd), k and v (B, nkv, T/cp, hd) → (B, nh, T/cp, hd)
        return self.ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch_dim_idx=0).transpose(1, 2)


def use_ulysses(model: nn.Module, cfg, groups: ProcessGroups, device: torch.device) -> nn.Module:
    """cp > 1: every Attention's core (selective recompute's wrapper included, so recompute reruns the
    local attention only, never an all-to-all) runs under Ulysses over the cp group, and the model takes
    the global positions of this rank's chunk. Apply after `transform_blocks`."""
    for attn in [m for m in model.modules() if isinstance(m, Attention)]:
        attn.core = UlyssesAttention(attn.core, groups.cp)
    return set_positions(model, sequence_share(cfg, groups.coord.cp, device))


# --- gradient / state accounting -------------------------------------------------------------------
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups_flat", "fp32_groups")


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in an attribute value (tensor, list, dict, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _DeepSpeedTrainer(Trainer):
    """What ZeRO and pipeline trainers share: the engine, state accounting, extras, cleanup."""

    tp_impl = "none"

    def __init__(self, ds, ctx: RunContext, config: dict):
        self.ds, self.ctx, self.config = ds, ctx, config
        self._grads: list[torch.Tensor] = []
        self._comms_before: dict = {}
        self._comms_step: dict = {}

    def _initialize(self, model: nn.Module, mpu=None):
        transform_blocks(model, self.ctx.cfg)  # recompute (compile is refused: bench.capabilities)
        if self.ctx.cfg.cp > 1:  # pp = 1 (bench.capabilities)
            use_ulysses(model, self.ctx.cfg, self.ctx.groups, self.ctx.device)
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        self.engine, self.optimizer, _, _ = self.ds.initialize(
            model=model, optimizer=optimizer, config=self.config, mpu=mpu, dist_init_required=False)
        self.client_optimizer = optimizer
        self._capture_grads_at_step()

    def _capture_grads_at_step(self) -> None:
        """DeepSpeed frees gradients right after its optimizer step; the base contract keeps them until
        the next step starts. So take hold of the gradients the torch optimizer steps on (ZeRO: this
        rank's fp32 partition; ZeRO-0: the module's) when DeepSpeed calls its step, and release
        them when the next step starts."""
        opt = self.client_optimizer
        inner_step = opt.step

        def step(*args, **kwargs):
            self._grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            return inner_step(*args, **kwargs)
        opt.step = step

    def _begin_step(self) -> None:
        self._grads = []  # the base contract: gradients of the last step live until the next starts
        self._comms_before = _comms_counts()

    def _end_step(self) -> None:
        self._comms_step = _comms_delta(self._comms_before, _comms_counts())

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """DeepSpeed's real local tensors, by the one rule (`bench.metrics.memory.state_bytes`): the
        module's parameter storage (ZeRO-1/2: the flat buffer they are views of; ZeRO-3: the
        `ds_tensor` partitions and the parameters it keeps whole), the gradients its optimizer stepped
        on, and what the optimizer owns: the fp32 master partitions and Adam's state.
        `bench.analysis.memory._deepspeed_state` predicts each."""
        params = []
        for p in self.engine.module.parameters():
            params += [p.data if p.numel() else None, getattr(p, "ds_tensor", None)]
        params = [t for t in params if t is not None and t.numel() > 0]
        opt = self.engine.optimizer
        masters = [t for attr in _MASTER_ATTRS for t in _tensors(getattr(opt, attr, None))]
        return {"params": params, "grads": self._grads,
                "optimizer": masters + optimizer_tensors(self.client_optimizer)}

    def extras(self) -> dict:
        out = {"ds_config": json.dumps(self.config, sort_keys=True), "tp_impl": self.tp_impl,
               "ds_optimizer": type(self.engine.optimizer).__name__}
        if self.ctx.cfg.cp > 1:
            out["cp_impl"] = "DeepSpeed Ulysses (deepspeed.sequence.DistributedAttention)"
        if self.engine.fp16_enabled():  # DeepSpeed's own dynamic loss scaler (its fp16 section)
            out["skipped_steps"] = self.engine.skipped_steps
        if self._comms_step:  # comms logger on (ds_set comms_logger.enabled=true): the last step's record
            out["ds_comms_logger"] = json.dumps(self._comms_step, sort_keys=True)
        return out

    def whole_stage_parameters(self):
        """ZeRO ≤ 2 keeps whole parameters in the module; ZeRO-3's partitions are gathered. Under tp the
        blocks are the native engine's tp layers, whose shards are concatenated."""
        named, cfg = list(self.engine.module.named_parameters()), self.ctx.cfg
        if cfg.zero == 3:
            with self.ds.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
                named = [(n, p.detach().clone()) for n, p in named]
        for name, p in named:
            gpt = gpt_name(name, cfg.pp)
            yield gpt, whole_over_tp(gpt, p.detach(), self.ctx.groups)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
        self.engine = self.optimizer = self.client_optimizer = None
        self._grads = []
        _release_global_state()


def _comms_counts() -> dict:
    """{op: {msg_size: count}} from DeepSpeed's comms logger (empty when it is off)."""
    from deepspeed import comm
    if not comm.comms_logger.enabled:
        return {}
    return {op: {size: rec[0] for size, rec in sizes.items()} for op, sizes in comm.comms_logger.comms_dict.items()}


def _comms_delta(before: dict, after: dict) -> dict:
    """{op: {"ops": n, "bytes": b}} issued between two snapshots (latencies ignored: cumulative bug)."""
    out = {}
    for op, sizes in after.items():
        ops = nbytes = 0
        for size, count in sizes.items():
            n = count - before.get(op, {}).get(size, 0)
            ops, nbytes = ops + n, nbytes + n * size
        if ops:
            out[op] = {"ops": ops, "bytes": nbytes}
    return out


class ZeroTrainer(_DeepSpeedTrainer):
    """tp = pp = 1 (or tp through the native layers): DeepSpeedEngine with ZeRO 0-3 over our dp group."""

    def __init__(self, ds, ctx: RunContext, config: dict):
        super().__init__(ds, ctx, config)
        self.mpu = GroupsMpu(ctx.groups)
        self.loss = _loss(ctx)
        self.loss_share = _cp_loss_share(ctx.cfg, config)
        self._initialize(self._build_model(), mpu=self.mpu)

    def _build_model(self) -> nn.Module:
        cfg, mcfg = self.ctx.cfg, self.ctx.cfg.model_config
        if cfg.tp > 1:  # the native engine's TP layers; ZeRO (any stage) then partitions over dp only
            from bench.native.tensor import shard_model
            self.tp_impl = "native"
            return shard_model(meta_module(lambda: GPT(mcfg)), cfg, self.ctx.groups, torch.device("cpu"), cfg.seed)
        if cfg.zero < 3:
            from models import build_model
            return build_model(mcfg, cfg.seed, "cpu")
        # Each module's weights are partitioned over dp × cp (the group the engine reduces over; Init's
        # default is the world) as soon as the module is built. No `dtype=`: 0.19.8 ignores it on a CPU
        # without fp16 (operator precedence in Init._set_dtype) and builds bf16 weights; without it the
        # dtype comes from the config (fp32 or bf16).
        with self.ds.zero.Init(config_dict_or_path=self.config, mpu=self.mpu,
                               data_parallel_group=self.mpu.get_sequence_data_parallel_group()):
            model = GPT(mcfg)
        fill_from_init(model, mcfg, cfg.seed)  # each rank writes its flat partitions only
        return model

    def train(self, batch: Batch) -> torch.Tensor:
        self._begin_step()
        losses = []
        for x, y in batch:
            loss = self.loss(self.engine(x), y)  # the mean over this rank's tokens
            self.engine.backward(loss * self.loss_share)  # DeepSpeed scales by 1 / gradient_accumulation_steps
            self.engine.step()  # steps the optimizer at the accumulation boundary only
            losses.append(loss.detach())
        self._end_step()
        return torch.stack(losses).mean()  # on the device: the worker reads it after the timed window


def _cp_loss_share(cfg, config: dict) -> float:
    """What each rank's mean loss is multiplied by before backward so that DeepSpeed's reduction yields the
    mean over dp × cp (DeepSpeed 0.19.8's rules, checked by tests/test_cp_parity.py): ZeRO 0-2 divide the
    sum over dp × cp by dp × cp / cp — they average over dp and sum over cp, expecting each rank's share
    of its sequence's loss: 1/cp of its mean; ZeRO-3's reduce-scatter averages over all dp × cp ranks: the
    mean as it is (its all-reduce path, reduce_scatter=false, mixes both rules: refused by
    bench.conventions.check_ds_set)."""
    return 1.0 if config["zero_optimization"]["stage"] == 3 else 1.0 / cfg.cp


# --- pipeline ---------------------------------------------------------------------------------------
class Piece(nn.Module):
    """One pipeline layer: a piece of the shared GPT (built on meta, tensor-parallel shapes already
    applied), allocated and filled here, on the stage that owns it, with its reference weights.

    `parts` are named as in the full GPT under `prefix` ("blocks." + {"3": block}), so `init_value`
    (and the tp split of each name) sees the same names as the single-process reference."""

    def __init__(self, parts: dict, prefix: str, run_cfg, tp_rank: int):
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)
        materialize(self, run_cfg.model_config, run_cfg.seed, "cpu",  # the engine moves it to the accelerator
                    prefix=prefix, tp_rank=tp_rank, tp=run_cfg.tp)
        self.order = list(parts)

    def forward(self, x):  # embed: (B, T) → (B, T, h); block: (B, T, h) → (B, T, h); head: → (B, T, V/tp)
        for name in self.order:
            x = getattr(self, name)(x)
        return x


def _meta_gpt(ctx: RunContext) -> nn.Module:
    """The whole GPT on the meta device (no memory), with tensor-parallel shapes and regions if tp > 1."""
    cfg = ctx.cfg
    model = meta_module(lambda: GPT(cfg.model_config))
    if cfg.tp > 1:
        from bench.native.tensor import apply_tensor_parallel
        apply_tensor_parallel(model, cfg, ctx.groups.tp, ctx.groups.coord.tp, cfg.tp)
    return model


def _loss(ctx: RunContext):
    """Cross-entropy on the head's logits: full-vocab, or vocab-sharded over tp (native TP layers)."""
    if ctx.cfg.tp == 1:
        return loss_fn
    from bench.native.tensor import vocab_parallel_cross_entropy
    group = ctx.groups.tp
    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group)


class PipelineTrainer(_DeepSpeedTrainer):
    """pp > 1: DeepSpeed's PipelineEngine (its 1F1B schedule), ZeRO 0/1 over the dp groups."""

    def __init__(self, ds, ctx: RunContext, config: dict):
        super().__init__(ds, ctx, config)
        from deepspeed.pipe import LayerSpec, PipelineModule
        cfg, tp_rank = ctx.cfg, ctx.groups.coord.tp
        gpt = _meta_gpt(ctx)
        self.tp_impl = "native" if cfg.tp > 1 else "none"
        pieces = [({"embed": gpt.embed}, ""),
                  *(({str(i): b}, "blocks.") for i, b in enumerate(gpt.blocks)),
                  ({"norm": gpt.norm, "head": gpt.head}, "")]
        # LayerSpec: a stage builds (allocates and fills) only its own pieces.
        layers = [LayerSpec(Piece, parts, prefix, cfg, tp_rank) for parts, prefix in pieces]
        net = PipelineModule(layers=layers, loss_fn=_loss(ctx), topology=topology(ctx.groups.layout),
                             partition_method="uniform")
        self._initialize(net)

    def train(self, batch: Batch) -> torch.Tensor | None:
        self._begin_step()
        loss = self.engine.train_batch(data_iter=iter(batch))  # mean over micro-batches and dp
        self._end_step()
        return loss.detach() if self.engine.is_last_stage() else None
