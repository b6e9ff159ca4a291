"""The layout explainer: who computes what, who holds which part of the sequence, who talks to whom,
over which link. Pure maths over `bench.layout` (the same rank maths and zig-zag chunks the engines
use, so they cannot disagree)."""
from __future__ import annotations

from bench.analysis.comm import stage_traffic
from bench.analysis.stage_plan import stage_plan
from bench.layout import DIMS, EXPERT_DIMS, Layout, experts_held, named_dims, zigzag_chunks, zigzag_tokens

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
    with cp > 1, `sequence` (each cp rank's zig-zag chunks; their tokens given `seq` or `cfg`). With
    ep > 1 the ep and edp groups too, and each rank's ep rank (with `cfg`'s MoE model, the experts it holds)."""
    seq = cfg.seq if cfg is not None else seq
    experts = cfg.model_config.experts if cfg is not None else 0
    dims = (*DIMS, *(EXPERT_DIMS if lay.ep > 1 else ()))
    ranks = [{"rank": r, "node": lay.node(r), **lay.coords(r)._asdict(), **_expert_share(lay, r, experts)}
             for r in range(lay.world_size)]
    groups = {dim: lay.groups(dim) for dim in dims}
    plan = stage_plan(cfg) if cfg is not None else None
    traffic = {s: stage_traffic(plan, s, mixed_state) for s in range(lay.pp)} if cfg is not None else None
    links = []
    for dim in dims:
        if lay.size(dim) == 1:
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
    out = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "order": lay.order,
           "gpus_per_node": lay.gpus_per_node, "world_size": lay.world_size, "nodes": lay.nodes(), "ranks": ranks,
           "groups": groups, "links": links, "warnings": warnings(lay, rack_size), "replicas": _tree(lay, seq, experts)}
    if lay.cp > 1:
        out["sequence"] = {"chunks": 2 * lay.cp, "seq": seq, "holds": [_share(c, lay.cp, seq) for c in range(lay.cp)]}
    return out


def _share(cp_rank: int, cp: int, seq: int | None) -> dict:
    """What cp rank `cp_rank` holds: its two chunks and, with `seq`, their tokens [start, end)."""
    out = {"cp": cp_rank, "chunks": list(zigzag_chunks(cp_rank, cp))}
    if seq is not None:
        out["tokens"] = [[r.start, r.stop] for r in zigzag_tokens(cp_rank, cp, seq)]
    return out


def _expert_share(lay: Layout, rank: int, experts: int) -> dict:
    """With ep > 1, `rank`'s ep rank and edp rank and, given the model's `experts`, the ones it holds [first, last]."""
    if lay.ep == 1:
        return {}
    held = experts_held(lay.ep_rank(rank), lay.ep, experts) if experts else None
    return ({"ep_rank": lay.ep_rank(rank), "edp_rank": lay.edp_rank(rank)}
            | ({"experts": [held.start, held.stop - 1]} if held else {}))


def _tree(lay: Layout, seq: int | None, experts: int = 0) -> list[dict]:
    """Replica → stage → tp ranks; with cp > 1 one entry per (stage, cp rank), with its sequence share; with
    ep > 1 its ep rank (the tp ranks of an entry share it)."""
    def stage(d: int, p: int, c: int) -> dict:
        g = lay.group_of(lay.rank(dp=d, pp=p, cp=c), "tp")
        return ({"pp": p, "tp_ranks": g, "nodes": _nodes(lay, g)} | (_share(c, lay.cp, seq) if lay.cp > 1 else {})
                | _expert_share(lay, g[0], experts))
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
    ep_cross = lay.crossing_groups("ep") if lay.ep > 1 else []
    if ep_cross:
        g = ep_cross[0]
        out.append(f"{len(ep_cross)} of {len(lay.groups('ep'))} ep groups span nodes (e.g. GPUs {ranges(g)} on "
                   f"nodes {ranges(_nodes(lay, g))}): their token dispatch and combine, every MoE layer, cross the "
                   "network; pick a smaller ep, or order tp-dp-pp (dp next to tp)")
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
    if info.get("ep", 1) > 1:
        dims = (*dims, *EXPERT_DIMS)
        lines[-1:-1] = [_expert_line(info)]
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
                         f"{ranges(st['nodes'])}{_held(st)}{_experts_part(st)}")
    lines.append("")
    for dim in dims:
        groups = info["groups"][dim]
        mine = [l for l in info["links"] if l["dim"] == dim]
        ring = {"cp": ", each a ring", "ep": ", splitting the experts",
                "edp": ", holding the same experts: their gradients averaged"}.get(dim, "")
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


def _expert_line(info: dict) -> str:
    edp = info["dp"] * info["cp"] // info["ep"]
    data = "dp × cp" if info["cp"] > 1 else "dp"
    return (f"ep={info['ep']} inside {data} (not in the world size): ep groups of {info['ep']} split the experts, "
            f"edp groups of {edp} hold the same ones; ep rank = (cp + CP · dp) mod ep")


def _cp_part(stage: dict) -> str:
    return f", cp rank {stage['cp']}" if "cp" in stage else ""


def _held(stage: dict) -> str:
    """', chunks 0 and 3 (tokens 0-255, 768-1023)' for a stage entry of a cp rank; '' otherwise."""
    if "chunks" not in stage:
        return ""
    tokens = stage.get("tokens")
    spans = f" (tokens {', '.join(f'{a}-{b - 1}' for a, b in tokens)})" if tokens else ""
    return f", chunks {stage['chunks'][0]} and {stage['chunks'][1]}{spans}"


def _experts_part(stage: dict) -> str:
    """', ep rank 1 (experts 4-7)' for a stage entry under ep > 1; '' otherwise."""
    if "ep_rank" not in stage:
        return ""
    held = f" (experts {stage['experts'][0]}-{stage['experts'][1]})" if "experts" in stage else ""
    return f", ep rank {stage['ep_rank']}{held}"
