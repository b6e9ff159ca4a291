"""Model surgery (bench.surgery), single process: stage cuts keep the full model's names, a shard
materialised from meta is the slice of the reference weights, recomputation leaves gradients alone."""
import torch

from bench.surgery import cut_stages, materialize, meta_module, recompute_blocks, split_dim
from models import GPT, build_model, get_preset, loss_fn

TINY = get_preset("tiny")  # 4 layers


def test_stages_hold_their_layers_under_the_full_models_names():
    gpt = meta_module(lambda: GPT(TINY))
    parts = [[0], [1, 2], [3]]
    first, middle, last = cut_stages(gpt, parts, [0, 1, 2])
    names = {n for n, _ in gpt.named_parameters()}
    for stage in (first, middle, last):
        assert {n for n, _ in stage.named_parameters()} <= names
    assert first.embed is not None and first.head is None and list(first.blocks) == ["0"]
    assert middle.embed is None and middle.head is None and list(middle.blocks) == ["1", "2"]
    assert last.head is not None and last.norm is not None and list(last.blocks) == ["3"]


def test_tensor_parallel_shard_from_meta_is_the_slice_of_the_reference():
    full = dict(build_model(TINY, 3).named_parameters())
    tp, rank = 2, 1
    model = meta_module(lambda: GPT(TINY))
    for name, p in list(model.named_parameters()):  # shrink each split parameter to its local shape
        dim = split_dim(name)
        if dim is not None:
            module_name, leaf = name.rsplit(".", 1)
            shape = list(p.shape)
            shape[dim] //= tp
            setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(torch.empty(shape, device="meta")))
    materialize(model, TINY, 3, "cpu", tp_rank=rank, tp=tp)
    for name, p in model.named_parameters():
        dim = split_dim(name)
        want = full[name] if dim is None else full[name].chunk(tp, dim=dim)[rank]
        assert torch.equal(p, want), name


def test_recompute_keeps_names_and_gradients():
    x = torch.randint(0, TINY.vocab, (2, 16))
    plain, recomputed = build_model(TINY, 0), recompute_blocks(build_model(TINY, 0))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    for model in (plain, recomputed):
        loss_fn(model(x), x).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
