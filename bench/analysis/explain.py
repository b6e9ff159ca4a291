"""The layout explainer: who computes what, who holds which part of the sequence, who talks to whom,
over which link. Pure maths over `bench.layout` (the same rank maths and zig-zag chunks the engines
use, so they cannot disagree)."""
from __future__ import annotations

from bench.analysis.comm import stage_traffic
from bench.analysis.stage_plan import stage_plan
from bench.layout import DIMS, Layout, named_dims, zigzag_chunks, zigzag_tokens

TREE_LIMIT = 64  # print every replica up to this many GPUs; beyond, the first two and the last


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def _nodes(lay: Layout, group: list[int]) -> list[int]:
    return sorted({lay.node(r) for r in group})


def _ops(traffic) -> dict:
    """{kind: bytes per step per rank} of one dimension's traffic on one stage."""
    out: dict[str, float] = {}
    for tr in traffic:
        if tr.kind != "recv":
            out[tr.kind] = out.get(tr.kind, 0.0) + tr.total
    return out


OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
            "send": "send-recv", "broadcast": "broadcast", "all_to_all": "all-to-all"}


def explain(lay: Layout, rack_size: int | None = None, cfg=None, mixed_state: str = "zero",
            seq: int | None = None) -> dict:
    """`ranks`, `groups`, `links` (one per group: link, nodes, with `cfg` the ops and bytes per step
    per rank), `warnings`, `replicas` (the tree: replica → stage (→ cp rank) → tp ranks and node) and,
    with cp > 1, `sequence` (each cp rank's zig-zag chunks; their tokens given `seq` or `cfg`)."""
    seq = cfg.seq if cfg is not None else seq
    ranks = [{"rank": r, "node": lay.node(r), **lay.coords(r)._asdict()} for r in range(lay.world_size)]
    groups = {dim: lay.groups(dim) for dim in DIMS}
    plan = stage_plan(cfg) if cfg is not None else None
    traffic = {s: stage_traffic(plan, s, mixed_state) for s in range(lay.pp)} if cfg is not None else None
    links = []
    for dim in DIMS:
        if getattr(lay, dim) == 1:
            continue
        for g in groups[dim]:
            entry = {"dim": dim, "ranks": g, "nodes": _nodes(lay, g),
                     "link": "network" if lay.crosses_node(g) else "nvlink"}
            if traffic is not None:
                stages = sorted({lay.coords(r).pp for r in g})
                per_stage = [_ops([t for t in traffic[s] if t.dim == dim]) for s in stages]
                entry["ops"] = {OP_NAMES[k]: sum(p.get(k, 0.0) for p in per_stage) / len(per_stage)
                                for k in sorted({k for p in per_stage for k in p})}
                entry["bytes_per_step"] = sum(entry["ops"].values())
            links.append(entry)
    out = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "order": lay.order,
           "gpus_per_node": lay.gpus_per_node, "world_size": lay.world_size, "nodes": lay.nodes(), "ranks": ranks,
           "groups": groups, "links": links, "warnings": warnings(lay, rack_size), "replicas": _tree(lay, seq)}
    if lay.cp > 1:
        out["sequence"] = {"chunks": 2 * lay.cp, "seq": seq, "holds": [_share(c, lay.cp, seq) for c in range(lay.cp)]}
    return out


def _share(cp_rank: int, cp: int, seq: int | None) -> dict:
    """What cp rank `cp_rank` holds: its two chunks and, with `seq`, their tokens [start, end)."""
    out = {"cp": cp_rank, "chunks": list(zigzag_chunks(cp_rank, cp))}
    if seq is not None:
        out["tokens"] = [[r.start, r.stop] for r in zigzag_tokens(cp_rank, cp, seq)]
    return out


def _tree(lay: Layout, seq: int | None) -> list[dict]:
    """Replica → stage → tp ranks; with cp > 1 one entry per (stage, cp rank), with its sequence share."""
    def stage(d: int, p: int, c: int) -> dict:
        g = lay.group_of(lay.rank(dp=d, pp=p, cp=c), "tp")
        return {"pp": p, "tp_ranks": g, "nodes": _nodes(lay, g)} | (_share(c, lay.cp, seq) if lay.cp > 1 else {})
    return [{"dp": d, "stages": [stage(d, p, c) for p in range(lay.pp) for c in range(lay.cp)]} for d in range(lay.dp)]


def warnings(lay: Layout, rack_size: int | None = None) -> list[str]:
    out = []
    tp_cross = lay.crossing_groups("tp")
    if tp_cross:
        g = tp_cross[0]
        out.append(f"{len(tp_cross)} of {len(lay.groups('tp'))} tp groups span nodes (e.g. GPUs {ranges(g)} on "
                   f"nodes {ranges(_nodes(lay, g))}): their per-layer collectives cross the network; "
                   f"keep tp ≤ gpus_per_node ({lay.gpus_per_node})")
        dp_inside = [g for g in lay.groups("dp") if lay.dp > 1 and not lay.crosses_node(g)]
        if dp_inside:
            out.append(f"dp groups stay inside a node (e.g. GPUs {ranges(dp_inside[0])}) while tp crosses nodes: "
                       "the per-layer tp traffic should get the NVLink and the once-per-step dp traffic the "
                       f"network; pick tp dividing gpus_per_node ({lay.gpus_per_node})")
    cp_cross = lay.crossing_groups("cp")
    if cp_cross:
        g = cp_cross[0]
        out.append(f"{len(cp_cross)} of {len(lay.groups('cp'))} cp rings leave a node (e.g. GPUs {ranges(g)} on "
                   f"nodes {ranges(_nodes(lay, g))}): their K/V passes, every layer, cross the network; "
                   f"pick tp × cp ({lay.tp * lay.cp}) dividing gpus_per_node ({lay.gpus_per_node})")
    if rack_size and lay.pp > 1:
        pairs = crossing_pp_pairs(lay, rack_size)
        if pairs:
            a, b = pairs[0]
            out.append(f"{len(pairs)} pipeline neighbour pairs cross racks of {rack_size} nodes (e.g. GPU {a} on "
                       f"node {lay.node(a)} → GPU {b} on node {lay.node(b)}): their sends take the spine")
    return out


def crossing_pp_pairs(lay: Layout, rack_size: int) -> list[tuple[int, int]]:
    """Adjacent-stage rank pairs whose nodes are in different racks (rack = node // rack_size)."""
    return [(g[i], g[i + 1]) for g in lay.groups("pp") for i in range(len(g) - 1)
            if lay.node(g[i]) // rack_size != lay.node(g[i + 1]) // rack_size]


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_text(info: dict) -> str:
    """The human-readable explanation: the tree, then every group with its link, then warnings."""
    dims = named_dims(info["cp"])
    lines = [" × ".join(f"{d}={info[d]}" for d in dims) + f" = {info['world_size']} GPUs on "
             f"{info['nodes']} node(s) of {info['gpus_per_node']}, rank order {info['order']} (fastest first)", ""]
    if "sequence" in info:
        lines += [_sequence_line(info["sequence"]), ""]
    reps = info["replicas"]
    shown = reps if info["world_size"] <= TREE_LIMIT or len(reps) <= 3 else [reps[0], reps[1], None, reps[-1]]
    for rep in shown:
        if rep is None:
            lines.append(f"… {len(reps) - 3} more replicas …")
            continue
        lines.append(f"data-parallel replica {rep['dp']}")
        for st in rep["stages"]:
            lines.append(f"  └ stage {st['pp']}{_cp_part(st)}: tp GPUs {ranges(st['tp_ranks'])} on node "
                         f"{ranges(st['nodes'])}{_held(st)}")
    lines.append("")
    for dim in dims:
        groups = info["groups"][dim]
        mine = [l for l in info["links"] if l["dim"] == dim]
        ring = ", each a ring" if dim == "cp" else ""
        lines.append(f"{dim} groups ({len(groups)} of {len(groups[0])} GPUs{ring}):")
        if not mine:
            lines.append("  (size 1: no communication)")
            continue
        for l in mine[:8]:
            ops = ""
            if "ops" in l:
                ops = "   " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in l["ops"].items()) + " per step per GPU"
            lines.append(f"  GPUs {ranges(l['ranks']):<20} {l['link']:<8} nodes {ranges(l['nodes'])}{ops}")
        if len(mine) > 8:
            lines.append(f"  … {len(mine) - 8} more")
    lines.append("")
    lines += [f"warning: {w}" for w in info["warnings"]] or ["no warnings"]
    return "\n".join(lines)


def _sequence_line(sequence: dict) -> str:
    n, seq = sequence["chunks"], sequence["seq"]
    size = f" of {seq // n} tokens (seq {seq})" if seq is not None else ""
    rule = f"cp rank r holds chunks r and {n - 1} − r (zig-zag: equal causal work)"
    return f"sequence: {n} chunks{size}; {rule}" + ("" if seq is not None else "; --seq or --model gives the tokens")


def _cp_part(stage: dict) -> str:
    return f", cp rank {stage['cp']}" if "cp" in stage else ""


def _held(stage: dict) -> str:
    """', chunks 0 and 3 (tokens 0-255, 768-1023)' for a stage entry of a cp rank; '' otherwise."""
    if "chunks" not in stage:
        return ""
    tokens = stage.get("tokens")
    spans = f" (tokens {', '.join(f'{a}-{b - 1}' for a, b in tokens)})" if tokens else ""
    return f", chunks {stage['chunks'][0]} and {stage['chunks'][1]}{spans}"
