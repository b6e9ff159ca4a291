"""Pipeline parallelism: the executor of the schedules in `bench.schedule` (GPipe, 1F1B, interleaved).

The model is cut into p·v contiguous *stages* (v = virtual stages per rank, 1 unless interleaved;
`bench.schedule.partition`). Stage k runs on pipeline rank k mod p as that rank's chunk k div p;
the embedding lives on stage 0, the final norm, head and loss on stage p·v − 1.

A schedule is this rank's list of actions ("F" | "B", chunk, micro-batch); one executor runs any
of them. The bubble meter times compute (busy) against the rest of the pipeline phase (waiting
for a neighbour: idle) on one extra step the worker meters, never on a timed one; the ideal bubble
is (p − 1)/(m + p − 1), interleaved (p − 1)/(v·m + p − 1) (bench.schedule simulates it; a test with
the fault `stage_sleep:MS` checks the meter against the simulation).

Messages travel on one channel per directed edge and kind (`bench.native.pipeline_comm`), the same on
every device, so the CPU tests run the code a GPU runs; tests/test_nccl_order.py replays this executor's
call order through a model of NCCL's streams, which gloo cannot show.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext

import torch

from bench import device as bench_device
from bench.config import parse_fault
from bench.native.pipeline_comm import PipeComm
from bench.native.tensor import vocab_parallel_cross_entropy
from bench.schedule import rank_chunks, schedule
from bench.surgery import Stage
from models.gpt import aux_loss_scaled


class BubbleMeter:
    """Busy (compute) and idle (everything else in the pipeline phase) seconds over metered steps.

    Off unless inside `metering()`: the worker meters one extra step of its own, never a timed one,
    because on an accelerator the current stream is synchronised around each compute section (so busy
    time is kernel time, not launch time), which would also stall the timed stream. The current stream,
    not the device: a device-wide synchronize also waits for the sends in flight on NCCL's streams,
    which makes every send blocking, and the metered step of an interleaved schedule with m > p then
    deadlocks (tests/test_nccl_order.py)."""

    def __init__(self, device=None):
        self.busy_s = self.idle_s = 0.0
        self.on, self._step_busy = False, 0.0
        self.device = None if device is None else torch.device(device)

    def _sync(self):
        if self.device is not None:
            bench_device.stream_synchronize(self.device)  # nothing to wait for on the CPU

    @contextmanager
    def metering(self):
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    @contextmanager
    def step(self):
        if not self.on:
            yield
            return
        self._step_busy = 0.0
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.busy_s += self._step_busy
        self.idle_s += time.perf_counter() - t0 - self._step_busy

    @contextmanager
    def compute(self):
        if not self.on:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self._step_busy += time.perf_counter() - t0

    @property
    def fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0


class Pipeline:
    """Runs a schedule over this rank's chunks; returns the micro-batch losses (last stage only).

    `comm` and `meter` default to this rank's channels (created here, collectively) and a BubbleMeter;
    tests pass recording ones to replay the call order through a model of NCCL."""

    def __init__(self, chunks: list[Stage], run_cfg, groups, device, autocast_dtype,
                 comm: PipeComm | None = None, meter: BubbleMeter | None = None):
        self.chunks, self.cfg, self.device = chunks, run_cfg, device
        self.p, self.r, self.v = groups.size("pp"), groups.coord.pp, len(chunks)
        self.tp_group, self.autocast_dtype = groups.tp, autocast_dtype
        self.comm = comm or PipeComm.build(groups, self.v)
        self.order = schedule(run_cfg.schedule, run_cfg.micro_batches, self.p, self.r, self.v)
        self.sids = rank_chunks(self.r, self.p, self.v)
        self.meter = meter or BubbleMeter(device)
        seq = run_cfg.seq // run_cfg.cp // (groups.size("tp") if run_cfg.sequence_parallel else 1)
        self.act_shape = (run_cfg.micro_batch, seq, run_cfg.model_config.hidden)
        self.act_dtype = autocast_dtype or torch.float32
        # Post the next action's receive before this action's compute, on every device: each receive
        # has its channel's stream to itself (one channel per edge and kind), so posting it early cannot
        # hold up a send, which it could while both directions shared the pp group's stream under NCCL
        # (tests/test_nccl_order.py replays both orders; False is the old NCCL order, kept for that).
        self.post_ahead = True
        # test-only (fault stage_sleep:MS): every compute section also sleeps, so stage compute dominates
        self.stage_sleep_s = (parse_fault(run_cfg.fault).get("stage_sleep") or 0.0) / 1e3
        self.loss_scale = 1.0  # fp16-mixed: the trainer's dynamic loss scale (bench.loss_scale)
        self.data_ranks = groups.data_ranks

    @property
    def grad_scale(self) -> float:
        """What backward multiplies every gradient by: the loss scale (fp16-mixed), and 1/(dp·cp), so that
        the sum of the gradients over dp × cp (each cp rank's loss is the mean of an equal share of the
        tokens) is the whole batch's mean with no division after it."""
        return self.loss_scale / self.data_ranks

    def _test_delay(self) -> None:
        if self.stage_sleep_s:
            time.sleep(self.stage_sleep_s)

    def _sid(self, chunk: int) -> int:
        return self.sids[chunk]

    @property
    def last_sid(self) -> int:
        return self.p * self.v - 1

    def _next_chunk(self, chunk: int) -> int:  # the receiver's chunk index for a forward send
        return chunk if self.r < self.p - 1 else chunk + 1

    def _prev_chunk(self, chunk: int) -> int:  # the receiver's chunk index for a backward send
        return chunk if self.r > 0 else chunk - 1

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One step over `batches` (on the device); the last stage's micro-batch losses, each already
        divided by the micro-batch count, as device tensors (never read here: no host sync)."""
        saved, losses, posted = {}, [], {}
        # each micro-batch's MoE aux loss is the mean over its sequences: 1/micro_batches of the step's, and
        # its gradient takes backward's scale (1/(dp·cp), the loss scale) as the loss's does
        with self.meter.step(), self._weight_casts_kept(), aux_loss_scaled(self.grad_scale / self.cfg.micro_batches):
            for i, (kind, chunk, mb) in enumerate(self.order):
                for j in (i, i + 1) if self.post_ahead else (i,):  # the next one's: in flight during compute
                    if j < len(self.order) and j not in posted:
                        posted[j] = self._post_recv(*self.order[j])
                received = posted.pop(i)
                if kind == "F":
                    saved[chunk, mb] = self._forward(chunk, mb, batches, losses, received)
                else:
                    self._backward(chunk, saved.pop((chunk, mb)), received)
            self.comm.wait_sends()
        return losses

    def _weight_casts_kept(self):
        """Mixed precision: keep torch.autocast's low-precision weight copies for the whole step, as
        Megatron and DeepSpeed keep bf16 weights, instead of casting every weight again in every
        micro-batch's forward. Autocast drops its cast cache only on leaving its outermost region, so
        an enclosing (disabled) region keeps it; the weights do not change until the optimizer step."""
        return torch.autocast(self.device.type, enabled=False) if self.autocast_dtype else nullcontext()

    def _post_recv(self, kind: str, chunk: int, mb: int):
        """Post the receive `action` needs (None if it needs none). Both ends of a channel walk it in
        schedule order, so its k-th receive is its k-th send (NCCL matches by position)."""
        sid = self._sid(chunk)
        if kind == "F" and sid != 0:
            return self.comm.post_forward(self.act_shape, self.act_dtype, self.device, chunk)
        if kind == "B" and sid != self.last_sid:
            return self.comm.post_backward(self.act_shape, self.act_dtype, self.device, chunk)
        return None

    def _forward(self, chunk: int, mb: int, batches, losses: list[torch.Tensor], received):
        sid = self._sid(chunk)
        x = batches[mb][0] if sid == 0 else received.wait().requires_grad_()
        with self.meter.compute(), torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                                  enabled=self.autocast_dtype is not None):
            out = self.chunks[chunk](x)
            if sid == self.last_sid:
                out = vocab_parallel_cross_entropy(out, batches[mb][1], self.tp_group)
                out = out / self.cfg.micro_batches
            else:
                out = out.to(self.act_dtype)  # (b, s[/tp], h): what travels to the next stage
            self._test_delay()
        if sid == self.last_sid:
            losses.append(out.detach())
        else:
            self.comm.send_forward(out, self._next_chunk(chunk))
        return x, out

    def _backward(self, chunk: int, saved, received) -> None:
        x, out = saved
        sid = self._sid(chunk)
        grad = None if received is None else received.wait()  # (b, s[/tp], h) like `out`
        if grad is None and self.grad_scale != 1.0:  # the last stage: backward of the scaled loss
            out = out * self.grad_scale  # every gradient × scale
        with self.meter.compute():
            torch.autograd.backward(out, grad)
            self._test_delay()
        if sid != 0:
            self.comm.send_backward(x.grad, self._prev_chunk(chunk))


def stage_layers_json(parts: list[list[int]]) -> str:
    return json.dumps(parts, separators=(",", ":"))
