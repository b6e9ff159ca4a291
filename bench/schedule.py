"""Pipeline schedules as data: the layer partition, which rank holds which chunk, each rank's
ordered actions under GPipe, 1F1B and interleaved 1F1B, and a simulator that plays them against
each other. Pure Python: the native executor runs these action lists, the cost model reads its
in-flight activations and its bubble off the same lists (no closed form of its own).

Conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" = PTD-P, §2.2): p pipeline ranks, m micro-batches, v model chunks per rank. The
model is cut into p·v contiguous chunks ("stages"); chunk c runs on rank c mod p as that rank's
local chunk c div p. An action is ("F" | "B", local chunk, micro-batch).

What the paper derives in closed form, and the tests check the simulator reproduces: the bubble is
(p−1)/(m+p−1) of the step for GPipe and 1F1B and (p−1)/(v·m+p−1) for the interleaved schedule;
GPipe holds m micro-batches' activations, 1F1B min(p−r, m) on rank r.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "interleaved")  # RunConfig's choices
Action = tuple[str, int, int]  # ("F" | "B", local chunk, micro-batch)


# --- where the layers live -----------------------------------------------------------------------
def partition(layers: int, stages: int) -> list[list[int]]:
    """Contiguous, balanced: sizes differ by at most one (earlier stages take the remainder)."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Global chunk (stage) ids held by pipeline rank `rank`, in local order: chunk j is j·p + rank."""
    return [rank + j * pp for j in range(virtual_stages)]


def chunk_rank(chunk: int, pp: int) -> int:
    """The pipeline rank that runs global chunk `chunk`."""
    return chunk % pp


# --- each rank's actions -------------------------------------------------------------------------
def gpipe(m: int, p: int, r: int) -> list[Action]:
    """All forwards, then all backwards: m micro-batches in flight."""
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def one_f_one_b(m: int, p: int, r: int) -> list[Action]:
    """Warm-up of p − r − 1 forwards, steady one-forward-one-backward, cool-down: ≤ p in flight."""
    warm = min(p - r - 1, m)
    out = [("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", 0, warm + i), ("B", 0, i)]
    return out + [("B", 0, i) for i in range(m - warm, m)]


def interleaved(m: int, p: int, r: int, v: int, fill_when_m_is_p: bool = True) -> list[Action]:
    """Interleaved 1F1B: v chunks per rank, micro-batches in groups of p (m % p == 0).

    Warm-up of (p − r − 1)·2 + (v − 1)·p forwards, then one forward one backward. When m == p,
    Megatron-LM (and the native executor) runs every forward first (`fill_when_m_is_p`);
    torch.distributed.pipelining's ScheduleInterleaved1F1B keeps the warm-up rule."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warm = total if m == p and fill_when_m_is_p else min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [("F", *unit(k, False)) for k in range(warm)]
    for k in range(total - warm):
        out += [("F", *unit(warm + k, False)), ("B", *unit(k, True))]
    return out + [("B", *unit(k, True)) for k in range(total - warm, total)]


def schedule(name: str, m: int, p: int, r: int, v: int = 1, fill_when_m_is_p: bool = True) -> list[Action]:
    """Rank r's actions. Without a pipeline (p == 1) interleaving means nothing: 1F1B, i.e.
    gradient accumulation; GPipe keeps its all-forwards-first order."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule is {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved" and p > 1:
        return interleaved(m, p, r, v, fill_when_m_is_p)
    return gpipe(m, p, r) if name == "gpipe" else one_f_one_b(m, p, r)


def peak_held(order: list[Action], weights: tuple[float, ...] | None = None) -> float:
    """Peak, over the order, of the (chunk, micro-batch) pairs whose forward ran and backward has not:
    chunk-micro-batches in flight, or with `weights[chunk]` per local chunk e.g. layers' worth."""
    held = peak = 0
    for kind, chunk, _ in order:
        w = 1 if weights is None else weights[chunk]
        if kind == "F":
            held += w
            peak = held if held > peak else peak
        else:
            held -= w
    return peak


# --- playing the ranks against each other --------------------------------------------------------
class Deadlock(RuntimeError):
    pass


@dataclass(frozen=True)
class Step:
    """One step of a schedule over `ranks` ranks: its length, and compute time summed over ranks."""

    ranks: int
    makespan: float
    busy: float

    @property
    def idle(self) -> float:
        """Time summed over ranks spent waiting inside the step: the bubble."""
        return self.ranks * self.makespan - self.busy

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, averaged over ranks."""
        return self.idle / (self.ranks * self.makespan)

    @property
    def bubble_over_ideal(self) -> float:
        """PTD-P's form: bubble time / ideal compute time."""
        return self.idle / self.busy


@dataclass(frozen=True)
class Simulation:
    """Every rank's actions with their start times: receives block, sends are asynchronous."""

    orders: tuple[tuple[Action, ...], ...]
    starts: tuple[tuple[float, ...], ...]
    forward: float
    backward: float
    step: Step

    def cost(self, action: Action) -> float:
        return self.forward if action[0] == "F" else self.backward

    @property
    def timelines(self) -> list[list[tuple[float, float, Action]]]:
        """Per rank: (start, end, action) in the order run."""
        return [[(t, t + self.cost(a), a) for t, a in zip(ts, order)] for ts, order in zip(self.starts, self.orders)]

    @property
    def peak_in_flight(self) -> list[int]:
        """Chunk-micro-batches whose activations each rank holds at its peak."""
        return [peak_held(order) for order in self.orders]


def simulate(orders: list[list[Action]], v: int = 1, forward: float = 1, backward: float = 2) -> Simulation:
    """Run every rank's order with zero-latency messages: a forward of global chunk c > 0 starts once
    chunk c − 1 has finished that micro-batch's forward, a backward of c < p·v − 1 once chunk c + 1
    has finished its backward, and a rank runs one action at a time. `forward`/`backward`: the cost
    of one action. Raises Deadlock if the orders wait on each other."""
    p = len(orders)
    last, m = p * v - 1, 1 + max((a[2] for order in orders for a in order), default=0)
    f_end, b_end = [None] * (p * v * m), [None] * (p * v * m)  # by global chunk·m + micro-batch
    pos, free, starts, busy = [0] * p, [0] * p, [[] for _ in range(p)], 0
    waiting = list(range(p))
    while waiting:  # run a rank until it blocks on a receive; its sender puts it back on the list
        r = waiting.pop()
        order, ts, i, t = orders[r], starts[r], pos[r], free[r]
        while i < len(order):
            kind, chunk, mb = order[i]
            sid = chunk * p + r
            k = sid * m + mb
            if kind == "F":
                ready = f_end[k - m] if sid > 0 else 0
                if ready is None:
                    break
                start = max(t, ready)
                t = f_end[k] = start + forward
                busy += forward
                waiting.append((sid + 1) % p)  # the rank that receives its output
            else:
                ready = b_end[k + m] if sid < last else f_end[k]
                if ready is None:
                    break
                start = max(t, ready)
                t = b_end[k] = start + backward
                busy += backward
                waiting.append((sid - 1) % p)  # the rank that receives its input gradient
            ts.append(start)
            i += 1
        pos[r], free[r] = i, t
    if any(pos[r] < len(orders[r]) for r in range(p)):
        raise Deadlock(f"the orders wait on each other at positions {pos}")
    return Simulation(tuple(map(tuple, orders)), tuple(map(tuple, starts)), forward, backward,
                      Step(p, max(free), busy))


FORWARD, BACKWARD = 1, 2  # the cost model's unit costs of one chunk's forward and backward


@lru_cache(maxsize=256)
def simulate_schedule(name: str, m: int, p: int, v: int = 1, fill_when_m_is_p: bool = True) -> Simulation:
    """`simulate` over every rank's actions of a named schedule, at the unit costs."""
    v = v if name == "interleaved" and p > 1 else 1
    return simulate([schedule(name, m, p, r, v, fill_when_m_is_p) for r in range(p)], v, FORWARD, BACKWARD)


@lru_cache(maxsize=4096)
def schedule_step(name: str, m: int, p: int, v: int = 1, fill_when_m_is_p: bool = True) -> Step:
    """The simulated step of a named schedule at the unit costs, for the cost model.

    Once every rank's warm-up is full (m ≥ 2p covers all three schedules) each further micro-batch
    puts one more forward and backward on every rank's steady phase, which runs without waiting: the
    idle time stops growing with m. So beyond 3p micro-batches the schedule is simulated at 2p and
    3p; if the two idle times agree that idle time holds for m too (tests check this against the
    full simulation), otherwise m is simulated in full. This keeps the planner's thousands of
    candidates cheap."""
    if m > 3 * p:
        low, high = (simulate_schedule(name, k, p, v, fill_when_m_is_p).step for k in (2 * p, 3 * p))
        if low.idle == high.idle:
            busy = low.busy * m / (2 * p)  # every micro-batch costs the same compute
            return Step(p, (busy + low.idle) / p, busy)
    return simulate_schedule(name, m, p, v, fill_when_m_is_p).step


@lru_cache(maxsize=1024)
def _order(name: str, m: int, p: int, r: int, v: int, fill_when_m_is_p: bool) -> tuple[Action, ...]:
    return tuple(schedule(name, m, p, r, v if name == "interleaved" else 1, fill_when_m_is_p))


@lru_cache(maxsize=65536)
def rank_peak(name: str, m: int, p: int, r: int, v: int = 1, fill_when_m_is_p: bool = True,
              weights: tuple[float, ...] | None = None) -> float:
    """`peak_held` of rank r's actions under a named schedule, for the cost model."""
    return peak_held(_order(name, m, p, r, v, fill_when_m_is_p), weights)
