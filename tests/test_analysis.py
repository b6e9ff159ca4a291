"""Pure tests of the analytic model (no processes): published figures reproduced from our formulas,
the layout explainer, estimate/plan behaviour, hardware profiles and the CLI."""
import json
import time

import pytest
from click.testing import CliRunner

from bench.analysis.comm import comm_summary, tp_traffic, wire_bytes
from bench.analysis.estimate import crosses_nodes, estimate, predict_row
from bench.analysis.explain import explain, ranges
from bench.analysis.hardware import PROFILES, get_hardware, parse_quantity, profile_for_device
from bench.analysis.memory import KORTHIKANTI, layer_activation_bytes, model_state_bytes
from bench.analysis.planner import plan
from bench.analysis.stage_plan import stage_plan
from bench.cli import app
from bench.config import RunConfig
from bench.layout import Layout
from models import PRESETS


# --- literature ----------------------------------------------------------------------------------
@pytest.mark.parametrize("zero,published_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(zero, published_gb):
    # Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    # Figure 1: Ψ = 7.5 B parameters, N_d = 64, K = 12 (mixed-precision Adam): 120 GB baseline,
    # 31.4 GB with P_os, 16.6 GB with P_os+g, 1.9 GB with P_os+g+p per device.
    got = model_state_bytes(7.5e9, dp=64, zero=zero, dtype="bf16-mixed")["total_bytes"] / 1e9
    assert round(got, 1) == pytest.approx(published_gb, abs=0.05)


def test_ptdp_bubble():
    # Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    # Megatron-LM" (PTD-P), §2.2: bubble time / ideal time = (p−1)/m; interleaved (p−1)/(v·m).
    # The cost model simulates the action lists (bench.schedule); tests/test_schedule.py covers a grid.
    def step(**kw):
        return stage_plan(_gpt3(tp=8, pp=8, dp=1, micro_batches=32, **kw)).step
    assert step(schedule="1f1b").bubble_over_ideal == pytest.approx(7 / 32)
    assert step(schedule="interleaved", virtual_stages=4).bubble_over_ideal == pytest.approx(7 / 128)
    # As a share of the step: (p−1)/(m+p−1) = (p−1)/m / (1 + (p−1)/m).
    assert step(schedule="gpipe").bubble_fraction == pytest.approx(7 / 39)
    assert step(schedule="interleaved", virtual_stages=4).bubble_fraction == pytest.approx(7 / (128 + 7))
    assert stage_plan(_gpt3(micro_batches=32)).step.bubble_fraction == 0


def _gpt3(**kw):
    return RunConfig.unchecked(model="gpt3-175b", seq=2048, micro_batch=1, dtype="bf16-mixed", **kw)


def test_ptdp_communication():
    # PTD-P §3.2: tensor parallel costs 2 all-reduces of b·s·h in forward and 2 in backward per
    # layer and micro-batch, so each device moves 8·b·s·h·(t−1)/t elements (ring); pipeline
    # parallel sends b·s·h per micro-batch between consecutive stages, each way.
    m, t, b, s = PRESETS["gpt3-175b"], 8, 1, 2048
    bsh = b * s * m.hidden
    shape = _gpt3(tp=t, pp=96, dp=1, micro_batches=1, backend="deepspeed")  # one layer per stage
    middle = tp_traffic(stage_plan(shape), 48, "zero")
    wire = sum(tr.wire for tr in middle if "block" in tr.what)
    assert wire == pytest.approx(8 * bsh * (t - 1) / t * 2)  # × 2 bytes (bf16)
    pp = comm_summary(stage_plan(_gpt3(tp=1, pp=4, dp=1, micro_batches=8, backend="deepspeed")))
    # 3 boundaries × 8 micro-batches × 2 directions × b·s·h × 2 bytes, averaged over 4 stages
    assert pp["comm_pp_send_bytes"] == pytest.approx(3 * 8 * 2 * bsh * 2 / 4)
    assert wire_bytes("all_reduce", 100, 4) == 150 and wire_bytes("all_gather", 100, 4) == 75


def test_korthikanti_table2_gpt3_175b_t8():
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    # Table 2, for GPT-3 175B (h = 12288, a = 96, s = 2048) with t = 8, per layer, b = 1:
    # Table 2 counts Megatron-LM's unfused attention (KORTHIKANTI); the default model is flash attention.
    def table2(*args, **kwargs):
        return layer_activation_bytes(*args, act=KORTHIKANTI, **kwargs)
    m, s, b, t = PRESETS["gpt3-175b"], 2048, 1, 8
    sbh, extra = s * b * m.hidden, 5 * m.heads * s / m.hidden  # 5as/h = 80
    assert table2(m, b, s) == pytest.approx(sbh * (34 + extra))
    assert table2(m, b, s, t) == pytest.approx(sbh * (10 + 24 / t + extra / t))
    assert table2(m, b, s, t, sp=True) == pytest.approx(sbh / t * (34 + extra))
    assert table2(m, b, s, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert table2(m, b, s, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert table2(m, b, s, recompute="full") == pytest.approx(2 * sbh)
    # §5 / abstract: sequence parallel + selective recomputation cut activation memory by 5×.
    ratio = table2(m, b, s, t) / table2(m, b, s, t, True, "selective")
    assert ratio > 5
    # the default (this suite's GPT: no dropout masks, flash attention) saves the fp32 log-sum-exp per head
    # instead of the 5as/h score terms
    assert layer_activation_bytes(m, b, s, t) == pytest.approx(sbh * (8 + 24 / t) + 4 * m.heads * s * b / t)


def test_interleaved_first_stage_memory():
    # Korthikanti et al. 2022 §4.2.3: with the interleaved schedule the first stage holds
    # L·(1 + (p−1)/(p·v)) layers' worth of activations; 1F1B holds L (p micro-batches × L/p).
    L, p, v = 96, 8, 3  # gpt3-175b

    def first(**kw):
        return stage_plan(_gpt3(pp=p, micro_batches=64, **kw), stages=[0]).ranks[0].layers_in_flight
    assert first(schedule="interleaved", virtual_stages=v) == pytest.approx(L * (1 + (p - 1) / (p * v)))
    assert first(schedule="1f1b") == L
    assert first(schedule="gpipe") == 64 * L / p


# --- layout explainer ----------------------------------------------------------------------------
def test_done_when_layout_64_gpus():
    runner = CliRunner()
    out = runner.invoke(app, ["layout", "--tp", "4", "--pp", "4", "--dp", "4", "--gpus-per-node", "8", "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["warnings"] == []
    assert info["replicas"][0]["stages"][0]["tp_ranks"] == [0, 1, 2, 3]
    assert info["replicas"][1]["stages"][0]["tp_ranks"] == [16, 17, 18, 19]
    assert info["ranks"][17] == {"rank": 17, "node": 2, "dp": 1, "pp": 0, "tp": 1, "cp": 0}
    assert info["groups"]["dp"][0] == [0, 16, 32, 48]
    assert {l["link"] for l in info["links"] if l["dim"] == "tp"} == {"nvlink"}
    assert {l["link"] for l in info["links"] if l["dim"] == "dp"} == {"network"}
    text = runner.invoke(app, ["layout", "--tp", "4", "--pp", "4", "--dp", "4"]).output
    assert "stage 0: tp GPUs 0-3 on node 0" in text and "stage 0: tp GPUs 16-19 on node 2" in text


def test_layout_with_cp_shows_the_chunks_the_rings_and_their_links():
    runner = CliRunner()
    argv = ["layout", "--tp", "2", "--cp", "4", "--dp", "2", "--seq", "1024", "--gpus-per-node", "4"]
    out = runner.invoke(app, [*argv, "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["sequence"]["holds"][1] == {"cp": 1, "chunks": [1, 6], "tokens": [[128, 256], [768, 896]]}
    assert info["replicas"][0]["stages"][2] == {"pp": 0, "cp": 2, "tp_ranks": [4, 5], "nodes": [1], "chunks": [2, 5],
                                               "tokens": [[256, 384], [640, 768]]}
    assert info["groups"]["cp"][0] == [0, 2, 4, 6]
    assert {l["link"] for l in info["links"] if l["dim"] == "cp"} == {"network"}
    assert any(w.startswith("4 of 4 cp rings leave a node (e.g. GPUs 0,2,4,6 on nodes 0-1)") and "tp × cp (8)" in w
               for w in info["warnings"])
    text = runner.invoke(app, argv).output
    assert "tp=2 × cp=4 × pp=1 × dp=2 = 16 GPUs" in text
    assert "stage 0, cp rank 1: tp GPUs 2-3 on node 0, chunks 1 and 6 (tokens 128-255, 768-895)" in text
    assert "cp groups (4 of 4 GPUs, each a ring):" in text and "warning: 4 of 4 cp rings leave a node" in text
    inside = explain(Layout(tp=2, cp=4, dp=2, gpus_per_node=8), seq=1024)
    assert {l["link"] for l in inside["links"] if l["dim"] == "cp"} == {"nvlink"} and inside["warnings"] == []
    plain = runner.invoke(app, ["layout", "--tp", "2", "--pp", "2", "--dp", "2"]).output
    assert "cp" not in plain  # cp = 1 reads as before


def test_layout_warnings():
    info = explain(Layout(tp=16, pp=2, dp=2, gpus_per_node=8))
    assert any("tp groups span nodes" in w for w in info["warnings"])
    assert not any("dp groups stay inside a node" in w for w in info["warnings"])  # dp crosses too
    # pp neighbours across racks: 4 stages of one 8-GPU node each, racks of 2 nodes
    info = explain(Layout(tp=8, pp=4, dp=1, gpus_per_node=8), rack_size=2)
    assert any("8 pipeline neighbour pairs cross racks of 2 nodes" in w for w in info["warnings"])
    assert explain(Layout(tp=8, pp=4, dp=1, gpus_per_node=8), rack_size=4)["warnings"] == []


def test_dp_inside_node_while_tp_crosses():
    # 3 GPUs per node, tp = 2: the tp group {2, 3} straddles nodes 0 and 1 while the dp group
    # {0, 2} sits inside node 0 — the per-layer traffic takes the network, the per-step one NVLink.
    info = explain(Layout(tp=2, pp=1, dp=2, gpus_per_node=3))
    assert any("tp groups span nodes" in w for w in info["warnings"])
    assert any("dp groups stay inside a node (e.g. GPUs 0,2)" in w for w in info["warnings"])


def test_layout_with_model_bytes():
    cfg = RunConfig(model="tiny", tp=2, pp=2, dp=2, micro_batches=4)
    info = explain(Layout(2, 2, 2), cfg=cfg)
    tp = [l for l in info["links"] if l["dim"] == "tp"]
    assert tp and all("all-reduce" in l["ops"] for l in tp)
    per_rank = comm_summary(stage_plan(cfg))["comm_bytes_tp"]
    assert sum(l["bytes_per_step"] for l in tp) / len(tp) == pytest.approx(per_rank)


def test_crosses_nodes_matches_layout():
    for tp, cp, pp, dp, order, g in [(4, 1, 4, 4, "tp-pp-dp", 8), (16, 1, 2, 2, "tp-pp-dp", 8),
                                     (2, 1, 3, 5, "tp-dp-pp", 4), (8, 1, 16, 8, "tp-dp-pp", 8), (3, 1, 2, 4, "tp-pp-dp", 4),
                                     (2, 4, 2, 2, "tp-pp-dp", 8), (2, 2, 3, 2, "tp-cp-dp-pp", 4), (1, 3, 2, 2, "tp-pp-dp", 2),
                                     (4, 4, 1, 2, "tp-dp-pp", 8)]:
        lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, order=order, gpus_per_node=g)
        for dim in ("tp", "cp", "pp", "dp"):
            assert crosses_nodes(tp, pp, dp, order, g, dim, cp) == bool(lay.crossing_groups(dim)), (tp, cp, pp, dp, dim)
    assert ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


# --- estimate ------------------------------------------------------------------------------------
def test_estimate_llama70b_on_h100():
    # a planner-style candidate (what Megatron-LM runs: interleaved, sequence parallel, selective recomputation)
    cfg = RunConfig.unchecked(model="llama2-70b", tp=8, pp=8, dp=16, micro_batch=1, micro_batches=64, dtype="bf16-mixed",
                              seq=4096, sequence_parallel=True, recompute="selective", schedule="interleaved",
                              virtual_stages=5)
    est = estimate(cfg, "h100-sxm", 8)
    assert est["fits"] and 0.2 < est["mfu"] < 0.7
    assert est["step_time_s"] == pytest.approx(est["compute_s"] + est["overhead_s"] + est["exposed_comm_s"] +
                                               est["bubble_s"] + est["optimizer_s"])
    assert est["links"] == {"tp": "nvlink", "pp": "network", "dp": "network"}
    assert est["bubble_fraction"] == pytest.approx(7 / (5 * 64 + 7))
    assert est["total_bytes"] == pytest.approx(sum(est[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                    "activation_bytes", "transient_bytes")))


def test_predict_row_columns():
    row = predict_row(RunConfig(model="tiny", tp=2, pp=2, dp=1, micro_batches=4))
    # measured on the native engine: tiny, fp32, micro-batch 2 (tests/test_analysis_measured.py)
    assert row["pred_comm_bytes_tp"] == 591360 and row["pred_comm_bytes_pp"] == 65536
    assert row["pred_params_bytes"] == 239616
    for key in ("pred_grads_bytes", "pred_optimizer_bytes", "pred_activation_bytes", "pred_total_bytes",
                "pred_comm_wire_bytes_dp", "pred_bubble_fraction", "pred_flops_per_step"):
        assert key in row


# --- hardware ------------------------------------------------------------------------------------
def test_hardware_profiles(tmp_path, monkeypatch):
    assert set(PROFILES) >= {"a100-80gb", "h100-sxm", "h200", "cpu"}
    assert profile_for_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert profile_for_device("cpu") is None
    assert parse_quantity("80GiB", "x") == 80 * 2**30 and parse_quantity("989T", "x") == 989e12
    path = tmp_path / "mine.yaml"
    path.write_text("name: my-gpu\npeak_flops: {bf16: 400T, fp32: 50T}\nmemory_bytes: 48GiB\n"
                    "intra_node_bw: 200GB\ninter_node_bw: 25GB\ngpus_per_node: 4\n")
    hw = get_hardware(str(path))
    assert hw.name == "my-gpu" and hw.peak("bf16-mixed") == 400e12 and hw.gpus_per_node == 4
    monkeypatch.setenv("PARABENCH_HARDWARE", str(path))
    assert get_hardware("my-gpu") == hw
    with pytest.raises(ValueError, match="known profiles: a100-80gb, h100-sxm, h100-hbm2e-500w, h200, cpu"):
        get_hardware("tpu-v9")
    path.write_text("name: x\npeak_flops: {bf16: 1}\nmemory_bytes: 1\nintra_node_bw: 1\ninter_node_bw: 1\n")
    with pytest.raises(ValueError, match="include fp32"):
        get_hardware(str(path))


# --- CLI -----------------------------------------------------------------------------------------
def test_cli_estimate_and_errors():
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "--model", "llama2-70b", "--tp", "8", "--pp", "8", "--dp", "16",
                              "--dtype", "bf16-mixed", "--micro-batch", "1", "--micro-batches", "64",
                              "--sequence-parallel", "--recompute", "selective", "--hardware", "h100-sxm",
                              "--any-engine", "--json"])
    assert out.exit_code == 0, out.output
    est = json.loads(out.output)
    assert {"params_bytes", "activation_bytes_per_layer", "comm_wire_bytes_tp", "tokens_per_s", "mfu"} <= set(est)
    out = runner.invoke(app, ["estimate", "--params", "7.5e9", "--dp", "64", "--zero", "3", "--json"])
    assert json.loads(out.output)["total_bytes"] == pytest.approx(16 * 7.5e9 / 64)
    text = runner.invoke(app, ["estimate", "--model", "tiny", "--hardware", "cpu"]).output
    assert "tokens/s" in text
    eight = [json.loads(runner.invoke(app, ["estimate", "--model", "tiny", "--model-overrides", "layers=8", "--json",
                                            *extra]).output)["params_bytes"] for extra in ([], ["--any-engine"])]
    assert eight[0] == eight[1] == 4 * (232576 + 4 * 49408)  # four more blocks of 49,408 parameters
    # bad input: RunConfig's reason, the known presets / profiles (main() prints these as `error: ...`)
    for args, match in ((["--model", "tiny", "--tp", "3"], "not divisible by tp"),
                        (["--model", "tiny", "--tp", "3", "--any-engine"], "not divisible by tp"),
                        (["--model", "tiny", "--backend", "ddp", "--tp", "2"], "data parallel only"),
                        (["--model", "nope"], "known presets: tiny"),
                        (["--model", "tiny", "--hardware", "tpu"], "known profiles")):
        res = runner.invoke(app, ["estimate", *args])
        assert res.exit_code != 0 and match in str(res.exception)
    # what only a measured run reads is no estimate option (it would be ignored): click refuses it
    res = runner.invoke(app, ["estimate", "--model", "tiny", "--backend", "deepspeed", "--compile"])
    assert res.exit_code == 2 and "No such option '--compile'" in res.output


def test_each_command_offers_only_the_config_options_it_reads():
    from bench.cli.options import MEASUREMENT_FIELDS
    runner = CliRunner()
    flags = {cmd: runner.invoke(app, [cmd, "--help"]).output for cmd in ("run", "estimate", "layout")}
    measured = ["--" + name.replace("_", "-") for name in MEASUREMENT_FIELDS]
    assert {"--fault", "--steps", "--warmup", "--repeat", "--timeout-s", "--profile"} <= set(measured)
    assert all(f in flags["run"] for f in measured)
    for cmd in ("estimate", "layout"):
        assert [f for f in measured if f"{f} " in flags[cmd] or f"{f}/" in flags[cmd]] == [], cmd
        assert "--micro-batches" in flags[cmd] and "--model-overrides" in flags[cmd]


def test_plan_llama70b_1024_h100_fast():
    t0 = time.process_time()  # CPU time: the shared test machine runs other jobs
    result = plan("llama2-70b", 1024, 8, "h100-sxm", 1024, 4096, top=5)
    assert time.process_time() - t0 < 5
    assert len(result.configs) == 5 and result.dropped
    best = result.configs[0]
    assert best["tp"] * best["pp"] * best["dp"] == 1024 and best["tp"] <= 8  # tp stays on NVLink
    assert best["total_bytes"] <= 0.9 * 80 * 2**30
    assert [c["tokens_per_s"] for c in result.configs] == sorted((c["tokens_per_s"] for c in result.configs),
                                                                 reverse=True)
    RunConfig(**{k: best[k] for k in ("model", "tp", "pp", "dp", "backend", "order", "zero", "fsdp", "schedule",
                                      "virtual_stages", "micro_batch", "micro_batches", "seq", "dtype",
                                      "sequence_parallel", "recompute")})  # a valid run config


def test_plan_engines_any_allows_selective_recompute():
    suite = plan("llama2-70b", 64, 8, "h100-sxm", 64, 4096, top=50)
    anyone = plan("llama2-70b", 64, 8, "h100-sxm", 64, 4096, top=50, engines="any")
    # the suite's engines run selective recomputation too (bench.surgery), so the suite's plan offers it
    assert any(c["recompute"] == "selective" and c["backend"] == "native" for c in suite.configs)
    assert any(c["recompute"] == "selective" and c["backend"] == "native" for c in anyone.configs)
    assert anyone.configs[0]["tokens_per_s"] >= suite.configs[0]["tokens_per_s"]


def test_plan_gpt3_175b_4096_fast_and_cli():
    t0 = time.process_time()  # CPU time: the shared test machine runs other jobs
    result = plan("gpt3-175b", 4096, 8, "a100-80gb", 1536, 2048, top=3)
    assert time.process_time() - t0 < 5 and result.configs
    out = CliRunner().invoke(app, ["plan", "--model", "gpt3-175b", "--gpus", "4096", "--hardware", "a100-80gb",
                                   "--global-batch", "1536", "--seq", "2048", "--top", "2", "--json"])
    assert out.exit_code == 0 and len(json.loads(out.output)) == 2
    text = CliRunner().invoke(app, ["plan", "--model", "tiny", "--gpus", "4", "--hardware", "cpu",
                                    "--gpus-per-node", "2", "--global-batch", "8"]).output
    assert "top" in text and "dropped" in text


PLAN_FIELDS = ("model", "tp", "pp", "dp", "backend", "order", "zero", "fsdp", "schedule", "virtual_stages",
               "micro_batch", "micro_batches", "seq", "dtype", "sequence_parallel", "recompute", "bucket_mb")


def _plan_configs(rows, device):
    return [RunConfig(**{k: r[k] for k in PLAN_FIELDS}, device=device) for r in rows]


def test_plan_emit_sweep_round_trips_to_the_same_configs(tmp_path):
    """plan → sweep file → the sweep parser expands it to exactly the top K configs, best first; the file
    passes `bench sweep --dry-run` (a CPU plan: the local launcher can place its runs here)."""
    from bench.sweep.spec import expand, load_sweep
    path = tmp_path / "top.yaml"
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--hardware", "cpu", "--gpus-per-node", "2",
            "--global-batch", "8", "--top", "4"]
    out = CliRunner().invoke(app, [*argv, "--emit-sweep", str(path), "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output[out.output.index("["):])
    text = path.read_text()
    assert text.startswith(f"# written by `bench plan --model tiny --gpus 4 --gpus-per-node 2 --hardware cpu "
                           f"--global-batch 8 --top 4 --json --emit-sweep {path}` on 20")  # the options as declared
    assert "model tiny, 4 GPUs (2 per node), hardware cpu, global batch 8: the top 4 of" in text
    exp = expand(load_sweep(path))
    assert not exp.skipped and [c.run_id for c in exp.runs] == [c.run_id for c in _plan_configs(rows, "cpu")]
    assert len(exp.runs) == 4
    dry = CliRunner().invoke(app, ["sweep", str(path), "--dry-run"])
    assert dry.exit_code == 0 and "4 run(s) to launch, 0 skipped" in dry.output, dry.output


def test_plan_emit_sweep_for_a_gpu_cluster(tmp_path):
    """A GPU plan's file targets its cluster (device cuda): it parses and expands to the same K configs."""
    import yaml

    from bench.analysis.planner import sweep_text
    from bench.sweep.spec import expand, parse_sweep
    result = plan("gpt2-124m", 64, 8, "h100-sxm", 256, top=3)
    text = sweep_text(result, "gpt2-124m", 64, 8, "h100-sxm", 256, "bench plan …", "today")
    spec = parse_sweep(yaml.safe_load(text), "top.yaml")
    exp = expand(spec)
    assert [c.run_id for c in exp.runs] == [c.run_id for c in _plan_configs(result.configs, "cuda")]
    assert all(c.device == "cuda" and c.world == 64 for c in exp.runs)


@pytest.mark.parametrize("model,gpus,batch", [("tiny", 8, 16), ("gpt2-124m", 24, 48)])
def test_plan_validation_caches_agree_with_runconfig(model, gpus, batch):
    """The planner caches each validation layer on the fields it reads; every candidate gets
    RunConfig's own verdict, up to the numbers in the reason (the planner counts reasons without them);
    a rule reading a field the keys miss would fail here."""
    from bench.analysis.planner import (RECOMPUTE, SHARDINGS, _candidate, _fields, _reason_class, _Validator, points,
                                        run_config_reason)
    verdict = lambda reason: reason and _reason_class(reason)  # noqa: E731
    cached, n = _Validator(), 0
    for point, orders, skip in points(model, gpus, batch, PRESETS[model].seq_len, "bf16-mixed", 8):
        for backend, zero, fsdp in [] if skip else SHARDINGS:
            for recompute, order in ((r, o) for r in RECOMPUTE for o in orders):
                options = {"backend": backend, "zero": zero, "fsdp": fsdp, "recompute": recompute}
                shape = _candidate(_fields(point), options, order)
                assert verdict(cached(shape)) == verdict(run_config_reason(shape)), shape
                n += 1
    assert n > 1000


def test_hardware_file_mistakes_name_the_key(tmp_path):
    from bench.typed_yaml import FileError
    good = {"name": "g", "peak_flops": {"fp32": "50T"}, "memory_bytes": "48GiB", "intra_node_bw": 1, "inter_node_bw": 1}
    for patch, message in (({"memory_bytes": "12 parsecs"}, "memory_bytes: cannot read '12 parsecs' as a number"),
                           ({"gpu_per_node": 4}, "gpu_per_node: unknown hardware field; did you mean 'gpus_per_node'?"),
                           ({"gpus_per_node": "four"}, "gpus_per_node: gpus_per_node must be an integer")):
        path = tmp_path / "hw.yaml"
        path.write_text(json.dumps({"profiles": [good, {**good, "name": "h", **patch}]}))  # JSON is YAML
        with pytest.raises(FileError, match=f"^{path}: profiles\\[1\\]\\.{message}"):
            get_hardware(f"{path}:h")
def test_deepspeed_pipeline_splits_what_it_sends_over_tp():
    """DeepSpeed's pipeline engine at tp 2 sends each activation and gradient as a meta tensor plus this
    rank's half, and all-gathers the halves where it needs the whole (tests/test_analysis_measured.py
    checks the same config against a real run); with partitioning off it sends whole tensors."""
    kw = dict(model="tiny", backend="deepspeed", tp=2, pp=2, micro_batch=2, micro_batches=4, zero=1)
    m = RunConfig(**kw).model_config
    x = 2 * m.seq_len * m.hidden * 4  # one fp32 activation (micro_batch, seq, hidden)
    meta = 8 * (1 + 3 + 2 + 3)  # int64: ndim, shape, parts and rank, t + 1 offsets
    split = estimate(RunConfig(**kw))
    whole = estimate(RunConfig(**kw, ds_set=("pipeline.pipe_partitioned=false", "pipeline.grad_partitioned=false")))
    assert whole["comm_pp_send_bytes"] == 4 * x and whole["comm_pp_send_ops"] == 4
    assert split["comm_pp_send_bytes"] == 4 * (x / 2 + meta) and split["comm_pp_send_ops"] == 8
    # stage 0 gathers its output back and the gradient it received, stage 1 the activation: 2 + 1 per micro-batch
    assert split["comm_tp_all_gather_ops"] == (2 + 1) * 4 / 2 and split["comm_tp_all_gather_bytes"] == 6 * x
    assert "comm_tp_all_gather_ops" not in whole or whole["comm_tp_all_gather_ops"] == 0
