"""Native 3D engine: validation, and parity + communication on real gloo processes (its schedules:
tests/test_schedule.py).

Parity: every layout reproduces the single-process reference — loss after 3 steps within 1e-5
relative; step-1 gradients of every parameter (reassembled from shards; not under ZeRO-1, whose
reduced gradients are the optimizer's shards) and, for every layout ZeRO-1 included, the gradient one
plain-SGD step applied (tests/support/parity.py), both under assert_close(rtol=1e-4, atol=1e-6) — and its
counted communication equals `expected_comm`.
"""
from __future__ import annotations

import itertools
import math

import pytest

from bench.config import ConfigError, RunConfig
from bench.schedule import partition
from bench.spawn import RankPool
from support.parity import gradient_mismatches, reference, run_layouts

# --- the communication formulas (per rank per optimizer step, payload bytes; fp32) -------------------


def _local_params(m, tp: int, n_layers: int, first: bool, last: bool) -> tuple[int, int]:
    """(parameters on a rank, of which replicated ones acting on the sequence-sharded stream)."""
    h, f, V = m.hidden, m.ffn_hidden, m.vocab
    up = 2 * f if m.activation == "swiglu" else f
    norm = h * (2 if m.norm == "layernorm" else 1)
    qkv = m.qkv_out  # 3h, or h + 2·kv_heads·head_dim with grouped-query attention
    sharded = (qkv * h + h * h + up * h + f * h) // tp + ((qkv + up) // tp if m.bias else 0)
    replicated = 2 * norm + (2 * h if m.bias else 0)
    n, n_sp = n_layers * (sharded + replicated), n_layers * replicated
    pos = m.seq_len * h if m.position == "learned" else 0
    if first:
        n, n_sp = n + V // tp * h + pos, n_sp + pos
    if last:
        n, n_sp = n + norm + (0 if m.tie_embeddings else V // tp * h), n_sp + norm
    return n, n_sp


def expected_comm(cfg: RunConfig) -> dict[str, float]:
    """comm_bytes_/comm_ops_ per dim, averaged over ranks (tp and dp ranks of a stage are alike).

    TP, per micro-batch, X = b·s·h·4: 4 all-reduces of X per layer (2 forward, 2 backward); the
    embedding 1 forward, the head input 1 backward; cross-entropy 3 all-reduces of b·s·4.
    With SP each all-reduce becomes an all-gather plus a reduce-scatter (X each; the embedding and
    head get their conjugate too) and the SP parameters' grads are all-reduced once per step.
    PP: X (÷tp with SP) sent per micro-batch per stage boundary each way; a recv is an op of 0 bytes.
    DP: one bucket here (bucket_mb default): all-reduce 4·N; ZeRO-1 reduce-scatter + all-gather of
    4·dp·⌈N/dp⌉; SP parameters form their own bucket."""
    m, p, v, tp, dp = cfg.model_config, cfg.pp, cfg.virtual_stages, cfg.tp, cfg.dp
    M, b, s, sp = cfg.micro_batches, cfg.micro_batch, cfg.seq, cfg.sequence_parallel
    X = b * s * m.hidden * 4
    parts, last_sid = partition(m.layers, p * v), p * v - 1
    out = {f"comm_{k}_{d}": 0.0 for k in ("bytes", "ops") for d in ("tp", "pp", "dp")}

    def add(dim, nbytes, ops):
        out[f"comm_bytes_{dim}"] += nbytes / p
        out[f"comm_ops_{dim}"] += ops / p

    for r in range(p):
        sids = [j * p + r for j in range(v)]
        layers = sum(len(parts[i]) for i in sids)
        first, last = 0 in sids, last_sid in sids
        n, n_sp = _local_params(m, tp, layers, first, last)
        if tp > 1:
            per = 2 if sp else 1  # collectives per all-reduce-equivalent
            add("tp", 4 * per * layers * M * X, 4 * per * layers * M)
            add("tp", per * M * X * (first + last) + 3 * M * b * s * 4 * last, per * M * (first + last) + 3 * M * last)
            if sp:
                add("tp", 4 * n_sp, 1)
        boundaries = sum((i < last_sid) + (i > 0) for i in sids)
        add("pp", boundaries * M * X // (tp if sp else 1), 2 * boundaries * M)
        if dp > 1:
            buckets = [x for x in ([n - n_sp, n_sp] if sp else [n]) if x]
            if cfg.zero:
                padded = sum(4 * dp * math.ceil(x / dp) for x in buckets)
                add("dp", 2 * padded, 2 * len(buckets))
            else:
                add("dp", 4 * n, len(buckets))
    return out


# --- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    (dict(tp=3), ["heads", "tp (3)"]),
    (dict(model="tiny-gqa", tp=4), ["kv_heads (2)", "tp (4)"]),
    (dict(model="tiny", model_overrides=("kv_heads=3",)), ["kv_heads (3)", "divide model.heads (4)"]),
    (dict(pp=8), ["layers (4)", "pp (8)"]),
    (dict(pp=2, schedule="interleaved", micro_batches=3), ["micro_batches (3)", "pp (2)"]),
    (dict(pp=2, schedule="interleaved", virtual_stages=4), ["layers (4)", "virtual_stages"]),
    (dict(virtual_stages=2, schedule="interleaved"), ["virtual_stages", "pp > 1"]),
    (dict(dtype="fp16-mixed", device="cpu"), ["dtype fp16-mixed", "cpu"]),
    (dict(zero=2), ["zero"]),
])
def test_impossible_layouts_fail_in_validation(kwargs, words):
    with pytest.raises(ConfigError) as err:
        RunConfig(backend="native", **kwargs)
    for word in words:
        assert word in str(err.value)


# --- parity and communication on real processes ----------------------------------------------------

_REFERENCES: dict = {}


def _reference(cfg: RunConfig) -> dict:
    key = (cfg.model, cfg.model_overrides, cfg.seed, cfg.global_batch, cfg.seq)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(cfg)
    return _REFERENCES[key]


def check_parity(pool, cfgs: list[RunConfig]) -> None:
    failures = []
    for cfg, got in zip(cfgs, run_layouts(pool, cfgs)):
        ref, name = _reference(cfg), _name(cfg)
        if not math.isclose(got["losses"][-1], ref["losses"][-1], rel_tol=1e-5):
            failures.append(f"{name}: loss {got['losses']} vs reference {ref['losses']}")
        if not cfg.zero:  # ZeRO-1's reduced gradients are shards of the optimizer: the applied update shows them
            failures += gradient_mismatches(name, got["grads"], ref["grads"])
        failures += gradient_mismatches(name + " (applied by SGD)", got["applied"], ref["grads"])
        if cfg.bucket_mb == RunConfig.bucket_mb:
            for key, value in expected_comm(cfg).items():
                if not math.isclose(got["comm"].get(key, 0.0), value, rel_tol=1e-12, abs_tol=1e-9):
                    failures.append(f"{name}: {key} = {got['comm'].get(key, 0.0)}, formula {value}")
    assert not failures, "\n".join(failures)


def _name(cfg: RunConfig) -> str:
    return (f"tp{cfg.tp}pp{cfg.pp}dp{cfg.dp} {cfg.schedule} v{cfg.virtual_stages} m{cfg.micro_batches} "
            f"sp={cfg.sequence_parallel} zero={cfg.zero} {cfg.order} {cfg.model_overrides}")


EIGHT = ("layers=8",)


def test_parity_world2(pools):
    check_parity(pools(2), [
        RunConfig(tp=2, micro_batches=1, sequence_parallel=True, order="tp-dp-pp"),
        RunConfig(pp=2, micro_batches=2, schedule="gpipe"),
        RunConfig(dp=2, micro_batches=2, zero=1),
    ])


def test_parity_world4(pools):
    check_parity(pools(4), [
        RunConfig(tp=4, micro_batches=2),
        RunConfig(pp=4, micro_batches=4, schedule="gpipe"),
        RunConfig(pp=4, micro_batches=8, schedule="1f1b"),
        RunConfig(pp=4, micro_batches=4, schedule="interleaved", virtual_stages=2, model_overrides=EIGHT),
        RunConfig(tp=2, pp=2, micro_batches=4, sequence_parallel=True, order="tp-dp-pp"),
        RunConfig(pp=2, dp=2, micro_batches=2, schedule="interleaved", virtual_stages=2, zero=1),
    ])


def test_parity_grouped_query_attention_world2(pools):
    # tiny-gqa: 4 query heads sharing 2 K/V heads (tp 2: one whole group per rank); tiny-llama adds
    # rotary positions, RMSNorm and SwiGLU to the same grouping, with biases off.
    gqa = dict(model="tiny-gqa")
    check_parity(pools(2), [
        RunConfig(**gqa, tp=2, micro_batches=1),
        RunConfig(**gqa, tp=2, micro_batches=2, sequence_parallel=True, model_overrides=("bias=true",)),
        RunConfig(**gqa, pp=2, micro_batches=2, schedule="1f1b"),
        RunConfig(**gqa, dp=2, micro_batches=2),
        RunConfig(model="tiny-llama", tp=2, micro_batches=1),
    ])


def test_parity_2x2x2():
    with RankPool(8) as pool:  # not kept warm: eight idle ranks would hold memory for the whole session
        check_parity(pool, [RunConfig(tp=2, pp=2, dp=2, micro_batches=4, schedule="1f1b")])


# --- the full grid (slow) -----------------------------------------------------------------------------


def grid() -> dict[int, list[RunConfig]]:
    """tp, pp, dp ∈ {1, 2, 4} with world ≤ 8; every schedule; micro-batches 1, pp, 2·pp; SP on and off;
    the rank order alternating so both orders meet every kind of layout."""
    by_world: dict[int, list[RunConfig]] = {}
    index = 0
    for tp, pp, dp in itertools.product((1, 2, 4), repeat=3):
        if tp * pp * dp > 8:
            continue
        for schedule in ("gpipe", "1f1b", "interleaved") if pp > 1 else ("1f1b",):
            for m in sorted({1, pp, 2 * pp}):
                if schedule == "interleaved" and m % pp:
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    extra = dict(virtual_stages=2, model_overrides=EIGHT) if schedule == "interleaved" else {}
                    order = ("tp-pp-dp", "tp-dp-pp")[index % 2]
                    index += 1
                    by_world.setdefault(tp * pp * dp, []).append(RunConfig(
                        tp=tp, pp=pp, dp=dp, schedule=schedule, micro_batches=m, sequence_parallel=sp,
                        order=order, zero=int(index % 3 == 0 and dp > 1), **extra))
    return by_world


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_parity_full_grid(world):
    with RankPool(world) as pool:
        check_parity(pool, grid()[world])


def test_worker_row_has_native_extras_and_reference_loss(pools):
    one = pools(1).run(RunConfig(micro_batches=2, steps=3, warmup=1))
    two = pools(2).run(RunConfig(pp=2, micro_batches=2, steps=3, warmup=1, schedule="gpipe"))
    assert one["status"] == two["status"] == "ok", (one.get("error"), two.get("error"))
    assert math.isclose(one["loss_last"], two["loss_last"], rel_tol=1e-5)
    assert two["stage_layers"] == "[[0,1],[2,3]]" and two["tp_impl"] == "native"
    assert 0 < two["bubble_fraction"] < 1
    expected = expected_comm(RunConfig(pp=2, micro_batches=2, schedule="gpipe"))
    assert two["comm_bytes_pp"] == expected["comm_bytes_pp"] and two["comm_ops_pp"] == expected["comm_ops_pp"]



def test_bucket_copies_the_first_gradient_adds_the_rest_and_zeroes_unused_ones():
    """No zeroing pass: the step's first gradient is copied in, later ones added; a parameter backward
    never reached this step reads zero, not the previous step's gradient."""
    import torch
    import torch.nn as nn

    from bench.native.bucket import Bucket
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    bucket = Bucket([used, unused], None, dp=1, dp_rank=0, zero=0)
    bucket.grads.fill_(7.0)  # the previous step's gradients
    bucket.start_step()
    passes = []

    def on_grad(p):  # as DataParallel._on_grad
        passes.append(p)
        bucket.take_grad(p, first=len(passes) == 1)
    used.register_post_accumulate_grad_hook(on_grad)
    (2 * used).sum().backward()  # micro-batch 1: copied in
    (3 * used).sum().backward()  # micro-batch 2: added
    bucket.zero_untouched()
    bucket.expose_grads()
    assert used.grad.tolist() == [5.0, 5.0, 5.0] and unused.grad.tolist() == [0.0, 0.0]
