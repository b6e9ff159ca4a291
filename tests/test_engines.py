"""The engine records and the conventions floor (pure): the cost model reads declared properties, not
backend names; a plan's figures are its configs' row predictions; DeepSpeed's buckets hold bucket_mb."""
import re
from pathlib import Path

import pytest

from bench.analysis.estimate import conventions, predict_row
from bench.analysis.hardware import get_hardware
from bench.analysis.planner import plan
from bench.capabilities import CAPABILITIES, ENGINE_CHOICES, ENGINES, Engine
from bench.config import RunConfig
from bench.conventions import bucket_elements, device_peak, grad_bytes, wire_bytes

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("model", "tp", "pp", "dp", "backend", "order", "zero", "fsdp", "schedule", "virtual_stages", "micro_batch",
          "micro_batches", "seq", "dtype", "sequence_parallel", "recompute", "bucket_mb")


def test_every_backend_has_one_engine_record_with_declared_values():
    assert set(ENGINES) == set(CAPABILITIES)
    for eng in ENGINES.values():
        for name, allowed in ENGINE_CHOICES.items():
            assert getattr(eng, name) in allowed
    with pytest.raises(AssertionError, match="data_parallel='flat'"):
        Engine("x", "zero", "zero-stage", "flat")


def test_the_cost_model_compares_no_backend_name():
    """Data tables may name backends (the planner's SHARDINGS); no comparison with a name remains."""
    compare = re.compile(r'(==|!=|\bin)\s*\(?\s*"(native|deepspeed|fsdp|ddp)"|"(native|deepspeed|fsdp|ddp)"\s*(==|!=)')
    hits = [f"{p.name}:{i}" for p in sorted((ROOT / "bench" / "analysis").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert not hits, hits


def test_conventions_floor_imports_nothing_of_bench():
    text = (ROOT / "bench" / "conventions.py").read_text()
    assert not re.search(r"^\s*(from|import) (bench|torch)\b", text, re.M)
    for module in ("metrics/comm.py", "metrics/flops.py"):
        assert "bench.analysis" not in (ROOT / "bench" / module).read_text()


@pytest.mark.parametrize("model,gpus,per_node,hardware,batch", [("small", 4, 8, "cpu", 8), ("gpt2-124m", 64, 8, "h100-sxm", 256)])
def test_a_plans_figures_are_its_configs_row_predictions(model, gpus, per_node, hardware, batch):
    """`bench plan`'s defaults are the rows' (issue 22: small, world 4, fsdp hybrid, micro-batch 2 was
    726 ms and 67.1 MiB in the plan, 705 ms and 54.6 MiB in its dry run)."""
    hw = get_hardware(hardware)
    result = plan(model, gpus, per_node, hardware, batch, top=20, mixed_state=None, activations=None)
    assert result.configs
    for row in result.configs:
        cfg = RunConfig(**{k: row[k] for k in FIELDS}, device="cpu" if hardware == "cpu" else "cuda")
        pred = predict_row(cfg, None, hw, per_node if per_node < gpus else None)
        assert pred["pred_step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-12)
        assert pred["pred_total_bytes"] == pytest.approx(row["total_bytes"], rel=1e-12)


def test_default_conventions_are_the_engines_own():
    assert conventions(RunConfig(backend="deepspeed")) == ("zero", "suite", "suite")
    assert conventions(RunConfig(backend="fsdp")) == ("autocast", "suite", "suite")
    assert conventions(RunConfig(), "zero", "table2") == ("zero", "table2", "table2")


def test_deepspeed_gradients_are_the_module_dtype():
    """DeepSpeed casts the module to the fp16 / bf16 section's dtype, so its gradients (and the reduce
    buckets holding them) are 2 bytes: bucket_mb MiB is bucket_mb · 2^19 elements."""
    assert [grad_bytes(RunConfig(dtype=d, device="cuda")) for d in ("fp32", "bf16-mixed", "fp16-mixed")] == [4, 2, 2]
    cfg = RunConfig(backend="deepspeed", zero=2, dtype="fp16-mixed", device="cuda", bucket_mb=25.0)
    assert bucket_elements(cfg) == 13_107_200


def test_wire_bytes_and_peaks():
    assert wire_bytes("all_reduce", 8.0, 4) == 12.0 and wire_bytes("all_gather", 8.0, 4) == 6.0
    assert wire_bytes("send", 8.0, 2) == 8.0 and wire_bytes("all_reduce", 8.0, 1) == 0.0
    assert device_peak("NVIDIA H100 80GB HBM3").flops["bf16"] == 989e12 and device_peak("cpu") is None
    assert get_hardware("h100-sxm").peak_flops == device_peak("H100").flops
