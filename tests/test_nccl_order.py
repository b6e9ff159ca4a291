"""The pipeline's point-to-point order under NCCL, on a machine without one (pure Python, seconds).

gloo matches messages by tag and runs them on host threads, so no CPU run shows a schedule that NCCL
deadlocks or whose messages NCCL pairs wrongly. Here the real executor (`Pipeline.run`, its schedule
and its `PipeComm`) runs once per rank with no process group: a recording accelerator (the meter's
synchronizes reach it, as they reach a GPU) and a `PipeComm` whose two torch.distributed calls are
recorded, over dummy chunks that log their forward and backward. The ranks' logs are then replayed
against each other through the model of NCCL's streams in tests/support/nccl_model.py.

What the replays show: with one channel per directed edge and message kind, and the bubble meter
waiting on the current stream only, every schedule completes and every receive gets its message; the
old layout (one pp group, plus one gradient group on CUDA, posting without look-ahead, a device-wide
meter synchronize) deadlocks the interleaved schedule, as the GPU readiness review found. DeepSpeed's
pipeline (its own P2P, on WORLD) is replayed too, as a guard for the eager-init behaviour.
"""
from __future__ import annotations

import itertools
import os
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from bench import device as bench_device
from bench.config import RunConfig
from bench.distributed import ProcessGroups
from bench.layout import Layout
from bench.native.pipeline import BubbleMeter, Pipeline
from bench.native.pipeline_comm import ACT, GRAD, PipeComm, channel_edges
from bench.schedule import SCHEDULES
from support import nccl_model as nccl

# --- recording one rank's calls ------------------------------------------------------------------


class Recorder:
    """One rank's calls in issue order. The k-th compute is the k-th action of the rank's schedule, so a
    message is named by the action that produced it (send) or the action that waits for it (receive)."""

    def __init__(self):
        self.ops: list[nccl.Op] = []
        self.order, self.computes = [], 0

    def add(self, op: nccl.Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def computed(self, kind: str, chunk: int) -> None:
        action = self.order[self.computes]
        assert action[:2] == (kind, chunk), f"compute {kind}{chunk} ran for action {action}"
        self.add(nccl.compute(action))
        self.computes += 1

    def name_receive(self, index: int) -> None:
        """The receive at `index` is for the action about to compute: what the sender must have sent."""
        kind, chunk, mb = self.order[self.computes]
        op = self.ops[index]
        self.ops[index] = nccl.Op(op.what, op.comm, op.peer, (ACT if kind == "F" else GRAD, chunk, mb))


class RecordedWork:
    """What a recorded isend/irecv returns: `wait()` is a stream wait in NCCL, recorded as one."""

    def __init__(self, recorder: Recorder, index: int):
        self.recorder, self.index = recorder, index

    def wait(self) -> None:
        if self.recorder.ops[self.index].what == nccl.RECV:
            self.recorder.name_receive(self.index)
        self.recorder.add(nccl.wait(self.index))


class RecordingPipeComm(PipeComm):
    """The real PipeComm (its channels and peers), with `_isend`/`_irecv` recorded instead of issued."""

    recorder: Recorder

    def send_forward(self, act, to_chunk):
        self._to_chunk = to_chunk
        super().send_forward(act, to_chunk)

    def send_backward(self, grad, to_chunk):
        self._to_chunk = to_chunk
        super().send_backward(grad, to_chunk)

    def _isend(self, x, dst, group):
        kind, _, mb = self.recorder.order[self.recorder.computes - 1]  # the action just computed
        message = (ACT if kind == "F" else GRAD, self._to_chunk, mb)
        return RecordedWork(self.recorder, self.recorder.add(nccl.send(group, dst, message)))

    def _irecv(self, out, src, group):
        return RecordedWork(self.recorder, self.recorder.add(nccl.recv(group, src)))


class RecordingAccelerator:
    """Answers for the CPU as an accelerator would, and records the synchronizes."""

    type, backend, is_accelerator, tracks_memory = "cpu", "nccl", True, True

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def synchronize(self, device):
        self.recorder.add(nccl.sync_device())

    def stream_synchronize(self, device):
        self.recorder.add(nccl.sync_stream())


class DeviceWideMeter(BubbleMeter):
    """The meter before the fix: it synchronised the whole device around each compute section."""

    def _sync(self):
        bench_device.synchronize(self.device)


class DummyChunk(nn.Module):
    """A model chunk that needs no communication: one scalar weight, its forward and backward logged."""

    def __init__(self, recorder: Recorder, index: int, last: bool):
        super().__init__()
        self.recorder, self.index, self.last = recorder, index, last
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.recorder.computed("F", self.index)
        out = x.float() * self.w
        out.register_hook(self._backward_ran)
        return out.sum(-1, keepdim=True).repeat(1, 1, 2) if self.last else out  # logits over 2 "tokens"

    def _backward_ran(self, grad):
        self.recorder.computed("B", self.index)


# --- the executor, rank by rank --------------------------------------------------------------------

LAYOUTS = ("edges", "shared", "single")
"""Channels: "edges" = the fix (PipeComm.build's 2-rank group per directed edge and kind); "shared" =
as shipped on CUDA before (activations on the pp group, gradients on a second pp group); "single" =
one pp group for both (as on gloo before)."""


def _config(name: str, p: int, v: int, m: int) -> RunConfig:
    return RunConfig(backend="native", pp=p, schedule=name, micro_batches=m, virtual_stages=v,
                     micro_batch=1, seq=2, model="tiny", model_overrides=(f"layers={p * v}",))


def _groups(p: int, r: int) -> ProcessGroups:
    """Rank r's ProcessGroups of a pp-only layout, its groups stand-ins (nothing here communicates)."""
    return ProcessGroups(layout=Layout(1, p, 1), rank=r, tp=None, cp=None, pp="pp", dp=None, dp_cp=None,
                         ranks={"tp": [r], "pp": list(range(p)), "dp": [r]})


def _comm(layout: str, groups: ProcessGroups, v: int) -> RecordingPipeComm:
    if layout == "edges":  # the product's own creation loop; each new_group call names a new communicator
        made = itertools.count()
        with mock.patch.object(dist, "new_group", lambda ranks: f"g{next(made)}{tuple(ranks)}"):
            return RecordingPipeComm.build(groups, v)
    pp_ranks = groups.ranks["pp"]
    grad_group = "pp" if layout == "single" else "pp-grad"
    channels = {edge: "pp" if edge[0] == ACT else grad_group for edge in channel_edges(pp_ranks, v)}
    return RecordingPipeComm(pp_ranks, groups.coord.pp, channels)


def record_rank(name: str, p: int, v: int, m: int, r: int, layout: str = "edges", metered: bool = False,
                post_ahead: bool | None = None, device_wide_meter: bool = False) -> list[nccl.Op]:
    """Rank r's calls in one step of the real `Pipeline.run` with the accelerator settings. `post_ahead`:
    None keeps the executor's; `layout`, `device_wide_meter` and `post_ahead=False` replay the old code."""
    recorder, groups, cpu = Recorder(), _groups(p, r), torch.device("cpu")
    with bench_device.installed(RecordingAccelerator(recorder)):
        comm = _comm(layout, groups, v)
        comm.recorder = recorder
        meter = DeviceWideMeter(cpu) if device_wide_meter else None
        cfg = _config(name, p, v, m)
        pipe = Pipeline([nn.Identity()] * v, cfg, groups, cpu, None, comm=comm, meter=meter)
        recorder.order = pipe.order
        pipe.chunks = [DummyChunk(recorder, j, sid == pipe.last_sid) for j, sid in enumerate(pipe.sids)]
        pipe.post_ahead = pipe.post_ahead if post_ahead is None else post_ahead
        batches = [(torch.ones(pipe.act_shape), torch.zeros(pipe.act_shape[:2], dtype=torch.long))] * m
        with pipe.meter.metering() if metered else nullcontext():
            pipe.run(batches)
    assert recorder.computes == len(pipe.order)
    return recorder.ops


def record(name: str, p: int, v: int, m: int, **kw) -> list[list[nccl.Op]]:
    return [record_rank(name, p, v, m, r, **kw) for r in range(p)]


def grid(name: str):
    """(p, v, m): pp 2–4, micro-batches p…4p (multiples of p when interleaved), v 1–2 when interleaved."""
    for p in (2, 3, 4):
        for v in (1, 2) if name == "interleaved" else (1,):
            for m in range(p, 4 * p + 1):
                if name != "interleaved" or m % p == 0:
                    yield p, v, m


def _failures(traces, label: str) -> list[str]:
    out = []
    for communicators in nccl.COMMUNICATORS:
        verdict = nccl.replay(traces, communicators)
        if not verdict.ok:
            out.append(f"{label} ({communicators} communicators): {verdict.explain()}")
    return out


# --- the fix: every schedule completes and matches --------------------------------------------------


@pytest.mark.parametrize("metered", [False, True], ids=["unmetered", "metered"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_completes_and_matches_under_nccl(name, metered):
    failures = []
    for p, v, m in grid(name):
        failures += _failures(record(name, p, v, m, metered=metered), f"{name} pp{p} v{v} m{m}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", SCHEDULES)
def test_posting_just_in_time_completes_too(name):
    """The executor posts each receive one action early (the grid above); on per-edge channels posting
    each one only when its action starts (the old NCCL order) is deadlock-free too: the fix does not
    rest on the look-ahead."""
    failures = []
    for p, v, m in grid(name):
        traces = record(name, p, v, m, metered=True, post_ahead=False)
        failures += _failures(traces, f"{name} pp{p} v{v} m{m}")
    assert not failures, "\n".join(failures)


def test_every_rank_creates_every_channel_in_one_order():
    """new_group is collective: at pp 2 × dp 2 every rank makes both pipelines' groups, in one order."""
    made: list[list[tuple]] = []
    layout = Layout(1, 2, 2)
    for rank in range(layout.world_size):
        calls = []
        groups = ProcessGroups(layout=layout, rank=rank, tp=None, cp=None, pp="pp", dp=None, dp_cp=None,
                               ranks={"pp": layout.group_of(rank, "pp")})
        with mock.patch.object(dist, "new_group", lambda ranks: calls.append(tuple(ranks)) or tuple(ranks)):
            comm = PipeComm.build(groups, virtual_stages=2)
        made.append(calls)
        assert set(comm.channels) == {e for e in channel_edges(groups.ranks["pp"], 2)}
    assert all(calls == made[0] for calls in made) and len(made[0]) == 2 * 4


# --- the old code: the model catches its deadlocks ---------------------------------------------------


def _old(name, p, v, m, layout="shared", metered=True):
    return record(name, p, v, m, layout=layout, metered=metered, post_ahead=False, device_wide_meter=True)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8)])
@pytest.mark.parametrize("layout", ["shared", "single"])
def test_old_layout_deadlocks_interleaved_on_eager_groups(layout, p, m):
    """As shipped, the interleaved schedule deadlocks on one communicator per group (eager init), with
    the meter on or off: pp 2 because both directions share the pair's stream, pp ≥ 3 around the ring."""
    for metered in (False, True):
        verdict = nccl.replay(_old("interleaved", p, 2, m, layout, metered), "group")
        assert verdict.deadlock, (layout, p, m, metered)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_old_layout_deadlocks_interleaved_pp2_even_on_pair_communicators(m):
    assert nccl.replay(_old("interleaved", 2, 2, m, metered=False), "pair").deadlock


def test_one_group_for_both_kinds_deadlocks_1f1b():
    """Why CUDA had a gradient group: with activations and gradients on one channel 1F1B deadlocks."""
    assert nccl.replay(_old("1f1b", 2, 1, 4, "single", metered=False), "group").deadlock
    assert nccl.replay(_old("1f1b", 2, 1, 4, "shared", metered=False), "group").ok


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8)])
def test_device_wide_meter_deadlocks_interleaved_even_on_edge_channels(p, m):
    """F4: a device-wide synchronize waits for the sends in flight, and the metered step deadlocks."""
    traces = record("interleaved", p, 2, m, metered=True, device_wide_meter=True)
    assert nccl.replay(traces, "group").deadlock
    assert nccl.replay(record("interleaved", p, 2, m, metered=True), "group").ok


def test_model_reports_mismatched_messages():
    """A channel whose k-th send is not its k-th receive: NCCL would deliver the wrong tensor."""
    traces = record("1f1b", 2, 1, 2)
    receiver = traces[1]
    first, second = (i for i, op in enumerate(receiver) if op.what == nccl.RECV)
    receiver[first], receiver[second] = receiver[second], receiver[first]  # names swapped, positions kept
    verdict = nccl.replay(traces)
    assert not verdict.deadlock and len(verdict.mismatches) == 2


# --- DeepSpeed's pipeline (its P2P, on WORLD) --------------------------------------------------------


def deepspeed_stage(p: int, m: int, stage: int) -> list[nccl.Op]:
    """One stage's calls under DeepSpeed's TrainSchedule. Its PipelineEngine sends with p2p.send/recv,
    which on torch ≥ 1.8 are dist.send/recv on the default group (WORLD; p2p's own groups are made only
    for older torch): each an op on WORLD's communicator, then work.wait(), a stream wait. The first
    activation send and receive carry the tensor meta first (`_send_tensor_meta`), also on WORLD. The
    reductions and the optimizer step after the last step are left out (every rank runs them last)."""
    from deepspeed.runtime.pipe import schedule as ds
    p2p = {ds.SendActivation: (nccl.send, +1, ACT), ds.RecvActivation: (nccl.recv, -1, ACT),
           ds.SendGrad: (nccl.send, -1, GRAD), ds.RecvGrad: (nccl.recv, +1, GRAD)}
    sched, ops, meta_pending = ds.TrainSchedule(micro_batches=m, stages=p, stage_id=stage), [], {+1, -1}
    for step, cmds in enumerate(sched.steps()):
        mb = sched._step_to_micro_batch(step)[0]
        prev = sched._step_to_micro_batch(step - 1)[0] if step else -1  # what Send* of this step carry
        for cmd in cmds:
            if type(cmd) in p2p:
                call, offset, kind = p2p[type(cmd)]
                messages = [(kind, prev if call is nccl.send else mb)]
                if kind == ACT and offset in meta_pending:  # +1: the first send, -1: the first receive
                    meta_pending.discard(offset)
                    messages.insert(0, ("meta",))
                for message in messages:
                    ops.append(call("world", stage + offset, message))
                    ops.append(nccl.wait(len(ops) - 1))
            elif isinstance(cmd, (ds.ForwardPass, ds.BackwardPass, ds.LoadMicroBatch)):
                ops.append(nccl.compute((type(cmd).__name__, mb)))
    return ops


@pytest.mark.parametrize("p", [2, 3, 4])
def test_deepspeed_train_schedule_completes_and_matches_under_nccl(p, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))  # read at its first import
    failures = []
    for m in range(1, 9):
        traces = [deepspeed_stage(p, m, stage) for stage in range(p)]
        failures += _failures(traces, f"DeepSpeed TrainSchedule pp{p} m{m}")
    assert not failures, "\n".join(failures)
