"""DeepSpeed ZeRO-3's parameter all-gathers, replayed from its coordinator's rules (DeepSpeed 0.19.8).

Pure: the module tree of the shared GPT and its parameter sizes in, the all-gathers of one micro-batch
out. The rules, read in deepspeed/runtime/zero/:
- parameter_offload.py `setup_zero_stage3_hooks` / `_register_deepspeed_module`: every module gets a
  pre-forward hook (`fetch_sub_module`), a post-forward hook (`release_sub_module`), a pre-backward
  hook on its outputs (fetch again) and a post-backward hook on its inputs (release); the root's
  forward starts with `reset_step`. A module whose inputs need no gradient (the root, the embeddings:
  token ids in) never runs its post-backward hook; stage3.py `backward_epilogue` →
  `release_backward_leftovers` frees its parameters after backward. `mark_persistent_parameters`:
  a parameter of numel ≤ stage3_param_persistence_threshold stays whole (never gathered in a step;
  `_post_step` gathers them once after each optimizer step, one op each).
- The trace (partitioned_param_coordinator.py `record_module`, `reset_step`): the first micro-batch
  records the modules in fetch order, forward then backward; from the second on the trace is complete
  and the prefetcher runs, so steady state is every micro-batch from the second (a run's warm-up step).
  Forward runs pre-order (registration order for the GPT); pre-backward hooks fire in the reverse of
  forward completion order (autograd runs the latest-made node first), post-backward hooks once the
  module's first child (or itself, a leaf) has finished its backward.
- `fetch_sub_module` at trace step i: one all-gather (`all_gather_coalesced`: one op, each parameter
  padded to a multiple of dp) of the module's parameters not available; the queue of (parameter, step)
  entries is popped past the module's own; then, with stage3_prefetch_bucket_size > 0, entries are popped
  while the numel being prefetched is below min(stage3_max_live_parameters − numel gathered now, bucket),
  each not-available parameter joining one coalesced prefetch, every popped entry raising the
  parameter's "fetched for step" mark.
- `release_sub_module` / `__params_to_release` at step s (the next module's index): the module's
  non-persistent parameters are freed unless marked for a later step than s, or used by a module in
  the trace from s on before stage3_max_reuse_distance numel (all parameters of the modules passed,
  persistent ones included) has been traversed; a parameter in use by another module stays.
  Freed parameters are gathered again at their next use: the backward re-gather, once per micro-batch
  (gradient accumulation re-gathers every micro-batch).
- Recomputation (torch's non-reentrant checkpoint, bench.surgery): a checkpointed module's forward hooks
  run again inside backward, once its first leaf's backward unpacks a saved tensor, and the checkpoint
  stops after the last saved tensor (the last leaf's forward), so that leaf and its ancestors release
  nothing then; those fetches are part of the trace like any other.
Every rule was held against DeepSpeed's own event order on `tiny` (fetch, gather and release logged
per module) and against the counter's bytes and ops (tests/test_analysis_measured.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Module:
    name: str
    params: tuple[int, ...]  # indices of its own parameters (registration order = DeepSpeed's ds_id order)
    children: tuple["Module", ...] = ()
    grad_input: bool = True  # its inputs need a gradient: its post-backward hook fires
    recomputed: bool = False  # a checkpoint re-runs its forward in backward


@dataclass(frozen=True)
class Gathers:
    """Element counts (padded to dp) of the all-gathers of one steady-state micro-batch, by phase (those
    of a forward recomputed in backward count as backward)."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


NO_GRAD_INPUT = ("", "embed", "embed.tok", "embed.pos")
"""Modules fed token ids or positions (no gradient): their post-backward hook never fires."""


def gpt_tree(names: tuple[str, ...], tied_head: int | None, recompute: str = "none", ulysses: bool = False) -> Module:
    """The GPT's module tree as DeepSpeed hooks it, from its parameter names (in registration order):
    the ModuleList of blocks is never called, so the blocks are the root's children; each attention
    calls its parameterless core between qkv and proj, under DeepSpeed Ulysses inside 3 wrappers
    (bench.backends.deepspeed `UlyssesAttention` → DistributedAttention → its local attention), under
    selective recompute around one (bench.surgery `_Recomputed`, whose inner core is recomputed); full
    recompute checkpoints each block in place; a tied head is a module using the token table's parameter."""
    tree: dict = {"params": [], "children": {}}
    core_depth = 1 + 3 * ulysses + (recompute == "selective")

    def child(at: dict, name: str) -> dict:
        return at["children"].setdefault(name, {"params": [], "children": {}})

    def node(path: list[str]) -> dict:
        at = tree
        for part in path:
            if part == "proj" and "qkv" in at["children"] and "core" not in at["children"]:  # the core runs between qkv and proj
                chain = at
                for _ in range(core_depth):
                    chain = child(chain, "core")
                chain["recomputed"] = recompute == "selective"
            at = child(at, part)
        return at
    for i, name in enumerate(names):
        parts = name.split(".")[:-1]
        block = parts[0] == "blocks"
        at = node([".".join(parts[:2]), *parts[2:]] if block else parts)
        at["params"].append(i)
        if block:
            tree["children"][".".join(parts[:2])]["recomputed"] = recompute == "full"
    if tied_head is not None:
        node(["head"])["params"].append(tied_head)

    def build(path: str, at: dict) -> Module:
        kids = tuple(build(f"{path}.{k}" if path else k, v) for k, v in at["children"].items())
        return Module(path, tuple(sorted(at["params"])), kids, path not in NO_GRAD_INPUT, at.get("recomputed", False))
    return build("", tree)


def _events(root: Module) -> list[tuple[str, str, Module]]:
    """("fetch" | "release", phase, module) in the order the hooks run in one micro-batch. A recomputed
    module's forward re-runs (fetches and releases) once backward reaches its first leaf, whose
    backward unpacks a saved tensor, and stops at its last leaf's forward (the checkpoint's early stop:
    that leaf and its ancestors release nothing then)."""
    out: list = []

    def forward(m: Module, phase: str, into: list) -> list:
        into.append(("fetch", phase, m))
        for c in m.children:
            forward(c, phase, into)
        into.append(("release", phase, m))
        return into

    def recomputation(m: Module) -> list:
        events = forward(m, BACKWARD, [])
        last = max(i for i, (kind, _, _) in enumerate(events) if kind == "fetch")
        return events[:last + 1]

    def backward(m: Module, pending: list):
        out.append(("fetch", BACKWARD, m))
        if m.recomputed:
            pending.append(m)
        if not m.children and pending:
            out.extend(recomputation(pending.pop()))
        for c in reversed(m.children):
            backward(c, pending)
        if m.grad_input:
            out.append(("release", BACKWARD, m))
    forward(root, FORWARD, out)
    backward(root, [])
    return out


def replay(root: Module, sizes: tuple[int, ...], dp: int, persistent: frozenset, bucket: int, max_live: int,
           max_reuse: int) -> Gathers:
    """The all-gathers of one steady-state micro-batch (module docstring), by the coordinator's rules."""
    events = _events(root)
    order = [m for kind, _, m in events if kind == "fetch"]  # the recorded trace
    queue = deque((p, step) for step, m in enumerate(order) for p in m.params)
    gathered: set[int] = set()  # available or in flight (persistent ones are never counted here)
    active: dict[int, set[str]] = {}
    fetched_for: dict[int, int] = {}
    live, step = 0, 0
    out: dict[str, list[int]] = {FORWARD: [], BACKWARD: []}
    padded = [-(-n // dp) * dp for n in sizes]

    def gather(params, phase):
        nonlocal live
        todo = [p for p in params if p not in gathered and p not in persistent]
        if todo:
            gathered.update(todo)
            live += sum(sizes[p] for p in todo)
            out[phase].append(sum(padded[p] for p in todo))

    def free(p):
        nonlocal live
        if p in gathered and not active.get(p):
            gathered.discard(p)
            live -= sizes[p]

    for kind, phase, m in events:
        if kind == "fetch":
            gather(m.params, phase)
            for p in m.params:
                active.setdefault(p, set()).add(m.name)
            # pop this module's own entries (those no prefetch has popped for this use yet)
            mine = {p for p in m.params if fetched_for.get(p, -1) < step}
            popped = 0
            while queue and popped < len(mine):
                p, used_at = queue.popleft()
                fetched_for[p] = used_at
                popped += 1
            if bucket > 0:
                limit, numel, batch = min(max_live - live, bucket), 0, []
                while queue and numel < limit:
                    p, used_at = queue.popleft()
                    fetched_for[p] = max(fetched_for.get(p, -1), used_at)
                    if p not in gathered and p not in persistent and p not in batch:
                        batch.append(p)
                        numel += sizes[p]
                gather(batch, phase)
            step += 1
        else:  # a release (backward: only where the post-backward hook fires, `_events`)
            for p in m.params:
                active[p].discard(m.name)
            for p in _to_release(m, step, order, sizes, persistent, fetched_for, max_reuse):
                free(p)
    return Gathers(tuple(out[FORWARD]), tuple(out[BACKWARD]))


def _to_release(m: Module, step: int, order: list[Module], sizes, persistent, fetched_for, max_reuse) -> list[int]:
    """`__params_to_release`: m's non-persistent parameters not marked for a later step, not reused within
    max_reuse numel of the trace from `step` on."""
    keep = {p for p in m.params if p in persistent or fetched_for.get(p, -1) > step}
    traversed = 0
    for later in order[step:]:
        if traversed >= max_reuse:
            break
        keep.update(later.params)
        traversed += sum(sizes[p] for p in later.params)
    return [p for p in m.params if p not in keep]
