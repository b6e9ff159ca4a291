"""A pure-Python model of NCCL's stream semantics: replays every rank's calls, in the order each rank
issued them, and says whether the ranks deadlock and whether every receive gets the message it expects.

gloo matches point-to-point messages by tag and runs them on host threads, so a CPU run shows neither
failure; NCCL (through torch's ProcessGroupNCCL) does neither. What is modelled:
- each (rank, communicator) has one FIFO stream; a rank's compute runs on its default stream;
- a send and its matching receive complete together, and only once both are at the head of their
  streams (NCCL P2P is "blocking for the GPU"). They match by position: the k-th send from a to b on a
  communicator meets the k-th receive at b from a on it. Tags are ignored;
- each communication op first waits for the default-stream work queued before it (ProcessGroupNCCL's
  syncStream);
- `wait` (work.wait()) makes the default stream wait for a comm op; the host never blocks on it;
- a device-wide synchronize blocks the host until every earlier op of the rank is done (comm streams
  too); a current-stream synchronize only until the earlier default-stream ops are done.

Communicator granularity (`replay(..., communicators=)`): "group" is one communicator per process group
(what torch 2.13 gives eagerly initialised groups: every P2P op of the group shares its stream); "pair"
is a lazily created 2-rank communicator per group and peer pair.

MATCHING: the k-th send of a channel (communicator, sender, receiver) must carry the same message
identity as the k-th receive posted on it, else NCCL silently delivers the wrong tensor.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable

SEND, RECV, COMPUTE, WAIT = "send", "recv", "compute", "wait"
SYNC_DEVICE, SYNC_STREAM = "sync_device", "sync_stream"  # host synchronizes
DEFAULT = "default"  # the default (compute) stream's key
COMMUNICATORS = ("group", "pair")


@dataclass(frozen=True)
class Op:
    """One call of a rank. `comm`: the process group (SEND/RECV); `peer`: the other rank; `message`: what
    the send carries or the receive expects; `target`: for WAIT, the index of the comm op waited for."""

    what: str
    comm: Hashable = None
    peer: int | None = None
    message: Hashable = None
    target: int | None = None

    def __str__(self) -> str:
        if self.what in (SEND, RECV):
            arrow = "→" if self.what == SEND else "←"
            return f"{self.what} {arrow}{self.peer} on {self.comm} {self.message}"
        if self.what == WAIT:
            return f"wait for op {self.target}"
        return f"{self.what} {self.message or ''}".rstrip()


def send(comm, peer: int, message=None) -> Op:
    return Op(SEND, comm, peer, message)


def recv(comm, peer: int, message=None) -> Op:
    return Op(RECV, comm, peer, message)


def compute(label=None) -> Op:
    return Op(COMPUTE, message=label)


def wait(target: int) -> Op:
    return Op(WAIT, target=target)


def sync_device() -> Op:
    return Op(SYNC_DEVICE)


def sync_stream() -> Op:
    return Op(SYNC_STREAM)


@dataclass
class Verdict:
    """The replay's outcome: `stuck` (per rank, where it stopped) is empty unless it deadlocked."""

    stuck: dict[int, str] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    @property
    def deadlock(self) -> bool:
        return bool(self.stuck)

    @property
    def ok(self) -> bool:
        return not self.stuck and not self.mismatches

    def __str__(self) -> str:
        if self.ok:
            return "ok"
        parts = ["DEADLOCK"] if self.deadlock else []
        parts += [f"{len(self.mismatches)} MISMATCH"] if self.mismatches else []
        return " + ".join(parts)

    def explain(self) -> str:
        lines = [str(self)] + [f"  rank {r}: {why}" for r, why in sorted(self.stuck.items())]
        return "\n".join(lines + [f"  {m}" for m in self.mismatches[:5]])


def replay(ranks: list[list[Op]], communicators: str = "group") -> Verdict:
    """Play every rank's ops (in issue order) against each other until no op can progress."""
    if communicators not in COMMUNICATORS:
        raise ValueError(f"communicators is {communicators!r}; choose one of {COMMUNICATORS}")
    return _Replay(ranks, communicators).run()


class _Replay:
    def __init__(self, ranks: list[list[Op]], communicators: str):
        self.ops, self.communicators = ranks, communicators
        self.done = [[False] * len(ops) for ops in ranks]
        self.host = [0] * len(ranks)  # ops before it are issued
        self.streams = [self._streams_of(r) for r in range(len(ranks))]  # stream → its op indices, FIFO
        self.heads = [dict.fromkeys(s, 0) for s in self.streams]  # stream → position of its first op undone
        self.default_before = [self._default_before(r) for r in range(len(ranks))]
        self.partner, self.mismatches = self._pair()

    def _stream(self, r: int, op: Op):
        if op.what in (COMPUTE, WAIT):
            return DEFAULT
        if op.what in (SEND, RECV):
            return op.comm if self.communicators == "group" else (op.comm, *sorted((r, op.peer)))
        return None  # a host synchronize: no stream

    def _streams_of(self, r: int) -> dict:
        out = defaultdict(list)
        for i, op in enumerate(self.ops[r]):
            stream = self._stream(r, op)
            if stream is not None:
                out[stream].append(i)
        return dict(out)

    def _default_before(self, r: int) -> list[int | None]:
        """Per op: the last default-stream op issued before it (what a comm op waits for first)."""
        out, last = [], None
        for i, op in enumerate(self.ops[r]):
            out.append(last)
            last = i if op.what in (COMPUTE, WAIT) else last
        return out

    def _pair(self) -> tuple[dict, list[str]]:
        """The k-th send of each channel with the k-th receive of it; messages that differ are mismatches."""
        sends, recvs = defaultdict(list), defaultdict(list)
        for r, ops in enumerate(self.ops):
            for i, op in enumerate(ops):
                if op.what == SEND:
                    sends[self._stream(r, op), r, op.peer].append((r, i))
                elif op.what == RECV:
                    recvs[self._stream(r, op), op.peer, r].append((r, i))
        partner, mismatches = {}, []
        for channel in sends.keys() | recvs.keys():
            out, into = sends.get(channel, []), recvs.get(channel, [])
            for k, (s, r) in enumerate(zip(out, into)):
                partner[s], partner[r] = r, s
                sent, expected = self.ops[s[0]][s[1]].message, self.ops[r[0]][r[1]].message
                if sent != expected:
                    mismatches.append(f"{channel} message {k}: sent {sent}, received as {expected}")
            if len(out) != len(into):
                mismatches.append(f"{channel}: {len(out)} sends, {len(into)} receives")
        return partner, mismatches

    # --- progress ---------------------------------------------------------------------------------
    def run(self) -> Verdict:
        while self._advance_hosts() | self._complete_heads():
            pass
        stuck = {r: self._where(r) for r in range(len(self.ops)) if not all(self.done[r])}
        return Verdict(stuck, self.mismatches)

    def _advance_hosts(self) -> bool:
        moved = False
        for r, ops in enumerate(self.ops):
            while self.host[r] < len(ops):
                i = self.host[r]
                if ops[i].what in (SYNC_DEVICE, SYNC_STREAM):
                    if not self._synced(r, i):
                        break
                    self.done[r][i] = True
                self.host[r] += 1
                moved = True
        return moved

    def _synced(self, r: int, i: int) -> bool:
        """Whether a host synchronize at op i may return: the earlier ops of the streams it waits for are done."""
        every = self.ops[r][i].what == SYNC_DEVICE
        streams = [s for s in self.streams[r] if every or s == DEFAULT]
        return all(self._head_index(r, s) >= i for s in streams)

    def _head_index(self, r: int, stream) -> float:
        ids, pos = self.streams[r][stream], self.heads[r][stream]
        return ids[pos] if pos < len(ids) else float("inf")

    def _complete_heads(self) -> bool:
        moved = False
        for r in range(len(self.ops)):
            for stream in self.streams[r]:
                while self._try_complete(r, stream):
                    moved = True
        return moved

    def _head(self, r: int, stream) -> int | None:
        """The stream's first op not done, if the host has issued it."""
        i = self._head_index(r, stream)
        return i if i < self.host[r] else None

    def _ready(self, r: int, i: int) -> bool:
        """Whether op i, at the head of its stream, has what it waits for (its partner aside)."""
        op = self.ops[r][i]
        if op.what == WAIT:
            return self.done[r][op.target]
        if op.what in (SEND, RECV):
            before = self.default_before[r][i]
            return before is None or self.done[r][before]
        return True

    def _try_complete(self, r: int, stream) -> bool:
        i = self._head(r, stream)
        if i is None or not self._ready(r, i):
            return False
        if self.ops[r][i].what in (SEND, RECV):
            other = self.partner.get((r, i))
            if other is None:
                return False
            q, j = other
            if self._head(q, self._stream(q, self.ops[q][j])) != j or not self._ready(q, j):
                return False
            self._finish(q, j)
        self._finish(r, i)
        return True

    def _finish(self, r: int, i: int) -> None:
        self.done[r][i] = True
        self.heads[r][self._stream(r, self.ops[r][i])] += 1

    def _where(self, r: int) -> str:
        ops, parts = self.ops[r], []
        if self.host[r] < len(ops):
            parts.append(f"host blocked at op {self.host[r]} ({ops[self.host[r]]})")
        for stream in self.streams[r]:
            i = self._head_index(r, stream)
            if i != float("inf"):
                parts.append(f"{stream} at op {i} ({ops[i]})")
        return "; ".join(parts)
