"""The analytic cost model: memory, communication, bubble, FLOPs and (with a hardware profile) the
step time of one configuration. Pure maths over a RunConfig-like object (any object with the
RunConfig field names and `model_config`), so the planner can feed it lightweight candidates.

Step time, per device (every term documented where computed, in `predict_time`):
    compute = model FLOPs per device (+ recomputation) / (peak × compute_efficiency)
    tp      = every tp collective on the critical path, ring latency + wire bytes / link bandwidth
    pp      = one forward and one backward send per slot of the step's critical path: v·m + p − 1
              slots of a chunk's forward and backward in the simulated schedule
    bubble  = (compute + tp) × idle / busy time of the simulated schedule ((p−1)/(v·m), PTD-P §2.2)
    dp      = gradient/parameter traffic not hidden behind backward (the last micro-batch's
              backward for one reduction per step; the whole compute for per-micro-batch ZeRO-3/FSDP)
    step    = compute + tp + pp + bubble + exposed dp
The link of each group is NVLink when all its ranks share a node (`Layout`), else the network.
What each pipeline rank holds and runs is worked out once per config (`stage_plan`) and every
model reads it.
"""
from __future__ import annotations

from functools import lru_cache

from bench.analysis.comm import comm_summary
from bench.analysis.hardware import Hardware, get_hardware, profile_label
from bench.analysis.memory import ActivationModel, model_state_bytes, stage_memory
from bench.analysis.stage_plan import StagePlan, stage_plan
from bench.analysis.time_model import step_terms
from bench.capabilities import engine
from bench.layout import DIMS, Layout
from bench.results.schema import comm_columns
from models.config import flops_per_token, matmul_params


CANDIDATE_FIELDS = ("model", "tp", "cp", "cp_comm", "ep", "pp", "dp", "backend", "order", "zero", "fsdp", "schedule",
                    "virtual_stages", "micro_batch", "micro_batches", "seq", "dtype", "sequence_parallel", "recompute", "bucket_mb",
                    "model_overrides")
"""The RunConfig fields the cost model reads: what a planner candidate or a published run chooses (each
built with `RunConfig.unchecked`, the rest at their defaults)."""


def default_mixed_state(cfg) -> str:
    """How the backend keeps mixed-precision state (its Engine record): DeepSpeed as the ZeRO paper
    (2+2+12), the torch.autocast-based engines of this suite in fp32 (4+4+8)."""
    return engine(cfg).mixed_state


DEFAULT_ACTIVATIONS = "suite"
"""The activation model a prediction uses unless told: this suite's GPT, as its engines run it."""

ATTENTION_KERNELS = ("flash", "unfused")
DEFAULT_ATTENTION = "flash"
"""The attention kernel a prediction assumes unless told, for every backend and both activation models:
a fused flash / SDPA kernel (what every engine here runs, and every engine in use today); `unfused` is
Korthikanti et al.'s Megatron-LM (the scores materialised and saved), for that paper's table."""


def conventions(cfg, mixed_state: str | None = None, activations: str | None = None) -> tuple[str, str, str]:
    """(state convention, activation model, time-model implementation) of a prediction of `cfg`: the
    given ones, else the backend's own state and this suite's activations. The one default path of
    `bench estimate`, `bench plan` and the rows' `pred_*` columns (so a plan's figures for a config
    are its dry run's and its row's)."""
    acts = activations or DEFAULT_ACTIVATIONS
    return mixed_state or default_mixed_state(cfg), acts, time_impl(acts)


def time_impl(activations: str | None = None) -> str:
    """The time model's kernels that go with an activation model: this suite's, or Megatron's (Table 2)."""
    return "suite" if (activations or DEFAULT_ACTIVATIONS) == "suite" else "table2"


def extreme_stages(pp: int) -> list[int]:
    """The first stage holds the most activations and the embedding, the last the head: between
    them they hold every per-rank maximum (middle stages hold fewer layers' worth of both)."""
    return sorted({0, pp - 1})


def memory(plan: StagePlan, mixed_state: str | None = None, activations: str | None = None,
           attention: str | None = None) -> dict:
    """Per-rank bytes of the stage with the largest total, plus every planned stage's figures
    (conventions not given: `conventions`' defaults; the attention kernel: DEFAULT_ATTENTION)."""
    mixed_state, activations, _ = conventions(plan.cfg, mixed_state, activations)
    act = ActivationModel(activations, attention or DEFAULT_ATTENTION)
    per = {s: stage_memory(plan, s, mixed_state, act) for s in plan.ranks}
    worst = max(per, key=lambda s: per[s]["total_bytes"])
    return {**per[worst], "worst_stage": worst, "stages": [per[s] for s in sorted(per)]}


def model_flops_per_step(cfg) -> float:
    return float(flops_per_token(cfg.model_config, cfg.seq) * cfg.tokens_per_step)


def hardware_flops_per_step(cfg) -> float:
    """Model FLOPs plus what recomputation re-runs: one more forward of the layers (full) or of the
    attention scores QKᵀ and AV (selective: 4·L·h·s per token)."""
    m = cfg.model_config
    attn_fwd = 4 * m.layers * m.hidden * cfg.seq
    extra = {"none": 0, "selective": attn_fwd,
             "full": 2 * (matmul_params(m) - m.vocab * m.hidden) + attn_fwd}[cfg.recompute]
    return model_flops_per_step(cfg) + float(extra * cfg.tokens_per_step)


@lru_cache(maxsize=4096)
def crosses_nodes(tp: int, pp: int, dp: int, order: str, gpus_per_node: int, dim: str, cp: int = 1, ep: int = 1) -> bool:
    """Whether any `dim` group spans nodes (bench.layout's rank maths; cached for the planner's search)."""
    return Layout(tp=tp, cp=cp, pp=pp, dp=dp, order=order, gpus_per_node=gpus_per_node, ep=ep).any_group_crosses_node(dim)


def _spans_nodes(cfg, dim: str, gpus_per_node: int) -> bool:
    """Whether the group a `dim` collective runs over spans nodes: the dp traffic runs over dp × cp
    (the gradient's group), so it leaves a node where its dp or its cp part does."""
    return any(crosses_nodes(cfg.tp, cfg.pp, cfg.dp, cfg.order, gpus_per_node, d, cfg.cp, cfg.ep)
               for d in ((dim, "cp") if dim == "dp" else (dim,)))


def link(cfg, hw: Hardware, dim: str, gpus_per_node: int) -> tuple[float, float, str]:
    """(bandwidth a ring collective reaches, latency, name) of the links a `dim` group uses."""
    if _spans_nodes(cfg, dim, gpus_per_node):
        return hw.inter_node_bw * hw.inter_node_efficiency, hw.inter_node_latency_s, "network"
    return hw.intra_node_bw * hw.intra_node_efficiency, hw.intra_node_latency_s, "nvlink"


def predict_time(plan: StagePlan, hw: Hardware, mixed_state: str | None = None, impl: str | None = None,
                 attention: str | None = None) -> dict:
    """Step time over the planned stages, term by term (bench.analysis.time_model), with the keys this
    function always had (compute_s, bubble_s, exposed_comm_s, comm_{tp,pp,dp}_s, ...); conventions not
    given: `conventions`' defaults."""
    cfg, g = plan.cfg, plan.gpus_per_node or hw.gpus_per_node
    mixed_state, _, default_impl = conventions(cfg, mixed_state)
    impl = impl or default_impl
    links = {d: link(cfg, hw, d, g) for d in (*DIMS, "ep") if d not in ("cp", "ep") or getattr(cfg, d) > 1}  # cp, ep: where they are
    t = step_terms(plan, hw, {d: links[d][:2] for d in links}, impl, mixed_state, attention or DEFAULT_ATTENTION)
    step = t["step_time_s"]
    exposed = sum(t[f"comm_exposed_{d}_s"] for d in ("tp", "cp", "ep", "pp", "dp"))
    model_flops = model_flops_per_step(cfg)
    return {"hardware": hw.name, **t, "exposed_comm_s": exposed, "comm_tp_s": t["comm_exposed_tp_s"],
            "comm_cp_s": t["comm_exposed_cp_s"], "comm_pp_s": t["comm_exposed_pp_s"], "comm_dp_s": t["comm_dp_total_s"], "comm_dp_exposed_s": t["comm_exposed_dp_s"],
            "links": {d: links[d][2] for d in links}, "tokens_per_s": cfg.tokens_per_step / step,
            "mfu": model_flops / cfg.world / (step * hw.peak(cfg.dtype)),
            "calibrated": hw.calibration is not None, "profile": profile_label(hw)}


def estimate(cfg, hardware: str | Hardware | None = None, gpus_per_node: int | None = None,
             mixed_state: str | None = None, activations: str | None = None, attention: str | None = None) -> dict:
    """Everything the cost model predicts for one config (keys: see the module docstrings); the
    conventions not given are `conventions`' defaults, as the row's, and the attention kernel
    DEFAULT_ATTENTION."""
    state, activations, impl = conventions(cfg, mixed_state, activations)
    attention = attention or DEFAULT_ATTENTION
    hw = get_hardware(hardware) if hardware is not None else None
    plan = stage_plan(cfg, gpus_per_node or (hw.gpus_per_node if hw else None))
    out = {"mixed_state": state, "activations": activations, "attention": attention,
           **memory(plan, state, activations, attention),
           **comm_summary(plan, state), "bubble_fraction": plan.step.bubble_fraction,
           "flops_per_step": model_flops_per_step(cfg), "hardware_flops_per_step": hardware_flops_per_step(cfg),
           "tokens_per_step": cfg.tokens_per_step, "world_size": cfg.world}
    if hw is not None:
        out.update(predict_time(plan, hw, state, impl, attention))
        out["memory_limit_bytes"] = hw.memory_bytes
        out["fits"] = out["total_bytes"] <= hw.memory_bytes
    return out


def estimate_params(params: float, dp: int = 1, zero: int = 0, dtype: str = "bf16-mixed",
                    mixed_state: str | None = "zero") -> dict:
    """Model-state-only estimate for a bare parameter count (`bench estimate --params N`)."""
    return {"params": params, "dp": dp, "zero": zero, "dtype": dtype,
            **model_state_bytes(params, dp, zero, dtype, mixed_state or "zero")}


PRED_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "total_bytes",
             "bubble_fraction", "flops_per_step")


def predict_row(cfg, device_name: str | None = None, hardware: Hardware | None = None,
                gpus_per_node: int | None = None) -> dict:
    """`pred_*` columns for a measured row: the default conventions (`conventions`: the backend's own
    state, this suite's activations), and the step time on the profile of the device it ran on
    (`row_hardware`), or on `hardware` (a sweep pruning before anything ran). `gpus_per_node`: the ranks
    a node holds when the runs span nodes (None: one machine holds them all). Never raises: a row is
    worth more than its prediction (a failure is recorded in `pred_error`)."""
    try:
        return _predict_row(cfg, device_name, hardware, gpus_per_node)
    except Exception as e:  # noqa: BLE001
        return {"pred_error": f"{type(e).__name__}: {e}"}


def row_hardware(device_name: str | None, world: int = 1) -> Hardware | None:
    """The profile a row is predicted on: the one measured on this machine for that device (`bench
    calibrate`, or the sweep's own calibration: `measured_profile`), else the device's by name (a
    calibrated one of that name first, else the built-in: `cpu`, or the CUDA device's datasheet)."""
    from bench.analysis.hardware import measured_profile, profile_for_device
    from bench.environment import machine_identity
    device_name = device_name or "cpu"
    here = measured_profile(machine_identity(device_name), (world,))
    if here is not None:
        return here
    if device_name == "cpu":
        return get_hardware("cpu")
    base = profile_for_device(device_name)
    return get_hardware(base.name) if base else None


TIME_KEYS = ("step_time_s", "tokens_per_s", "mfu", "compute_s", "overhead_s", "comm_exposed_s", "comm_exposed_tp_s",
             "comm_exposed_cp_s", "comm_exposed_ep_s", "comm_exposed_pp_s", "comm_exposed_dp_s", "bubble_s", "optimizer_s")


def _predict_row(cfg, device_name: str | None = None, hardware: Hardware | None = None,
                 gpus_per_node: int | None = None) -> dict:
    est = estimate(cfg, gpus_per_node=gpus_per_node)  # the default conventions, as `bench estimate`'s
    out = {f"pred_{k}": est[k] for k in PRED_KEYS}
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "peak_mem_bytes"):
        out[f"pred_{k}"] = max(s[k] for s in est["stages"])  # max over ranks per column, as the measured row
    for name in comm_columns():
        out[f"pred_{name}"] = est[name]
    hw = hardware or row_hardware(device_name, cfg.world)
    if hw is not None:
        t = predict_time(stage_plan(cfg, gpus_per_node), hw)
        t["comm_exposed_s"] = t["exposed_comm_s"]
        out.update({f"pred_{k}": t[k] for k in TIME_KEYS})
        out.update(pred_hardware=hw.name, pred_profile=profile_label(hw))
    return out


def prediction_error(row: dict) -> dict:
    """How far the predicted step time and step peak memory are from the measured ones (pred / measured − 1)."""
    out = {}
    pred, measured = row.get("pred_step_time_s"), row.get("step_time_s")
    if pred and measured:
        err = pred / measured - 1
        out.update(pred_step_time_error=err, pred_step_time_abs_error=abs(err))
    pred, measured = row.get("pred_peak_mem_bytes"), row.get("peak_mem_bytes")
    if pred and measured:
        out["pred_peak_mem_error"] = pred / measured - 1
    return out


def with_predictions(cfg, row: dict, hardware: Hardware | None = None) -> dict:
    """A measured row with its pred_* columns and errors beside the measured ones, on `hardware` when given
    (`--hardware`), else on `row_hardware`'s. Added by whoever receives the row from the ranks (the rank
    pool, the debug launcher, a Slurm task), after the ranks have finished, so the cost model never runs
    inside a rank's measurement."""
    if row.get("status") != "ok":
        return row
    row = {**row, **predict_row(cfg, row.get("device_name"), hardware)}
    return {**row, **prediction_error(row)}
