"""No tensor of the suite's own code is made without naming its device (tests/support/device_audit.py):
every backend's trainer is built and trains two steps under the audit, at world 2 on gloo."""
from __future__ import annotations

import pytest

from bench.config import RunConfig

CONFIGS = {
    "native tp 2 sp": dict(backend="native", tp=2, sequence_parallel=True),
    "native pp 2 interleaved": dict(backend="native", pp=2, schedule="interleaved", virtual_stages=2,
                                    micro_batches=2),
    "native dp 2 zero-1": dict(backend="native", dp=2, zero=1),
    "ddp dp 2": dict(backend="ddp", dp=2),
    "fsdp dp 2": dict(backend="fsdp", dp=2, fsdp="full"),
    "fsdp tp 2": dict(backend="fsdp", tp=2, fsdp="full"),
    "deepspeed zero-1": dict(backend="deepspeed", dp=2, zero=1),
    "deepspeed zero-3": dict(backend="deepspeed", dp=2, zero=3),
    "deepspeed pp 2": dict(backend="deepspeed", pp=2, micro_batches=2),
}


def _audited(cfg_dicts: list[dict]) -> list[list[tuple]]:
    from bench.distributed import rank_session
    from bench.worker import trainer_on_rank
    from support.device_audit import ImplicitDeviceAudit

    found = []
    with rank_session("cpu") as device:
        for cfg_dict in cfg_dicts:
            audit = ImplicitDeviceAudit()
            with audit, trainer_on_rank(RunConfig.from_dict(cfg_dict), device) as (trainer, _):
                for step in range(2):
                    trainer.train(trainer.batch(step))
            found.append(sorted(set(audit.found)))
    return found


def test_every_backend_names_the_device_of_every_tensor_it_makes(pools):
    cfgs = [RunConfig(model="tiny", device="cpu", steps=2, warmup=0, **options) for options in CONFIGS.values()]
    found = pools(2).call(_audited, [c.to_dict() for c in cfgs])
    problems = {name: f for rank in found for name, f in zip(CONFIGS, rank) if f}
    assert not problems, problems


def test_the_audit_finds_a_tensor_made_without_a_device():
    """The audit itself: a factory call from the suite's code without a device is found; one with a
    device, one inside the allowed initialiser, and one from torch's own code are not."""
    import torch

    from bench.loss_scale import LossScaler
    from models.gpt import init_value
    from models.config import GPTConfig
    from support.device_audit import REPO, ImplicitDeviceAudit
    audit = ImplicitDeviceAudit()
    with audit:
        torch.zeros(1, device="cpu")
        torch.nn.Linear(2, 2)  # torch's own factories (inside nn.Module construction): not the suite's
        init_value("blocks.0.mlp.fc1.weight", (4, 4), GPTConfig(name="t", vocab=8, seq_len=4, layers=1,
                                                                hidden=4, heads=1), 0)
        LossScaler().scale_loss(torch.ones(1, device="cpu"))
    assert audit.found == []
    planted = compile("torch.zeros(3)", str(REPO / "bench" / "loss_scale.py"), "exec")  # as if the suite's line
    with audit:
        exec(planted, {"torch": torch})
    assert [(where, f) for where, _, f in audit.found] == [("bench/loss_scale.py:1", "zeros")]
