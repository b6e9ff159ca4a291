"""bench import / export: real configs of Megatron-LM, DeepSpeed and torchtitan (tests/ecosystem/, each with a
`.source` sidecar naming its repository, path and commit) read into RunConfigs, estimated, written back and
read again. Pure: no process group starts."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.analysis.estimate import estimate
from bench.config import RunConfig
from bench.ecosystem import SourceError, deepspeed_launch, export, read_megatron, read_source
from bench.ecosystem.deepspeed import launch_args
from bench.ecosystem.model import canonical, preset_and_overrides

CORPUS = Path(__file__).parent / "ecosystem"

# file → (read options, the values asserted on its config(s), the blocking keys expected)
EXPECTED = {
    "megatron_gpt3_7b_tp1_pp4.yaml": ({}, dict(tp=1, pp=4, dp=2, virtual_stages=8, schedule="interleaved",
                                              micro_batch=1, micro_batches=4, zero=1, order="tp-dp-pp", dtype="bf16-mixed",
                                              seq=8192, model=dict(vocab=131200, kv_heads=8, ffn_hidden=16384,
                                                                   tie_embeddings=False, layers=32)), []),
    "megatron_gpt3_7b_tp4_pp1.yaml": ({}, dict(tp=4, pp=1, dp=2, model=dict(vocab=131584, hidden=4096)), []),
    "megatron_gpt3_175b.sh": (dict(world_size=1536), dict(tp=8, pp=16, dp=12, micro_batch=1, micro_batches=128,
                                                          dtype="fp16-mixed", model=dict(layers=96, hidden=12288,
                                                                                         vocab=51200, tie_embeddings=True)), []),
    "torchtitan_llama3_8b.toml": (dict(world_size=64), dict(backend="fsdp", fsdp="full", tp=1, dp=64, micro_batch=1,
                                                            seq=8192, recompute="selective", model="llama3-8b"),
                                  ["activation_checkpoint.mode"]),
    "torchtitan_llama3_70b.toml": (dict(world_size=64), dict(backend="fsdp", tp=8, dp=8, recompute="full",
                                                             model="llama3-70b"), ["parallelism.tensor_parallel_degree"]),
    "torchtitan_debug_model.toml": (dict(world_size=8), dict(dp=8, micro_batch=8, seq=2048, recompute="full",
                                                             model=dict(vocab=2048, layers=6, hidden=256, ffn_hidden=768)),
                                    ["activation_checkpoint.mode"]),
    "deepspeed_hf_z3.json": (dict(world_size=8, model="gpt2-124m"), dict(backend="deepspeed", zero=3, micro_batch=8,
                                                                         micro_batches=1, dp=8, dtype="fp32"), []),
    "deepspeed_bsz24.json": (dict(model="gpt2-124m"), dict(zero=0, micro_batch=3, dp=8, dtype="fp16-mixed"), []),
    "deepspeed_z3_offload.json": (dict(world_size=4, model="gpt2-124m"), dict(zero=3, dp=4, dtype="fp16-mixed",
                                                                              bucket_mb=768 * 768 * 2 / 2**20), []),
}


def _only(name: str, **options):
    imports = read_source(str(CORPUS / name), **options)
    assert len(imports) == 1
    return imports[0]


def test_every_corpus_file_has_its_source():
    files = [p for p in CORPUS.iterdir() if p.suffix != ".source"]
    assert len(files) >= 6
    for path in files:
        sidecar = (CORPUS / (path.name + ".source")).read_text()
        assert sidecar.startswith("repo: ") and "\npath: " in sidecar and len(sidecar.split("commit: ")[1].strip()) == 40


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_maps_as_expected(name):
    options, values, blocking = EXPECTED[name]
    imp = _only(name, **options)
    preset, overrides = preset_and_overrides(imp.model)  # unchecked: 175B is tied with pp 16, which native refuses
    cfg = RunConfig.unchecked(model=preset, model_overrides=overrides, **imp.values)
    for field, want in values.items():
        if field == "model" and isinstance(want, dict):
            assert {k: getattr(cfg.model_config, k) for k in want} == want
        elif field == "model":
            assert (cfg.model, cfg.model_overrides) == (want, ())
        else:
            assert getattr(cfg, field) == want, field
    assert [e.key for e in imp.blockers] == blocking
    assert cfg.device == "cuda"  # the frameworks train on GPUs
    assert all(e.status in ("mapped", "defaulted", "dropped", "conflict") and e.detail for e in imp.entries)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_config_estimates(name):
    imp = _only(name, **EXPECTED[name][0])
    if imp.model.get("tie_embeddings") and imp.values["pp"] > 1:
        pytest.skip("tied embeddings with pp > 1: the native engine refuses them (issue 26)")
    cfg = imp.config()
    est = estimate(cfg, "h100-sxm")
    assert est["total_bytes"] > est["params_bytes"] > 0 and est["step_time_s"] > 0 and est["world_size"] == cfg.world


def _reread(cfg, tmp_path):
    """`cfg` exported in its backend's framework and imported again."""
    if cfg.backend == "native":
        path = tmp_path / "launch.sh"
        path.write_text(export(cfg, "megatron"))
        return read_source(str(path))
    if cfg.backend == "deepspeed":
        path = tmp_path / "ds.json"
        path.write_text(export(cfg, "deepspeed"))
        return read_source(str(path), world_size=cfg.world, launch_args=tuple(launch_args(cfg)))
    path = tmp_path / "train.toml"
    path.write_text(export(cfg, "torchtitan"))
    return read_source(str(path), world_size=cfg.world)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_config_round_trips(name, tmp_path):
    """import(export(cfg)) == cfg, also for the closest config of one that is not exactly expressible."""
    imp = _only(name, **EXPECTED[name][0])
    if imp.model.get("tie_embeddings") and imp.values["pp"] > 1:
        pytest.skip("tied embeddings with pp > 1: the native engine refuses them (issue 26)")
    cfg = imp.config()
    back = _reread(cfg, tmp_path)
    assert len(back) == 1 and back[0].config() == cfg


LABELS = ["MODEL_ARGS", "MODEL_ARGS_2", "MODEL_ARGS_3", "MODEL_ARGS_4", "MODEL_ARGS_5"]


def test_several_blocks_each_with_their_world_size():
    imports = read_source(str(CORPUS / "megatron_reruns_check_grads.yaml"))
    assert [i.label for i in imports] == LABELS
    by_label = {i.label: i.config() for i in imports}
    assert (by_label["MODEL_ARGS"].world, by_label["MODEL_ARGS_2"].dp, by_label["MODEL_ARGS_3"].tp,
            by_label["MODEL_ARGS_4"].cp, by_label["MODEL_ARGS_5"].pp) == (1, 2, 2, 2, 2)
    for imp in imports:  # kv-channels 128 ≠ 3072 / 32: a head_dim of its own blocks every block
        assert [e.key for e in imp.blockers] == ["--kv-channels"] and not imp.exact
    tp1 = by_label["MODEL_ARGS"]
    assert not tp1.sequence_parallel  # Megatron-LM drops --sequence-parallel at tp 1 ...
    assert any(e.key == "--sequence-parallel" and e.status == "conflict" for e in imports[0].entries)  # ... and says so
    assert by_label["MODEL_ARGS_3"].sequence_parallel


def test_script_conflicts_are_reported_not_fatal():
    imp = _only("megatron_gpt3_175b.sh")  # its launcher gives 8 GPUs for tp 8 × pp 16
    conflicts = {e.key: e.detail for e in imp.entries if e.status == "conflict"}
    assert set(conflicts) == {"world size", "--step-batch-size-schedule"}
    assert imp.values["dp"] == 1


def test_a_conditional_variable_is_refused_by_name():
    with pytest.raises(SourceError, match=r"megatron_llama3_8b_fp8.sh: \$DTYPE_ARGS: is set under a condition"):
        read_source(str(CORPUS / "megatron_llama3_8b_fp8.sh"))


def test_vocab_padding_keeps_megatron_sizes():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "131073"]
    for tp, padded in ((1, 131200), (4, 131584)):
        imp = read_megatron(base + ["--tensor-model-parallel-size", str(tp)], world_size=tp)[0]
        assert imp.config().model_config.vocab == padded
    gpt2 = read_megatron(base[:-4] + ["--vocab-file", "gpt2-vocab.json"], world_size=1)[0]
    assert gpt2.config().model_config.vocab == 50304  # GPT-2's 50,257 padded to 128


def test_rank_order_follows_megatron():
    args = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--vocab-size", "256", "--tokenizer-type", "NullTokenizer",
            "--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
    assert read_megatron(args, world_size=4)[0].config().order == "tp-dp-pp"
    assert read_megatron(args + ["--use-tp-pp-dp-mapping"], world_size=4)[0].config().order == "tp-pp-dp"


@pytest.mark.parametrize("flag, value", [("--qk-layernorm", None), ("--squared-relu", None), ("--num-experts", "8"),
                                         ("--kv-channels", "32"), ("--expert-model-parallel-size", "2")])
def test_a_flag_that_changes_the_math_blocks(flag, value):
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--vocab-size", "256", "--tokenizer-type", "NullTokenizer",
            flag, *([value] if value else [])]
    imp = read_megatron(args, world_size=1)[0]
    assert [e.key for e in imp.blockers] == [flag] and not imp.exact
    neutral = read_megatron(args[:-1 - bool(value)] + ["--kv-channels", "16", "--log-interval", "1"], world_size=1)[0]
    assert neutral.exact  # 64 / 4 = 16: the same head_dim; logging changes nothing


ROUND_TRIPS = [
    RunConfig(model="tiny-llama", backend="native", tp=2, pp=2, dp=2, schedule="interleaved", virtual_stages=2,
              micro_batches=4, dtype="bf16-mixed", zero=1, sequence_parallel=True, recompute="selective"),
    RunConfig(model="tiny", backend="native", tp=1, pp=2, dp=2, order="tp-pp-dp", micro_batches=2, recompute="full"),
    RunConfig(model="tiny", backend="native", cp=2, dp=2, seq=32, bucket_mb=1.5),
    RunConfig(model="tiny-gqa", backend="deepspeed", dp=4, zero=2, micro_batch=1, micro_batches=2, dtype="bf16-mixed",
              order="tp-dp-pp"),
    RunConfig(model="tiny", backend="deepspeed", tp=2, dp=2, zero=3, order="tp-dp-pp",
              ds_set=("zero_optimization.stage3_max_live_parameters=0",)),
    RunConfig(model="llama3-8b", backend="fsdp", dp=8, fsdp="full", micro_batch=1, seq=2048, dtype="bf16-mixed",
              recompute="full", order="tp-dp-pp"),
    RunConfig(model="llama3-8b", backend="fsdp", pp=2, dp=4, fsdp="grad-op", micro_batch=1, micro_batches=4,
              schedule="gpipe", order="tp-dp-pp"),
]


@pytest.mark.parametrize("cfg", ROUND_TRIPS, ids=lambda c: f"{c.backend}-{c.model}-{c.run_id}")
def test_export_then_import_is_the_same_config(cfg, tmp_path):
    back = _reread(cfg, tmp_path)
    assert back[0].config() == canonical(cfg.replace(device="cuda"))


def test_export_refuses_what_the_framework_cannot_say():
    with pytest.raises(SourceError, match="gpipe"):
        export(RunConfig(model="tiny", pp=2, schedule="gpipe"), "megatron")
    with pytest.raises(SourceError, match="backend fsdp"):
        export(RunConfig(model="tiny", backend="fsdp"), "megatron")
    with pytest.raises(SourceError, match="not a torchtitan flavor"):
        export(RunConfig(model="tiny", backend="fsdp"), "torchtitan")


def test_megatron_export_keeps_the_vocab_exact():
    cfg = RunConfig(model="tiny", tp=4, model_overrides=("vocab=131584",), dp=1)
    args = export(cfg, "megatron")
    assert "--make-vocab-size-divisible-by 128" in args and "--use-tp-pp-dp-mapping" in args
    assert "--use-distributed-optimizer" not in args
    launch = deepspeed_launch(RunConfig(model="tiny", backend="deepspeed", dp=2, order="tp-dp-pp"))
    assert launch.startswith("deepspeed --num_gpus 2 pretrain_gpt.py --tensor-model-parallel-size 1")


def test_hf_config_gives_the_shape():
    import tempfile
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "hidden_act": "silu"}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(llama))
        imp = read_source(str(path), world_size=8)[0]
        assert (imp.config().model, imp.config().model_overrides, imp.config().dp, imp.exact) == ("llama3-8b", (), 8, True)
        path.write_text(json.dumps({**llama, "head_dim": 256}))
        assert [e.key for e in read_source(str(path))[0].blockers] == ["head_dim"]


# --- the command line ----------------------------------------------------------------------------------------

def test_import_writes_a_sweep_that_expands_to_the_config(bench, tmp_path):
    from bench.sweep.spec import expand, load_sweep
    source = CORPUS / "megatron_gpt3_7b_tp1_pp4.yaml"
    out = bench("import", source, "-o", tmp_path / "s.yaml")
    assert out.returncode == 0 and "exactly expressible" in out.stdout
    assert "dropped   --clip-grad" in out.stdout and "mapped    --tensor-model-parallel-size" in out.stdout
    runs = expand(load_sweep(tmp_path / "s.yaml")).runs
    assert runs == [read_source(str(source))[0].config()]
    exported = bench("export", "--config", tmp_path / "s.yaml", "--to", "megatron")
    assert exported.returncode == 0 and "--num-layers-per-virtual-pipeline-stage 1" in exported.stdout


def test_import_of_an_inexpressible_config_exits_1(bench, tmp_path):
    out = bench("import", CORPUS / "torchtitan_llama3_8b.toml", "--world-size", "64", "-o", tmp_path / "s.yaml")
    assert out.returncode == 1 and "NOT exactly expressible" in out.stdout and not (tmp_path / "s.yaml").exists()
    assert bench("import", CORPUS / "torchtitan_llama3_8b.toml", "--world-size", "64", "-o", tmp_path / "s.yaml",
                 "--approximate").returncode == 1 and (tmp_path / "s.yaml").exists()
    as_json = json.loads(bench("import", CORPUS / "torchtitan_llama3_8b.toml", "--world-size", "64", "--json").stdout)
    assert not as_json["exact"] and as_json["configs"][0]["config"]["backend"] == "fsdp"


def test_blocks_of_one_model_make_one_sweep(bench, tmp_path):
    source = CORPUS / "megatron_reruns_check_grads.yaml"
    out = bench("import", source, "-o", tmp_path / "s.yaml", "--approximate")  # tp 2 pads the vocab to 50,432
    assert out.returncode == 2 and "2 different models (MODEL_ARGS, MODEL_ARGS_2, MODEL_ARGS_4, MODEL_ARGS_5; " \
        "MODEL_ARGS_3)" in out.stderr and "--block" in out.stderr
    out = bench("import", source, "-o", tmp_path / "s.yaml", "--approximate", "--block", "MODEL_ARGS_2", "--block",
                "MODEL_ARGS_5")
    from bench.sweep.spec import expand, load_sweep
    assert out.returncode == 1 and [(r.dp, r.pp) for r in expand(load_sweep(tmp_path / "s.yaml")).runs] == [(2, 1), (1, 2)]
    one = bench("estimate", "--from", source, "--block", "MODEL_ARGS_3", "--approximate", "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["world_size"] == 2
    assert "--block MODEL_ARGS_9: no such block" in bench("estimate", "--from", source, "--block", "MODEL_ARGS_9").stderr


def test_import_megatron_arguments(bench):
    out = bench("import", "megatron", "--world-size", "4", "--", "--num-layers", "4", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--tensor-model-parallel-size", "2")
    assert out.returncode == 0 and "tp 2 × cp 1 × pp 1 × dp 2 = 4" in out.stdout


def test_from_on_estimate_and_layout(bench):
    source = CORPUS / "megatron_gpt3_7b_tp4_pp1.yaml"
    est = bench("estimate", "--from", source, "--hardware", "h100-sxm", "--json")
    assert est.returncode == 0 and json.loads(est.stdout)["world_size"] == 8
    lay = bench("layout", "--from", source)
    assert lay.returncode == 0 and "tp" in lay.stdout
    blocked = bench("estimate", "--from", CORPUS / "torchtitan_llama3_8b.toml", "--world-size", "64")
    assert blocked.returncode == 2 and "not exactly expressible" in blocked.stderr and "--approximate" in blocked.stderr
    assert bench("estimate", "--from", CORPUS / "torchtitan_llama3_8b.toml", "--world-size", "64",
                 "--approximate").returncode == 0


@pytest.mark.parametrize("make, key", [
    (lambda d: (d / "cut.json", (CORPUS / "deepspeed_z3_offload.json").read_text()[:200]), "line 10 column 5: not valid JSON: it ends early"),
    (lambda d: (d / "notes.txt", "--tensor-model-parallel-size 2\n"), "unknown format; known:"),
    (lambda d: (d / "t.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size $TP\n"), "$TP"),
])
def test_bad_input_is_one_line_naming_file_and_key(bench, tmp_path, make, key):
    path, text = make(tmp_path)
    path.write_text(text)
    out = bench("import", path, "--model", "tiny")
    assert out.returncode == 2 and str(path) in out.stderr and key in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_world_size_that_does_not_divide(bench):
    out = bench("import", CORPUS / "megatron_gpt3_7b_tp4_pp1.yaml", "--world-size", "6")
    assert out.returncode == 2 and "--world-size: 6 is not divisible by tp (4)" in out.stderr
    out = bench("import", CORPUS / "deepspeed_bsz24.json", "--model", "tiny", "--world-size", "6")
    assert out.returncode == 2 and "train_batch_size: 24 ≠ micro-batch (3)" in out.stderr


def test_plan_emits_the_best_config_of_the_framework(bench):
    out = bench("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-sxm", "--global-batch", "64",
                "--top", "1", "--emit", "megatron")
    assert out.returncode == 0 and "MEGATRON_ARGS=(" in out.stdout and "--num-layers 32" in out.stdout


def test_coverage_script_counts_a_checkout(tmp_path):
    cases = tmp_path / "tests/functional_tests/test_cases/gpt"
    for name in ("megatron_gpt3_7b_tp1_pp4.yaml", "megatron_reruns_check_grads.yaml"):
        (cases / name.removesuffix(".yaml")).mkdir(parents=True)
        (cases / name.removesuffix(".yaml") / "model_config.yaml").write_text((CORPUS / name).read_text())
    script = Path(__file__).parents[1] / "benchmarks" / "ecosystem_coverage.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert (result["files"], result["expressible"]) == (2, 1)
    assert result["blockers"] == [["kv-channels N ≠ hidden / heads = N", 1]]
