"""The MoE block of the one model: exact counts (total and active), routing against a per-token reference,
capacity dropping per sequence, the load-balancing loss and its gradient, tp slices of the stacked experts."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.surgery import fill_from_init, split_dim
from models import build_model, get_preset, init_value
from models.config import (block_params, count_active_params, count_params, flops_per_token, matmul_params,
                           param_table)
from models.gpt import MoE, aux_loss_scale, loss_with_aux, moe_modules, set_aux_loss_scale

TINY_MOE = get_preset("tiny-moe")


# --- counts ---------------------------------------------------------------------------------------------
def test_tiny_moe_counts_by_hand_and_by_the_module():
    h, v = 64, 256
    attn = h * (4 + 2 * 2) * 16 + h * h + 2 * h  # qkv (GQA: 8 heads' worth of rows), proj, two RMSNorms
    expert = 2 * 64 * h + h * 64  # SwiGLU fc1 (gate and up) and fc2, width 64
    dense = attn + 2 * 128 * h + h * 128
    moe = attn + 4 * h + 4 * expert  # router + 4 experts
    total = v * h + dense + 3 * moe + h + v * h  # embedding, block 0 dense, blocks 1-3 MoE, norm, head
    assert count_params(TINY_MOE) == total == 255_296
    assert sum(p.numel() for p in build_model(TINY_MOE, 0).parameters()) == total
    assert count_active_params(TINY_MOE) == total - 3 * 2 * expert == 181_568  # 2 of 4 experts idle per block
    assert (block_params(TINY_MOE, 0), block_params(TINY_MOE, 1), block_params(TINY_MOE)) == (dense, moe, moe)
    assert matmul_params(TINY_MOE) == (dense - 2 * h) + 3 * (moe - 2 * h - 2 * expert) + v * h


def test_published_mixtral_counts():
    # Jiang et al. 2024 (Mixtral of Experts) / Mistral's release: 46.7B total, 12.9B active.
    m7 = get_preset("mixtral-8x7b")
    assert (round(count_params(m7) / 1e9, 1), round(count_active_params(m7) / 1e9, 1)) == (46.7, 12.9)
    # Mistral's Mixtral 8x22B release: 141B total, 39B active.
    m22 = get_preset("mixtral-8x22b")
    assert (round(count_params(m22) / 1e9), round(count_active_params(m22) / 1e9)) == (141, 39)
    # FLOPs count the active matmul weights: attention, router and 2 of 8 experts per block, the head.
    h, l = m7.hidden, m7.layers
    block = h * (h + 2 * 1024) + h * h + 8 * h + 2 * 3 * h * 14336
    assert matmul_params(m7) == l * block + m7.vocab * h
    assert flops_per_token(m7) == 6 * matmul_params(m7) + 12 * l * h * m7.seq_len


def test_small_moe_has_smalls_flops_plus_the_router_and_four_times_its_mlp():
    small, moe = get_preset("small"), get_preset("small-moe")
    assert matmul_params(moe) == matmul_params(small) + moe.layers * moe.experts * moe.hidden
    mlp = 2 * small.hidden * small.ffn_hidden
    assert count_params(moe) - count_params(small) == moe.layers * (4 * mlp - mlp + moe.experts * moe.hidden)
    assert count_params(moe) == sum(p.numel() for p in build_model(moe, 0).parameters())


def test_a_dense_config_is_its_own_active_count_and_has_no_moe_block():
    tiny = get_preset("tiny")
    assert count_active_params(tiny) == count_params(tiny) and not tiny.is_moe and tiny.moe_layers == 0
    assert tiny.with_overrides(experts=0, moe_top_k=5) == tiny.with_overrides(moe_top_k=5)  # MoE fields idle
    assert not moe_modules(build_model(tiny, 0))


@pytest.mark.parametrize("override, message", [
    ({"moe_top_k": 5}, r"model.moe_top_k \(5\) must be between 1 and model.experts \(4\)"),
    ({"moe_capacity_factor": 0.0}, r"model.moe_capacity_factor must be > 0"),
    ({"dense_layers": 5}, r"model.dense_layers \(5\) must be ≤ model.layers \(4\)"),
    ({"moe_router": "topk"}, r"model.moe_router is 'topk'; choose one of softmax, sigmoid"),
    ({"experts": -1}, r"model.experts must be ≥ 0"),
])
def test_bad_moe_fields_are_refused_with_one_line_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        TINY_MOE.with_overrides(**override)


# --- the parameter table and tp slices of stacked experts ------------------------------------------------
def test_expert_weights_are_stacks_split_per_expert_over_tp_and_whole_experts_over_ep():
    specs = {s.name: s for s in param_table(TINY_MOE.with_overrides(shared_experts=2))}
    fc1, fc2 = specs["blocks.1.mlp.experts.fc1"], specs["blocks.1.mlp.experts.fc2"]
    assert (fc1.shape, fc1.local_shape(2), fc1.ep) == ((4, 128, 64), (4, 64, 64), "expert")
    assert (fc2.shape, fc2.local_shape(2), fc2.ep) == ((4, 64, 64), (4, 64, 32), "expert")
    assert specs["blocks.1.mlp.router.weight"].local_shape(2) == (4, 64)
    assert specs["blocks.1.mlp.shared.fc1.weight"].local_shape(2) == (128, 64)
    assert {s.ep for n, s in specs.items() if ".experts." not in n} == {"dense"}
    assert "blocks.0.mlp.fc1.weight" in specs and "blocks.0.mlp.router.weight" not in specs  # block 0 dense


@pytest.mark.parametrize("tp, rank", [(2, 1), (4, 2)])
def test_materialize_cuts_each_expert_as_the_dense_mlp_is_cut(tp, rank):
    cfg, seed = TINY_MOE.with_overrides(shared_experts=2), 7
    full = dict(build_model(cfg, seed).named_parameters())
    names = ["blocks.2.mlp.experts.fc1", "blocks.2.mlp.experts.fc2", "blocks.2.mlp.router.weight",
             "blocks.2.mlp.shared.fc1.weight", "blocks.2.mlp.shared.fc2.weight"]
    local = {s.name: s.local_shape(tp) for s in param_table(cfg) if s.name in names}
    for name in names:  # a module holding just this parameter, under its full name's prefix
        prefix, leaf = name.rsplit(".", 1)
        piece = nn.Module()
        piece.register_parameter(leaf, nn.Parameter(torch.empty(local[name])))
        fill_from_init(piece, cfg, seed, prefix=prefix + ".", tp_rank=rank, tp=tp)
        dim, got = split_dim(name), getattr(piece, leaf)
        want = full[name] if dim is None else full[name].narrow(dim, rank * got.shape[dim], got.shape[dim])
        assert torch.equal(got, want), name
    assert (split_dim(names[0]), split_dim(names[1])) == (1, 2)


def test_expert_init_follows_the_mlp_convention():
    cfg = TINY_MOE
    fc1 = init_value("blocks.1.mlp.experts.fc1", (4, 128, 64), cfg, 0)
    fc2 = init_value("blocks.1.mlp.experts.fc2", (4, 64, 64), cfg, 0)
    assert fc1.std().item() == pytest.approx(0.02, rel=0.05)
    assert fc2.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.layers), rel=0.05)


# --- routing --------------------------------------------------------------------------------------------
def moe_layer(cfg, seed=0) -> MoE:
    """The MoE of block 1 of a float64 model built from the reference weights."""
    return build_model(cfg, seed).double().blocks[1].mlp


def expert_out(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    h = x @ moe.experts.fc1[e].t()
    if moe.cfg.activation == "swiglu":
        gate, up = h.view(-1, 2).unbind(-1)
        return (F.silu(gate) * up) @ moe.experts.fc2[e].t()
    return F.gelu(h, approximate="tanh") @ moe.experts.fc2[e].t()


def naive(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, int]:
    """Token by token, slot by slot, in position order: the MoE output and the dropped assignments."""
    cfg, out, dropped = moe.cfg, torch.zeros_like(x), 0
    for b in range(x.shape[0]):
        taken = [0] * cfg.experts
        for t in range(x.shape[1]):
            logits = x[b, t] @ moe.router.weight.t()
            probs = logits.sigmoid() if cfg.moe_router == "sigmoid" else logits.softmax(-1)
            top = sorted(range(cfg.experts), key=lambda e: -probs[e].item())[:cfg.moe_top_k]
            total = sum(probs[e] for e in top)
            for e in top:
                if capacity is not None and taken[e] >= capacity:
                    dropped += 1
                    continue
                taken[e] += 1
                out[b, t] += probs[e] / total * expert_out(moe, e, x[b, t])
            if moe.shared is not None:
                out[b, t] += moe.shared(x[b, t])
    return out, dropped


VARIANTS = {
    "swiglu-softmax": TINY_MOE,
    "swiglu-sigmoid-shared": TINY_MOE.with_overrides(moe_router="sigmoid", shared_experts=2),
    "gelu-top1-bias-shared": get_preset("tiny").with_overrides(experts=4, moe_top_k=1, shared_experts=1, bias=True),
    "top3-of-5": TINY_MOE.with_overrides(experts=5, moe_top_k=3),
}


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_routing_is_the_per_token_reference_and_deterministic(cfg):
    moe = moe_layer(cfg)
    x = torch.randn(2, 16, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    want, _ = naive(moe, x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(out, moe(x))
    counts = moe.last_tokens_per_expert
    assert counts.dtype == torch.int64 and counts.device.type == "cpu" and counts.shape == (cfg.experts,)
    assert counts.sum().item() == 2 * 16 * cfg.moe_top_k and moe.last_dropped == 0


def test_capacity_drops_exactly_the_assignments_beyond_c_in_position_order_per_sequence():
    cfg = TINY_MOE.with_overrides(moe_capacity_factor=0.5)
    moe = moe_layer(cfg)
    S = 16
    capacity = cfg.expert_capacity(S)
    assert capacity == math.ceil(2 * S / 4 * 0.5) == 4
    x = torch.randn(3, S, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = moe(x)
    want, dropped = naive(moe, x, capacity)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert moe.last_dropped == dropped > 0 and moe.last_tokens_per_expert.sum().item() == 3 * S * 2 - dropped
    assert moe.last_tokens_per_expert.max().item() <= 3 * capacity
    # per sequence: a sequence drops the same assignments alone as in a batch (micro-batching never changes it)
    torch.testing.assert_close(moe(x[1:2]), out[1:2], rtol=0, atol=0)


# --- the load-balancing loss -------------------------------------------------------------------------------
def hand_aux(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    cfg = moe.cfg
    E, k, S = cfg.experts, cfg.moe_top_k, x.shape[1]
    per_seq = []
    for b in range(x.shape[0]):
        probs = (x[b] @ moe.router.weight.t()).softmax(-1)  # (S, E)
        top = probs.topk(k, dim=-1).indices
        f = torch.stack([(top == e).sum() for e in range(E)]).double() / (S * k)
        per_seq.append(E * (f * probs.mean(0)).sum())
    return cfg.moe_aux_loss_coeff * torch.stack(per_seq).mean()


def test_aux_loss_is_the_hand_formula_and_its_gradient_reaches_only_the_router():
    cfg = TINY_MOE.with_overrides(moe_aux_loss_coeff=0.1, shared_experts=1)
    moe = moe_layer(cfg)
    x = torch.randn(2, 16, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = moe(x)
    want = hand_aux(moe, x)
    torch.testing.assert_close(moe.last_aux_loss, want, rtol=1e-12, atol=0)
    assert not moe.last_aux_loss.requires_grad
    out.backward(torch.zeros_like(out))  # no gradient from the output: only the aux term's
    assert moe.experts.fc1.grad.abs().max() == 0 and moe.experts.fc2.grad.abs().max() == 0
    assert all(p.grad.abs().max() == 0 for p in moe.shared.parameters())
    router_grad, = torch.autograd.grad(want, moe.router.weight)
    torch.testing.assert_close(moe.router.weight.grad, router_grad, rtol=1e-10, atol=0)
    assert router_grad.abs().max() > 0


def test_the_aux_gradient_takes_the_engines_loss_scale():
    moe = moe_layer(TINY_MOE)
    x = torch.randn(1, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = []
    for scale in (1.0, 0.25):
        assert aux_loss_scale() == 1.0
        set_aux_loss_scale(scale)
        try:
            moe.router.weight.grad = None
            out = moe(x)
            out.backward(torch.zeros_like(out))
            grads.append(moe.router.weight.grad.clone())
        finally:
            set_aux_loss_scale(1.0)
    torch.testing.assert_close(grads[1], 0.25 * grads[0], rtol=1e-12, atol=0)


def test_loss_with_aux_gradient_matches_finite_differences():
    cfg = TINY_MOE.with_overrides(moe_aux_loss_coeff=0.5, shared_experts=1)
    model = build_model(cfg, 5).double()
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(6))
    targets = torch.roll(idx, -1, 1)
    loss_with_aux(model, model(idx), targets).backward()
    params = dict(model.named_parameters())

    def loss_at(name, i, delta):
        with torch.no_grad():
            params[name].view(-1)[i] += delta
            value = loss_with_aux(model, model(idx), targets).item()
            params[name].view(-1)[i] -= delta
        return value

    eps, gen = 1e-5, torch.Generator().manual_seed(7)
    for name in ("blocks.1.mlp.router.weight", "blocks.2.mlp.experts.fc1", "blocks.3.mlp.experts.fc2",
                 "blocks.2.mlp.shared.fc1.weight", "blocks.1.attn.qkv.weight", "embed.tok.weight"):
        for i in torch.randint(0, params[name].numel(), (4,), generator=gen).tolist():
            fd = (loss_at(name, i, eps) - loss_at(name, i, -eps)) / (2 * eps)
            assert params[name].grad.view(-1)[i].item() == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, i)
    # the aux term matters here: without it the router's gradient differs well beyond the tolerance
    with_aux = params["blocks.1.mlp.router.weight"].grad.clone()
    set_aux_loss_scale(0.0)
    try:
        model.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, cfg.vocab), targets.reshape(-1)).backward()
    finally:
        set_aux_loss_scale(1.0)
    assert (with_aux - params["blocks.1.mlp.router.weight"].grad).abs().max() > 1e-4
