"""The knobs practitioners sweep: selective activation recomputation, torch.compile of each block, the
dynamic loss scaler of fp16-mixed, and all of them as sweep axes and row columns.

- Selective recomputation: the bytes a forward leaves alive for backward, per layer of `small`, equal
  the cost model's (bench.analysis.memory, `suite` model) for none / selective / full, and the native
  engine reproduces the single-process loss and gradients on tp 2 / pp 2 / dp 2 with it.
- Compile: the same parity with `compile` on (inductor with the system C++ compiler), ddp and fsdp
  against the reference loss; the row records `compile` and `compile_s`.
- Loss scaling: the scaler the trainers call (`bench.loss_scale.optimizer_step`) on CPU fp32 tensors:
  an inf in one gradient skips the step and backs off, good steps grow the scale, and over two ranks an
  inf on one of them makes both skip; then the native (pp 2), ddp and fsdp trainers themselves, given the
  scaler their fp16-mixed construction makes on CUDA: the unscaled loss trajectory equals the reference,
  and an overflowing first step is skipped on every rank; and the scaler each trainer's own fp16-mixed
  construction makes votes over the world exactly where the ranks' gradients differ (ZeRO-1, tp, pp, FSDP).
"""
import functools
import gc
import math

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.analysis.memory import ActivationModel, layer_activation_bytes
from bench.config import ConfigError, RunConfig
from bench.data import global_batch
from bench.loss_scale import LossScaler, optimizer_step
from bench.surgery import apply_recompute
from bench.training import make_optimizer
from models import build_model, loss_fn
from support.parity import reference, run_layouts

LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6  # tests/test_native.py's parity tolerance
COMPILE_RTOL, COMPILE_ATOL = 1e-4, 1e-5
"""Inductor fuses and reorders fp32 reductions: compiled vs eager agree to ~1e-6 relative here; the stated
tolerance for compile parity is 1e-4 relative (loss and gradients), atol 1e-5 on gradients."""


# --- selective recomputation: the bytes kept for backward -------------------------------------------------
class LiveTensors(TorchDispatchMode):
    """Every storage an op allocates while active; `live_bytes` is what of it is still alive (held by
    autograd for backward, or by the caller)."""

    def __init__(self, existing=()):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.existing = {t.untyped_storage()._cdata for t in existing}
        """Storages made before (parameters, inputs): a view of one (a weight's transpose) is not new memory."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.existing:
                s = t.untyped_storage()
                self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes())  # a reused address: the newest storage
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.refs.values() if not ref.expired())


@functools.lru_cache(maxsize=None)
def kept_for_backward(layers: int, recompute: str, b: int = 2, kernel: str = "default") -> int:
    """Bytes alive after the forward and loss of `small` with `layers` layers (fp32, on CPU)."""
    cfg = RunConfig(model="small", model_overrides=(f"layers={layers}",), recompute=recompute, micro_batch=b)
    model = apply_recompute(build_model(cfg.model_config, 0), recompute)
    x, y = global_batch(0, 0, b, cfg.seq, cfg.model_config.vocab)
    with LiveTensors([*model.parameters(), x, y]) as live:
        loss = loss_fn(model(x), y)
    kept = live.live_bytes()
    del loss
    return kept


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_per_layer_equal_the_formula(recompute):
    cfg = RunConfig(model="small", micro_batch=2)
    m, b, s = cfg.model_config, cfg.micro_batch, cfg.seq
    measured = (kept_for_backward(4, recompute) - kept_for_backward(2, recompute)) / 2  # per layer
    predicted = layer_activation_bytes(m, b, s, recompute=recompute, e=4, act=ActivationModel("suite"))
    # The formula leaves out LayerNorm's per-token mean and rstd (2 × 2 fp32 per token): 0.1 %.
    assert predicted <= measured <= predicted * 1.002, (measured, predicted)
    if recompute == "full":
        assert measured == 4 * b * s * m.hidden  # the block input only


def test_selective_drops_exactly_the_attention_core_internals():
    # With the fused kernel the attention core saves, besides its inputs and output, only its
    # log-sum-exp: a fp32 per head and token. Selective recomputation drops exactly that, as the formula
    # says; none > selective > full as bench.analysis.memory orders them.
    cfg = RunConfig(model="small", micro_batch=2)
    m, tokens = cfg.model_config, cfg.micro_batch * cfg.seq
    per_layer = {mode: (kept_for_backward(4, mode) - kept_for_backward(2, mode)) / 2
                 for mode in ("none", "selective", "full")}
    assert per_layer["none"] > per_layer["selective"] > per_layer["full"]
    assert per_layer["none"] - per_layer["selective"] == 4 * m.heads * tokens
    formula = {mode: layer_activation_bytes(m, cfg.micro_batch, cfg.seq, recompute=mode, e=4,
                                            act=ActivationModel("suite")) for mode in per_layer}
    assert formula["none"] - formula["selective"] == 4 * m.heads * tokens


def test_unfused_attention_is_what_selective_recomputation_is_for():
    # The math kernel saves the a·s² softmax: selective recomputation then drops it (Korthikanti's case).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        none, selective = (kept_for_backward(4, r, kernel="math") - kept_for_backward(2, r, kernel="math")
                           for r in ("none", "selective"))
    cfg = RunConfig(model="small", micro_batch=2)
    m, b, s = cfg.model_config, cfg.micro_batch, cfg.seq
    assert none - selective >= 4 * b * m.heads * s * s  # at least the fp32 softmax output, per layer


@pytest.mark.slow
def test_measured_step_peak_follows_the_recompute_mode(pools):
    # The worker's RSS peak on `small` (world 1): each mode in the band of tests/test_analysis_measured.py;
    # full far below the others; selective within noise of none, as the formula says (it drops 0.1 %).
    from bench.analysis.estimate import estimate
    peaks = {}
    for mode in ("none", "selective", "full"):
        cfg = RunConfig(model="small", recompute=mode, steps=2, warmup=1, micro_batch=8)
        row = pools(1).run(cfg)
        assert row["status"] == "ok", row.get("error")
        est = estimate(cfg, mixed_state="autocast", activations="suite")["stages"][0]
        peaks[mode] = row["peak_mem_bytes"]
        assert 0.6 <= peaks[mode] / (est["activation_bytes"] + est["transient_bytes"]) <= 1.5, mode
    assert peaks["full"] < 0.6 * min(peaks["none"], peaks["selective"])
    assert abs(peaks["selective"] - peaks["none"]) <= 0.05 * peaks["none"]


# --- parity: native tp 2 / pp 2 / dp 2 ----------------------------------------------------------------------
def _check_parity(cfgs, results, rtol=GRAD_RTOL, atol=GRAD_ATOL, loss_rtol=LOSS_RTOL):
    failures = []
    for cfg, got in zip(cfgs, results):
        ref = reference(cfg)
        if not math.isclose(got["losses"][-1], ref["losses"][-1], rel_tol=loss_rtol):
            failures.append(f"{cfg.run_id}: loss {got['losses']} vs {ref['losses']}")
        if got["grads"] is not None:
            for name, g in ref["grads"].items():
                try:
                    torch.testing.assert_close(got["grads"][name], g, rtol=rtol, atol=atol)
                except AssertionError as e:
                    failures.append(f"{cfg.run_id} grad {name}: {e}")
    assert not failures, "\n".join(failures)


LAYOUTS_2 = [dict(tp=2, micro_batches=1), dict(pp=2, micro_batches=2), dict(dp=2, micro_batches=2)]


def test_selective_recompute_parity_native_world2(pools):
    cfgs = [RunConfig(recompute="selective", **kw) for kw in LAYOUTS_2]
    _check_parity(cfgs, run_layouts(pools(2), cfgs))


def test_compile_parity_native_tp2(pools):
    cfgs = [RunConfig(compile=True, recompute="selective", tp=2, micro_batches=1)]
    _check_parity(cfgs, run_layouts(pools(2), cfgs), COMPILE_RTOL, COMPILE_ATOL, COMPILE_RTOL)


@pytest.mark.slow
def test_compile_parity_native_pp2_dp2_and_world1(pools):
    cfgs = [RunConfig(compile=True, pp=2, micro_batches=2), RunConfig(compile=True, dp=2, micro_batches=2),
            RunConfig(compile=True, recompute="full", dp=2, micro_batches=2)]
    _check_parity(cfgs, run_layouts(pools(2), cfgs), COMPILE_RTOL, COMPILE_ATOL, COMPILE_RTOL)
    one = [RunConfig(compile=True, micro_batches=2)]
    _check_parity(one, run_layouts(pools(1), one), COMPILE_RTOL, COMPILE_ATOL, COMPILE_RTOL)


# --- every backend: the row -----------------------------------------------------------------------------------
RUN = dict(model="tiny", steps=2, warmup=1)  # global batch 4: micro_batch × micro_batches × dp


@pytest.fixture(scope="module")
def reference_loss(pools):
    row = pools(1).run(RunConfig(**RUN, micro_batch=2, micro_batches=2))
    assert row["status"] == "ok", row.get("error")
    return row["loss_last"]


def _row(pools, **kw) -> dict:
    cfg = RunConfig(**RUN, **kw)
    row = pools(cfg.world).run(cfg)
    assert row["status"] == "ok", row.get("error")
    return row


@pytest.mark.parametrize("kw", [dict(backend="ddp", dp=2), dict(backend="fsdp", dp=2),
                                dict(backend="fsdp", tp=2, micro_batch=4), dict(backend="deepspeed", dp=2, zero=3),
                                dict(backend="deepspeed", pp=2, micro_batches=2)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_selective_recompute_every_backend(pools, reference_loss, kw):
    row = _row(pools, recompute="selective", **kw)
    assert math.isclose(row["loss_last"], reference_loss, rel_tol=LOSS_RTOL)
    for dim in ("tp", "pp", "dp"):  # the core holds no collective: recomputing it sends nothing
        assert row[f"pred_comm_bytes_{dim}"] == pytest.approx(row[f"comm_bytes_{dim}"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(backend="ddp", dp=2), dict(backend="fsdp", dp=2),
                                dict(backend="fsdp", pp=2, micro_batches=2),
                                dict(backend="native", tp=2, micro_batch=4)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_compile_every_backend_matches_eager(pools, reference_loss, kw):
    row = _row(pools, compile=True, **kw)
    assert math.isclose(row["loss_last"], reference_loss, rel_tol=COMPILE_RTOL)
    assert row["compile"] is True and row["compile_s"] > 0
    for dim in ("tp", "pp", "dp"):  # compiled blocks send what eager ones send
        for what in ("bytes", "ops"):
            assert row[f"pred_comm_{what}_{dim}"] == pytest.approx(row[f"comm_{what}_{dim}"], abs=1e-6), (dim, what)


@pytest.mark.slow
def test_compile_row_records_compile_time_apart_from_step_time(pools):
    row = _row(pools, compile=True, micro_batches=2)
    assert row["compile"] is True
    assert row["compile_s"] > row["step_time_s"]  # the first warm-up step compiled; no timed step did
    plain = _row(pools, micro_batches=2)
    assert plain["compile"] is False and plain.get("compile_s") is None
    assert math.isclose(row["loss_last"], plain["loss_last"], rel_tol=COMPILE_RTOL)


# --- loss scaling ----------------------------------------------------------------------------------------------
def _model_and_grads(scaler: LossScaler | None, step: int = 0):
    cfg = RunConfig(model="tiny")
    model = build_model(cfg.model_config, 0)
    x, y = global_batch(0, step, 2, cfg.seq, cfg.model_config.vocab)
    loss = loss_fn(model(x), y)
    (scaler.scale_loss(loss) if scaler else loss).backward()
    return model


def test_scaler_unscales_to_the_plain_gradients():
    scaler = LossScaler(init_scale=2.0**10)
    scaled, plain = _model_and_grads(scaler), _model_and_grads(None)
    optimizer = make_optimizer(scaled.parameters())
    grads_before_step = {}
    inner = optimizer.step

    def step(*a, **k):  # the gradients the optimizer applies: unscaled
        grads_before_step.update({n: p.grad.clone() for n, p in scaled.named_parameters()})
        return inner(*a, **k)
    optimizer.step = step
    optimizer_step(optimizer, scaler)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads_before_step[name], p.grad, rtol=1e-6, atol=1e-9)
    assert scaler.skipped == 0 and scaler.scale == 2.0**10


def test_scaler_skips_an_overflowing_step_and_backs_off_then_grows():
    scaler = LossScaler(init_scale=2.0**16, growth_interval=3)
    model = _model_and_grads(scaler)
    optimizer = make_optimizer(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    next(model.parameters()).grad.view(-1)[7] = float("inf")  # one overflowed gradient element
    optimizer_step(optimizer, scaler)
    assert scaler.skipped == 1 and scaler.scale == 2.0**15
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # no update, and no optimizer state either
    assert not optimizer.state
    for step in range(3):  # growth_interval good steps: the scale doubles once
        optimizer.zero_grad()
        x, y = global_batch(0, step, 2, 32, 256)
        scaler.scale_loss(loss_fn(model(x), y)).backward()
        optimizer_step(optimizer, scaler)
    assert scaler.skipped == 1 and scaler.scale == 2.0**16
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def _vote_on_rank(plant_on: int) -> tuple[bool, float, int]:
    import torch.distributed as dist
    from bench.distributed import rank_session
    with rank_session("cpu"):
        rank = dist.get_rank()
        scaler = LossScaler(group=dist.group.WORLD, init_scale=8.0)
        model = _model_and_grads(scaler, step=rank)
        if rank == plant_on:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        stepped = scaler.step(make_optimizer(model.parameters()))
        return stepped, scaler.scale, scaler.skipped


def test_scaler_ranks_agree_on_skipping(pools):
    # Sharded or tensor-parallel ranks hold different gradients: an overflow on one rank skips everyone.
    assert pools(2).call(_vote_on_rank, 1) == [(False, 4.0, 1), (False, 4.0, 1)]
    assert pools(2).call(_vote_on_rank, -1) == [(True, 8.0, 0), (True, 8.0, 0)]


def _train_with_scaler_on_rank(cfg_dict: dict, init_scale: float, backoff: float, steps: int):
    """A backend's trainer on CPU fp32 with the scaler its fp16-mixed __init__ would make on CUDA (fp16 is
    refused on CPU): the trainer's own loss scaling, unscaling, vote and skip."""
    import torch.distributed as dist
    from bench.distributed import rank_session
    from bench.worker import trainer_on_rank
    cfg = RunConfig.from_dict(cfg_dict)
    with rank_session("cpu") as device, trainer_on_rank(cfg, device) as (trainer, groups):
        trainer.scaler = LossScaler(group=dist.group.WORLD, init_scale=init_scale, backoff_factor=backoff)
        losses = []
        for step in range(steps):
            loss = trainer.train(trainer.batch(step))
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, None if loss is None else loss.item())
            losses.append(sum(v for v in every if v is not None) / sum(v is not None for v in every))
        return losses, trainer.extras()["skipped_steps"], trainer.scaler.scale


@pytest.mark.parametrize("kw", [dict(backend="native", pp=2, micro_batches=2), dict(backend="ddp", dp=2),
                                dict(backend="fsdp", dp=2)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_trainers_scale_unscale_and_skip(pools, kw):
    cfg = RunConfig(model="tiny", **kw)
    ref = reference(cfg)["losses"]
    losses, skipped, scale = pools(2).call(_train_with_scaler_on_rank, cfg.to_dict(), 2.0**16, 0.5, 3)[0]
    assert skipped == 0 and scale == 2.0**16
    for got, want in zip(losses, ref):  # scaled by a power of two and back: the unscaled trajectory
        assert math.isclose(got, want, rel_tol=LOSS_RTOL), (losses, ref)
    # 2²⁰⁰ overflows fp32 in the first backward: that step is skipped on every rank, the scale backs off
    losses, skipped, scale = pools(2).call(_train_with_scaler_on_rank, cfg.to_dict(), 2.0**200, 2.0**-100, 2)[0]
    assert skipped == 1 and scale == 2.0**100
    assert math.isclose(losses[0], ref[0], rel_tol=LOSS_RTOL)  # the reported loss is the unscaled one


def _scaler_groups_on_rank(cfg_dicts: list[dict]) -> list[str]:
    """Each config's trainer as its backend builds it for fp16-mixed (a CUDA config, built on this CPU rank:
    only construction, no fp16 step): which ranks its scaler makes vote on skipping."""
    import torch.distributed as dist
    from bench.distributed import rank_session
    from bench.worker import trainer_on_rank
    out = []
    with rank_session("cpu") as device:
        for cfg_dict in cfg_dicts:
            with trainer_on_rank(RunConfig.from_dict(cfg_dict), device) as (trainer, groups):
                scaler = trainer.scaler
                if scaler is None:
                    out.append("no scaler")
                elif scaler.group is None:
                    out.append("this rank alone")
                else:
                    out.append("world" if scaler.group is dist.group.WORLD else
                               f"group {dist.get_process_group_ranks(scaler.group)}")
    return out


SCALER_VOTES = [  # (trainer, who votes on skipping): every rank whose gradients are not every rank's
    (dict(backend="native", dp=2, zero=1), "world"),  # ZeRO-1: each rank steps its own shard
    (dict(backend="native", tp=2), "world"),
    (dict(backend="native", pp=2, micro_batches=2), "world"),
    (dict(backend="native", dp=2), "this rank alone"),  # replicas: one rank's verdict is everyone's
    (dict(backend="ddp", dp=2), "this rank alone"),
    (dict(backend="fsdp", dp=2), "world"),
]


def test_the_loss_scaler_votes_wherever_the_ranks_gradients_differ(pools):
    """The trainers' own fp16-mixed construction (test_trainers_scale_unscale_and_skip replaces the scaler):
    ZeRO-1, tp, pp and FSDP ranks vote over the world, replicas skip on their own verdict."""
    cfgs = [RunConfig(model="tiny", dtype="fp16-mixed", device="cuda", **kw) for kw, _ in SCALER_VOTES]
    got = pools(2).call(_scaler_groups_on_rank, [c.to_dict() for c in cfgs])
    want = [vote for _, vote in SCALER_VOTES]
    assert got[0] == got[1] == want, [(kw, g) for (kw, _), g in zip(SCALER_VOTES, got[0])]
    fp32 = RunConfig(model="tiny", backend="native", dp=2, zero=1)
    assert pools(2).call(_scaler_groups_on_rank, [fp32.to_dict()]) == [["no scaler"]] * 2


# --- bad input, sweeps, labels -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="deepspeed", compile=True), r"^backend deepspeed: compile is not supported .*use backend native"),
    (dict(compile=True, warmup=0), r"^compile needs warmup ≥ 1 .*set --warmup 1"),
    (dict(dtype="fp16-mixed", device="cpu"), r"^backend native: dtype fp16-mixed is not supported on cpu; use bf16"),
    (dict(backend="fsdp", dtype="fp16-mixed"), r"^backend fsdp: dtype fp16-mixed is not supported on cpu \(device"),
])
def test_bad_knobs_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        RunConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_sweep_axes_and_skipped_rows(tmp_path):
    from bench.sweep.spec import expand, load_sweep
    path = tmp_path / "knobs.yaml"
    # kv_heads: an axis over presets (tiny: 4 K/V heads, tiny-gqa: 2); a whole sweep can also override it
    # (model: {preset: tiny, kv_heads: 2}, tests/test_gqa.py). Overrides are not an axis of their own.
    path.write_text("name: knobs\nworld_size: 2\nlauncher: local\n"
                    "grid: {model: [tiny, tiny-gqa], backend: [native, deepspeed], dp: auto, "
                    "recompute: [none, selective], compile: [false, true], dtype: [fp32, fp16-mixed]}\n")
    out = expand(load_sweep(path))
    runs = out.runs
    assert {c.model_config.num_kv_heads for c in runs} == {4, 2}
    assert {(c.recompute, c.compile, c.dtype) for c in runs if c.backend == "native"} == {
        (r, c, "fp32") for r in ("none", "selective") for c in (False, True)}
    assert not any(c.compile for c in runs if c.backend == "deepspeed")
    reasons = {row["error"] for row in out.skipped}
    assert any(r.startswith("backend deepspeed: compile is not supported") for r in reasons)
    assert any("dtype fp16-mixed is not supported on cpu" in r for r in reasons)
    assert all(row["status"] == "skipped" for row in out.skipped)
    for c in runs:  # every knob is a column of the row
        row = c.to_row()
        assert {"recompute", "compile", "dtype", "model_overrides"} <= set(row)


def test_labels_show_the_knobs():
    from bench.report.labels import config_label
    cfg = RunConfig(model="tiny", model_overrides=("kv_heads=2",), recompute="selective", compile=True,
                    dtype="bf16-mixed", dp=2)
    label = config_label(cfg.to_row())
    for part in ("rc-selective", "compiled", "bf16-mixed", "kv_heads=2"):
        assert part in label, label
    assert config_label(RunConfig(dp=2).to_row()) == "native tp1·pp1·dp2"


def test_defaults_keep_run_ids():
    # `compile` is off by default and a default is left out of the canonical form: old run ids stay.
    assert "compile" not in RunConfig().canonical()
    assert RunConfig(compile=True).run_id != RunConfig().run_id
