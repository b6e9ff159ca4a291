"""RunConfig validation: every impossible config fails with a message naming its fields."""
import json
import subprocess
import sys

import pytest

from bench.config import ConfigError, RunConfig


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=3), r"heads \(4\) is not divisible by tp \(3\)"),
    (dict(pp=5), r"layers \(4\) < pp \(5\)"),
    (dict(tp=2, world_size=8), r"tp \(2\) × pp \(1\) × dp \(1\) = 2, but world_size is 8"),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=3), r"micro_batches \(3\) must be a multiple of pp"),
    (dict(pp=2, schedule="interleaved", virtual_stages=3), r"layers \(4\) < pp \(2\) × virtual_stages \(3\)"),
    (dict(virtual_stages=2), "needs schedule interleaved"),
    (dict(backend="deepspeed", pp=2, zero=2), "incompatible with pipeline parallel"),
    (dict(backend="ddp", tp=2), "data parallel only"),
    (dict(fsdp="full"), "applies to backend fsdp only"),
    (dict(backend="fsdp", fsdp="ful"), r"did you mean 'full'"),
    (dict(backend="nccl"), "backend is 'nccl'"),
    (dict(micro_batch=0), "micro_batch must be a positive integer"),
    (dict(seq=64), r"seq \(64\) exceeds"),
    (dict(sequence_parallel=True), "needs tp > 1"),
    (dict(model="gpt5"), "unknown model preset 'gpt5'"),
    (dict(model_overrides=("layerz=2",)), "unknown model field"),
    (dict(dtype="fp16-mixed", device="cpu"), "fp16-mixed is not supported on cpu"),
    (dict(schedule="interleaved", virtual_stages=2), r"virtual_stages \(2\) > 1 needs pp > 1"),
    # what a backend lacks (bench/capabilities.py), named with the fix
    (dict(backend="deepspeed", pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2),
     r"backend deepspeed: virtual_stages \(2\) > 1 is not supported .*use virtual_stages 1"),
    (dict(backend="native", dtype="fp16-mixed"), r"not supported on cpu \(device auto may be cpu: fp16 needs an explicit"),
    (dict(backend="deepspeed", compile=True), r"backend deepspeed: compile is not supported .*drop --compile"),
    (dict(compile=True, warmup=0), r"compile needs warmup ≥ 1"),
])
def test_bad_configs_name_the_fields(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**kwargs)


def test_capabilities_answer_per_backend_without_building_anything():
    from bench.capabilities import CAPABILITIES, can_run, unsupported_reason
    interleaved = RunConfig(pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2)
    assert [b for b in CAPABILITIES if can_run(b, interleaved)] == ["native", "fsdp"]
    fp16 = RunConfig(backend="deepspeed", dtype="fp16-mixed", device="cuda")  # every backend scales the loss
    assert [b for b in CAPABILITIES if can_run(b, fp16)] == list(CAPABILITIES)
    assert [b for b in CAPABILITIES if can_run(b, RunConfig(compile=True))] == ["native", "fsdp", "ddp"]
    assert unsupported_reason(RunConfig(compile=True), "deepspeed").startswith("backend deepspeed: compile")


def test_run_id_stable_and_repeat_aware():
    a, b = RunConfig(tp=2, dp=2), RunConfig(dp=2, tp=2)
    assert a.run_id == b.run_id and len(a.run_id) == 12
    assert a.replace(repeat=1).run_id != a.run_id and a.replace(repeat=1).config_id == a.config_id
    assert a.replace(timeout_s=5).run_id == a.run_id  # limits do not change what is measured
    assert RunConfig.from_dict(json.loads(json.dumps(a.to_dict()))) == a


def test_cli_bad_input_is_one_line_exit_2():
    out = subprocess.run([sys.executable, "-m", "bench.cli", "run", "--tp", "3", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: model heads (4) is not divisible by tp (3); "
                                               "pick tp from the divisors of 4"]
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_test_only_faults_parse_and_combine():
    from bench.config import parse_fault
    assert parse_fault("none") == {}
    assert parse_fault("sgd:1,grad_scale:2") == {"sgd": 1.0, "grad_scale": 2.0}
    assert parse_fault("oom_real") == {"oom_real": None}
    for bad in ("sleep", "raise:1", "grad_scale:x", "nonsense", "sgd:1,"):
        with pytest.raises(ConfigError, match="fault"):
            RunConfig(fault=bad)


def test_fields_are_typed_by_their_annotations_and_documented_by_their_docstrings():
    from pydantic._internal._docs_extraction import extract_docstrings_from_cls

    from bench.config import FIELDS, _field_docs, choices, help_text
    assert help_text("tp") == "tensor-parallel size" and choices("zero") == (0, 1, 2, 3)
    # read from the source as pydantic's use_attribute_docstrings would (it costs every start-up ~50 ms)
    assert _field_docs() == extract_docstrings_from_cls(RunConfig, use_inspect=True) and set(_field_docs()) == set(FIELDS)
    assert choices("fsdp") == ("full", "grad-op", "hybrid", "none") and choices("tp") == ()
    for kwargs, message in ((dict(tp="2"), "tp must be an integer, got '2'"),  # strict: no guessing
                            (dict(compile=1), "compile must be true or false"),
                            (dict(bucket_mb=float("inf")), "bucket_mb must be a finite number"),
                            (dict(tpp=2), r"unknown run config field\(s\) \['tpp'\]; did you mean 'tp'")):
        with pytest.raises(ConfigError, match=message):
            RunConfig(**kwargs)
    assert RunConfig(bucket_mb=50).canonical()["bucket_mb"] == 50  # kept as written: the run id of 50, not 50.0
    with pytest.raises(ConfigError, match="keyword arguments only"):
        RunConfig("tiny")


def test_unchecked_builds_the_same_config_without_a_check():
    cfg = RunConfig(backend="fsdp", dp=2, micro_batches=2)
    assert RunConfig.unchecked(backend="fsdp", dp=2, micro_batches=2) == cfg  # derived defaults filled (fsdp, seq)
    impossible = RunConfig.unchecked(tp=3)  # no check: the planner's candidates check themselves
    assert impossible.tp == 3 and impossible.world == 3


def test_context_parallel_fields():
    cfg = RunConfig(cp=2, dp=2, model="tiny")
    assert cfg.world == 4 and cfg.cp_comm == "ring" and cfg.global_batch == cfg.micro_batch * 2
    assert RunConfig(cp=2, backend="deepspeed").cp_comm == "ulysses"  # each backend's own algorithm
    assert RunConfig(cp=1, cp_comm="ulysses").cp_comm is None  # nothing to split at cp 1
    assert RunConfig(cp=1, cp_comm="ring").run_id == RunConfig().run_id
    assert "cp" not in RunConfig(dp=2).canonical() and RunConfig(cp=2).canonical()["cp"] == 2
    assert cfg.layout.groups("cp") == [[0, 1], [2, 3]]


@pytest.mark.parametrize("fields,message", [
    ({"cp": 3, "seq": 32}, r"cp \(3\) needs seq \(32\) divisible by 2 × cp = 6"),
    ({"cp": 2, "world_size": 4}, r"tp \(1\) × cp \(2\) × pp \(1\) × dp \(1\) = 2, but world_size is 4"),
    ({"cp": 2, "backend": "ddp"}, r"backend ddp has no context parallel: needs cp = 1"),
    ({"cp": 2, "cp_comm": "ulysses"}, r"backend native runs cp_comm ring, not ulysses \(backend deepspeed does\)"),
    ({"cp": 2, "backend": "deepspeed", "cp_comm": "ring"}, r"backend deepspeed runs cp_comm ulysses, not ring"),
])
def test_context_parallel_refusals(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**fields)


def test_ulysses_needs_heads_divisible():
    assert RunConfig().model_config.heads == 4  # tiny: 4 heads, so cp 8 leaves half a head per rank
    with pytest.raises(ConfigError, match=r"cp_comm ulysses needs model heads \(4\) divisible by tp × cp = 8"):
        RunConfig(backend="deepspeed", cp=8, seq=32)
