"""Context parallelism's ring attention and global positions against the single-process model.

Every multi-rank check runs in one world-4 pool, on cp groups made inside it: cp 2 on ranks {0, 1} and
{2, 3} (the second's global ranks differ from its group ranks), cp 3 on {1, 2, 3}, cp 4 on all. Each
rank returns its shards; the reference is computed here, in this process.
"""
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.context_parallel import set_positions
from bench.data import shard_sequence, zigzag_positions
from models import build_model, get_preset, loss_fn

WORLD = 4
CP_GROUPS = {2: [[0, 1], [2, 3]], 3: [[1, 2, 3]], 4: [[0, 1, 2, 3]]}
SEQ, BATCH, HEADS, HEAD_DIM = 24, 2, 4, 8  # 24 tokens: 2·cp chunks at cp 2, 3 and 4
ATTENTION_CASES = [(cp, nkv, dtype) for cp in (2, 3, 4) for nkv, dtype in
                   ((4, torch.float64), (2, torch.float64), (1, torch.float64), (2, torch.bfloat16))]
MODEL_CASES = [(cp, preset, "ring") for preset in ("tiny", "tiny-llama") for cp in (2, 4)] + [
    (2, "tiny-llama", "recompute-then-ring"), (4, "tiny", "ring-then-recompute")]
MODEL_BATCH = 2


# --- what every rank runs -------------------------------------------------------------------------------
def attention_inputs(nkv: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and the output's gradient of the whole sequence (the same on every rank and here)."""
    gen = torch.Generator().manual_seed(nkv)
    return [torch.randn(BATCH, n, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
            for n in (HEADS, nkv, nkv, HEADS)]


def model_inputs(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab, (MODEL_BATCH, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _counted(counter) -> dict:
    return {kind: (s.ops, s.bytes) for (_, kind), s in counter.stats.items()}


def _ring_attention_case(group, cp: int, nkv: int, dtype) -> dict:
    import torch.distributed as dist
    from bench.context_parallel import ring_attention
    from bench.metrics.comm import CommCounter
    rank = dist.get_rank(group)
    q, k, v, dy = (shard_sequence(t, rank, cp, dim=2) for t in attention_inputs(nkv, dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with CommCounter(dim_of=lambda ranks: "cp") as forward:
        out = ring_attention(q, k, v, group)
    with CommCounter(dim_of=lambda ranks: "cp") as backward:
        out.backward(dy)
    assert out.dtype == dtype and q.grad.dtype == dtype and k.grad.shape == k.shape
    return {"out": _numpy(out), "dq": _numpy(q.grad), "dk": _numpy(k.grad), "dv": _numpy(v.grad),
            "forward": _counted(forward), "backward": _counted(backward)}


def _model_case(group, cp: int, preset: str, order: str) -> dict:
    import torch.distributed as dist
    from bench.context_parallel import use_ring_attention
    from bench.metrics.comm import CommCounter
    from bench.surgery import apply_recompute
    from tests.support.device_audit import ImplicitDeviceAudit
    rank, cfg = dist.get_rank(group), get_preset(preset)
    model = build_model(cfg, seed=0)
    steps = {"ring": [lambda: use_ring_attention(model, group)],
             "recompute-then-ring": [lambda: apply_recompute(model, "selective"), lambda: use_ring_attention(model, group)],
             "ring-then-recompute": [lambda: use_ring_attention(model, group), lambda: apply_recompute(model, "selective")]}
    for step in steps[order]:
        step()
    set_positions(model, zigzag_positions(rank, cp, cfg.seq_len))
    tokens, targets = (shard_sequence(t, rank, cp) for t in model_inputs(cfg))
    with CommCounter(dim_of=lambda ranks: "cp") as counter, ImplicitDeviceAudit() as audit:
        logits = model(tokens)
        # this rank's share of the mean over every token of the batch: the cp ranks' gradients sum to it
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1), reduction="sum")
        (loss / targets.numel() / cp).backward()
    return {"logits": _numpy(logits), "grads": {n: _numpy(p.grad) for n, p in model.named_parameters()},
            "counted": _counted(counter), "implicit_devices": audit.found}


def _on_rank(cases: list, body) -> list:
    """`body(group, *case)` for every case (cp first) on this rank's group of that cp; None where it has none."""
    import torch.distributed as dist
    from bench.distributed import rank_session
    with rank_session("cpu"):
        rank = dist.get_rank()
        groups = {}
        for cp, members in CP_GROUPS.items():
            for ranks in members:  # every rank makes every group (torch's rule), joins its own
                made = dist.new_group(ranks)
                if rank in ranks:
                    groups[cp] = made
        return [body(groups[case[0]], *case) if case[0] in groups else None for case in cases]


def _attention_on_rank(cases):
    return _on_rank(cases, _ring_attention_case)


def _models_on_rank(cases):
    return _on_rank(cases, _model_case)


def _tp_cp_on_rank(cp: int) -> dict:
    """tiny-llama under the native engine's tensor parallel (tp 2: each core sees 2 query heads and 1 K/V
    head) and cp 2, ranks laid out tp-cp (tp groups {0, 1} and {2, 3}, cp groups {0, 2} and {1, 3})."""
    import torch.distributed as dist
    from bench.config import RunConfig
    from bench.context_parallel import use_ring_attention
    from bench.distributed import rank_session
    from bench.native.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
    from bench.surgery import materialize, meta_module
    from models.gpt import GPT
    run_cfg = RunConfig(model="tiny-llama", tp=WORLD // cp, dp=cp)  # dp stands in for cp: the same world
    cfg, tp = run_cfg.model_config, run_cfg.tp
    with rank_session("cpu"):
        rank = dist.get_rank()
        tp_groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, WORLD, tp)]
        cp_groups = [dist.new_group(list(range(offset, WORLD, tp))) for offset in range(tp)]
        tp_rank, cp_rank = rank % tp, rank // tp
        model = meta_module(lambda: GPT(cfg))
        apply_tensor_parallel(model, run_cfg, tp_groups[rank // tp], tp_rank, tp)
        materialize(model, cfg, 0, "cpu", tp_rank=tp_rank, tp=tp)
        use_ring_attention(model, cp_groups[tp_rank])
        set_positions(model, zigzag_positions(cp_rank, cp, cfg.seq_len))
        tokens, targets = (shard_sequence(t, cp_rank, cp) for t in model_inputs(cfg))
        loss = vocab_parallel_cross_entropy(model(tokens), targets, tp_groups[rank // tp])
        (loss / cp).backward()  # each cp rank holds an equal share of the tokens
        return {"tp_rank": tp_rank, "cp_rank": cp_rank,
                "grads": {n: _numpy(p.grad) for n, p in model.named_parameters()}}


# --- the checks -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attention_results(pools):
    return pools(WORLD).call(_attention_on_rank, ATTENTION_CASES)


@pytest.fixture(scope="module")
def model_results(pools):
    return pools(WORLD).call(_models_on_rank, MODEL_CASES)


def _reference_attention(nkv: int, dtype) -> dict:
    q, k, v, dy = (t.to(torch.float64).requires_grad_() for t in attention_inputs(nkv, dtype))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != HEADS)
    out.backward(dy)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _gathered(results: list, index: int, ranks: list[int], cp: int, key: str, dim: int) -> torch.Tensor:
    """The whole sequence of `key` from the shards of `ranks` (cp ranks 0 … cp − 1), in token order."""
    shards = [torch.from_numpy(results[r][index][key]) for r in ranks]
    whole = torch.empty_like(torch.cat(shards, dim))
    for cp_rank, shard in enumerate(shards):
        whole.index_copy_(dim, zigzag_positions(cp_rank, cp, whole.shape[dim]), shard)
    return whole


def _bf16_sdpa_error(nkv: int) -> dict:
    """Single-process bf16 SDPA's error against fp64: what the bf16 tolerance allows."""
    ref = _reference_attention(nkv, torch.bfloat16)
    q, k, v, dy = (t.requires_grad_() for t in attention_inputs(nkv, torch.bfloat16))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != HEADS)
    out.backward(dy)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {key: (got[key].double() - ref[key]).abs().max().item() for key in ref}


def test_ring_attention_equals_causal_sdpa_on_the_whole_sequence(attention_results):
    """fp64 to 1e-12 (MHA, GQA group 2 and 4) at cp 2, 3 and 4; bf16 no worse than torch's own bf16 SDPA
    (math in fp32, outputs in bf16) — twice its error, against the same fp64 reference."""
    for index, (cp, nkv, dtype) in enumerate(ATTENTION_CASES):
        ref = _reference_attention(nkv, dtype)
        allowed = {key: 1e-12 for key in ref} if dtype == torch.float64 else {
            key: 2 * err for key, err in _bf16_sdpa_error(nkv).items()}
        for ranks in CP_GROUPS[cp]:
            for key in ref:
                got = _gathered(attention_results, index, ranks, cp, key, dim=2)
                error = (got - ref[key]).abs().max().item()
                assert error <= allowed[key], f"cp {cp} nkv {nkv} {dtype} ranks {ranks} {key}: {error:.3g}"


def _expected_sends(cp: int, nkv: int, dtype, layers: int = 1, seq: int = SEQ, batch: int = BATCH,
                    head_dim: int = HEAD_DIM) -> tuple[dict, dict]:
    """The module's send pattern: forward cp − 1 sends of [K, V]; backward cp − 1 of [K, V] and of
    [dK, dV] (fp32, fp64 for fp64), and one last [dK, dV]; a recv beside each send (0 bytes counted)."""
    kv = 2 * batch * (seq // cp) * nkv * head_dim
    beta, grad_beta = dtype.itemsize, max(dtype.itemsize, 4)
    forward = {"send": (layers * (cp - 1), layers * (cp - 1) * kv * beta), "recv": (layers * (cp - 1), 0)}
    backward = {"send": (layers * (2 * cp - 1), layers * ((cp - 1) * kv * beta + cp * kv * grad_beta)),
                "recv": (layers * (2 * cp - 1), 0)}
    return forward, backward


def test_the_ring_sends_exactly_the_documented_bytes_and_ops(attention_results):
    for index, (cp, nkv, dtype) in enumerate(ATTENTION_CASES):
        forward, backward = _expected_sends(cp, nkv, dtype)
        for ranks in CP_GROUPS[cp]:
            for r in ranks:
                got = attention_results[r][index]
                assert (got["forward"], got["backward"]) == (forward, backward), (cp, nkv, dtype, r)


@functools.cache
def _reference_model(preset: str) -> dict:
    cfg = get_preset(preset)
    model = build_model(cfg, seed=0)
    tokens, targets = model_inputs(cfg)
    logits = model(tokens)
    loss_fn(logits, targets).backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_a_whole_gpt_at_cp_equals_the_single_process_model(model_results):
    """tiny (learned positions, MHA) and tiny-llama (rope, GQA) at cp 2 and 4, also under selective
    recompute applied before or after the ring: each rank's logits at its global positions, and every
    parameter's gradient summed over the cp ranks, within 1e-5 of the model on the whole sequence. No
    tensor is made without naming its device (on a GPU it would land on the host)."""
    for index, (cp, preset, order) in enumerate(MODEL_CASES):
        ref = _reference_model(preset)
        for ranks in CP_GROUPS[cp]:
            assert all(model_results[r][index]["implicit_devices"] == [] for r in ranks), model_results[ranks[0]][index]["implicit_devices"]
            logits = _gathered(model_results, index, ranks, cp, "logits", dim=1)
            torch.testing.assert_close(logits, ref["logits"].double(), rtol=1e-5, atol=1e-6)
            for name, grad in ref["grads"].items():
                summed = sum(torch.from_numpy(model_results[r][index]["grads"][name]) for r in ranks)
                error = (summed - grad.double()).abs().max().item()
                assert error <= 1e-5 * grad.abs().max().item(), f"{preset} cp {cp} {order} {name}: {error:.3g}"


def test_the_model_sends_the_ring_pattern_per_layer(model_results):
    """fp32 GQA (tiny-llama, 2 K/V heads of 4) and MHA: layers × the pattern; selective recompute runs
    each layer's forward ring again in backward."""
    for index, (cp, preset, order) in enumerate(MODEL_CASES):
        cfg = get_preset(preset)
        forward, backward = _expected_sends(cp, cfg.num_kv_heads, torch.float32, cfg.layers, cfg.seq_len,
                                            MODEL_BATCH, cfg.head_dim)
        passes_forward = 1 if order == "ring" else 2
        expected = {kind: tuple(passes_forward * f + b for f, b in zip(forward[kind], backward[kind]))
                    for kind in forward}
        for r in CP_GROUPS[cp][0]:
            assert model_results[r][index]["counted"] == expected, (preset, cp, order, r)


# --- no processes ---------------------------------------------------------------------------------------
def test_zigzag_positions_give_each_rank_chunks_r_and_its_mirror():
    assert zigzag_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_positions(r, 3, 24) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    x = torch.arange(2 * 12).view(2, 12)
    assert shard_sequence(x, 1, 3).tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        shard_sequence(torch.zeros(1, 30), 0, 4)
    message = str(refused.value)
    assert "\n" not in message and "seq (30)" in message and "cp (4)" in message and "2 × cp = 8" in message


def test_positions_left_unset_or_set_to_0_to_T_change_nothing():
    """Global positions are plain attributes (no state_dict entry); arange(T) is bit-identical to unset."""
    for preset in ("tiny", "tiny-llama"):
        cfg = get_preset(preset)
        model = build_model(cfg, seed=0)
        tokens, _ = model_inputs(cfg)
        names = set(model.state_dict())
        plain = model(tokens)
        set_positions(model, torch.arange(cfg.seq_len))
        assert torch.equal(model(tokens), plain) and set(model.state_dict()) == names
        set_positions(model, torch.arange(cfg.seq_len).flip(0))  # positions really reach the model
        assert not torch.allclose(model(tokens), plain)


def test_ring_attention_composes_with_tensor_parallel(pools):
    """cp 2 × tp 2: every parameter's gradient, summed over cp, equals its tp slice of the reference's."""
    from bench.surgery import split_dim
    cp, tp = 2, WORLD // 2
    ref = _reference_model("tiny-llama")["grads"]
    results = pools(WORLD).call(_tp_cp_on_rank, cp)
    for tp_rank in range(tp):
        ranks = [r for r in results if r["tp_rank"] == tp_rank]
        assert sorted(r["cp_rank"] for r in ranks) == list(range(cp))
        for name, grad in ref.items():
            dim = split_dim(name)
            want = grad if dim is None else grad.chunk(tp, dim)[tp_rank]
            summed = sum(torch.from_numpy(r["grads"][name]) for r in ranks)
            error = (summed - want.double()).abs().max().item()
            assert error <= 1e-5 * grad.abs().max().item(), f"tp rank {tp_rank} {name}: {error:.3g}"
