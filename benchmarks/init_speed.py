"""Initial-value speed at one thread (what a rank has): the old whole-tensor draw against the block draw.

Per gpt2-1.5b tensor (the token table, one block's weights), values/s of
    old          torch.randn(whole shape, one generator) · std, copied into the parameter (the old init_weights)
    new          models.init_fill_ straight into the parameter (already-touched memory)
    new fresh    init_fill_ into a fresh torch.empty: first-touch page faults included, as after `to_empty`
    new bf16     init_fill_ into a touched bf16 parameter: the path of a GPU or low-precision destination
                 (drawn through the process's host buffer, then copied)
    new value    init_value: the full value as a new host tensor
with the methods interleaved over the repeats (this machine is shared: medians, and the best), then the
seconds to initialise the whole gpt2-1.5b (1.56 B values) on one rank, old and new, into fresh memory and
again into touched memory (first-touch page faults here cost 1.5-6 ns/value, whatever draws the values).
    python benchmarks/init_speed.py [--repeats 5] [--model gpt2-1.5b] [--no-whole]
(THP_MEM_ALLOC_ENABLE=1 in the environment makes torch's host allocator ask for huge pages: fewer faults.)
"""
from __future__ import annotations

import argparse
import statistics
import time
import zlib

import torch

from bench.surgery import meta_module
from models import GPT, get_preset, init_fill_, init_value, init_weights
from models.gpt import init_constant, init_std


def old_init_value(name: str, shape, cfg, seed: int) -> torch.Tensor:
    """The initialiser this replaced, verbatim: one generator per parameter, one randn over the whole shape."""
    constant = init_constant(name)
    if constant is not None:
        return torch.full(shape, constant, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, device="cpu") * init_std(name, cfg)


def old_fill(p: torch.Tensor, name: str, cfg) -> None:
    p.copy_(old_init_value(name, p.shape, cfg, 0))


def new_fill(p: torch.Tensor, name: str, cfg) -> None:
    init_fill_(p, name, p.shape, cfg, 0)


def new_fill_fresh(p: torch.Tensor, name: str, cfg) -> None:
    init_fill_(torch.empty(p.shape, device="cpu"), name, p.shape, cfg, 0)


def new_value(p: torch.Tensor, name: str, cfg) -> None:
    init_value(name, p.shape, cfg, 0)


# "new bf16" is new_fill on a bf16 destination (per_tensor): the host-buffer path.
METHODS = {"old": old_fill, "new": new_fill, "new fresh": new_fill_fresh, "new bf16": new_fill, "new value": new_value}


def tensors(cfg) -> dict[str, torch.Size]:
    """The token table and block 0's weights (every block's are the same shapes)."""
    shapes = {n: p.shape for n, p in meta_module(lambda: GPT(cfg)).named_parameters()}
    return {n: s for n, s in shapes.items() if n == "embed.tok.weight" or (n.startswith("blocks.0.")
                                                                          and init_constant(n) is None)}


def per_tensor(cfg, repeats: int) -> None:
    print(f"| tensor | shape | {' | '.join(f'{m} M/s (best)' for m in METHODS)} |")
    print("|---|---|" + "---|" * len(METHODS))
    for name, shape in tensors(cfg).items():
        dests = {"new bf16": torch.zeros(shape, dtype=torch.bfloat16, device="cpu")}
        touched = torch.zeros(shape, device="cpu")  # touched once: what "new" (and "old") write into
        rates = {m: [] for m in METHODS}
        for _ in range(repeats):
            for method, fill in METHODS.items():  # interleaved: drift on a shared machine hits every method
                dest = dests.get(method, touched)
                t = time.perf_counter()
                fill(dest, name, cfg)
                rates[method].append(dest.numel() / (time.perf_counter() - t) / 1e6)
        cells = " | ".join(f"{statistics.median(r):.0f} ({max(r):.0f})" for r in rates.values())
        print(f"| {name} | {tuple(shape)} | {cells} |", flush=True)


def whole_model(cfg, method: str) -> tuple[float, float, int]:
    """Seconds to allocate and initialise the whole model on one rank into fresh memory (as `build_model`),
    then to initialise it again into the same, now touched, memory (the draw alone: a GPU rank's case,
    whose host side is one reused buffer)."""
    model = meta_module(lambda: GPT(cfg))
    t = time.perf_counter()
    model.to_empty(device="cpu")
    model.tie_weights()
    fill_all(model, cfg, method)
    fresh = time.perf_counter() - t
    t = time.perf_counter()
    fill_all(model, cfg, method)
    touched = time.perf_counter() - t
    return fresh, touched, sum(p.numel() for p in model.parameters())


@torch.no_grad()
def fill_all(model, cfg, method: str) -> None:
    if method == "new":
        init_weights(model, 0)
        return
    for name, p in model.named_parameters():
        old_fill(p, name, cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="gpt2-1.5b")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-model initialisation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset(args.model)
    print(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} thread, {args.repeats} interleaved "
          "repeats: median (best) M values/s")
    per_tensor(cfg, args.repeats)
    if args.no_whole:
        return
    for method in ("new", "old", "new"):
        fresh, touched, values = whole_model(cfg, method)
        print(f"whole {args.model} ({values / 1e9:.2f} B values) on one rank, {method}: {fresh:.1f} s into fresh "
              f"memory ({values / fresh / 1e6:.0f} M/s, page faults included), {touched:.1f} s into touched "
              f"memory ({values / touched / 1e6:.0f} M/s)", flush=True)

if __name__ == "__main__":
    main()
