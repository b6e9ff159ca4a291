"""The bad-input corpus: every malformed number, path, file and row a user can hand `bench` is refused
with exit 2 and one short message naming the key, value or file, never a traceback.

Cases run in-process (`bench.cli.main(argv)`, output captured) so the corpus stays fast; a few run as
real subprocesses. Generated cases: every bounded numeric option or sweep key × a handful of values that
cannot be right; hand-written ones: files of the wrong kind (tests/bad_inputs/ and files made below).
"""
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import click
import pytest

from bench.cli import app, main
from bench.config import RunConfig, bounded, field_reason
from bench.results import skipped_row
from bench.results.store import ResultStore

INPUTS = Path(__file__).resolve().parent / "bad_inputs"
BAD_VALUES = ("0", "-1", "nan", "inf", "1e30", "abc", "true")
YAML_VALUES = {"0": "0", "-1": "-1", "nan": ".nan", "inf": ".inf", "1e30": "1.0e+30", "abc": "abc", "true": "true"}
NUMBER_FIELDS = [f.name for f in fields(RunConfig) if bounded(f.name)]


def _valid(name: str, text: str) -> bool:
    """A value of the generated grid that is in fact fine for this field (0 warm-up steps, seed 0)."""
    return text == "0" and field_reason(name, 0) is None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --- the cases: (id, argv with {inp} and {d} for the inputs and a scratch folder, texts the message names) --

CASES: list[tuple[str, list[str], list[str]]] = []


def case(id_: str, argv: list[str], *names: str) -> None:
    CASES.append((id_, argv, list(names)))


for name in NUMBER_FIELDS:  # run: every bounded RunConfig option × bad values
    for text in BAD_VALUES:
        if not _valid(name, text):
            case(f"run-{name}={text}", ["run", _flag(name), text], _flag(name))
for name in NUMBER_FIELDS:  # sweep: the same fields as sweep-file keys (written to {d} by the fixture)
    for text in BAD_VALUES:
        if not _valid(name, text):
            case(f"sweep-base.{name}={text}", ["sweep", f"{{d}}/base-{name}-{text}.yaml", "--dry-run"],
                 f"base-{name}-{text}.yaml", f"base.{name}")
for flag in ("--tp", "--cp", "--pp", "--dp", "--ep", "--gpus-per-node", "--rack-size"):
    for text in BAD_VALUES:
        case(f"layout{flag}={text}", ["layout", flag, text], flag)
# a combination a command cannot honour: an option it would ignore, or one it does not take
case("layout-engine-option-without-model", ["layout", "--tp", "2", "--micro-batch", "4"], "--micro-batch", "--model")
case("estimate-params-with-tp", ["estimate", "--params", "7e9", "--tp", "2"], "--tp", "--params")
case("estimate-any-engine-with-device", ["estimate", "--model", "tiny", "--any-engine", "--device", "cpu"],
     "--device", "--any-engine")
for flag, value in (("--fault", "raise"), ("--steps", "3"), ("--warmup", "1"), ("--repeat", "1"),
                    ("--timeout-s", "5"), ("--profile", None), ("--compile", None), ("--seed", "1")):
    for command in ("estimate", "layout"):
        case(f"{command}-takes-no{flag}", [command, "--model", "tiny", flag, *([value] if value else [])], flag)
case("layout-ep-not-dividing-dp", ["layout", "--dp", "4", "--ep", "3"], "ep (3)", "dp (4)")
case("run-ep-on-a-dense-model", ["run", "--dp", "2", "--ep", "2"], "ep (2)", "dense", "experts")
case("layout-ep-on-a-dense-model", ["layout", "--model", "tiny", "--dp", "2", "--ep", "2"], "ep (2)", "dense")
case("layout-world-size-contradicts", ["layout", "--tp", "2", "--pp", "2", "--dp", "2", "--world-size", "4"],
     "--world-size")
PLAN = ["plan", "--model", "tiny", "--gpus", "8", "--hardware", "cpu", "--global-batch", "8"]
for flag in ("--gpus", "--gpus-per-node", "--global-batch", "--seq", "--top", "--memory-fraction"):
    for text in BAD_VALUES:
        case(f"plan{flag}={text}", [*PLAN, flag, text], flag)
for text in BAD_VALUES:
    case(f"estimate--params={text}", ["estimate", "--params", text, "--dp", "8", "--zero", "3"], "--params")
    case(f"estimate--dp={text}", ["estimate", "--params", "7e9", "--dp", text], "--dp")

for text in BAD_VALUES:  # calibrate: refused before any rank starts
    case(f"calibrate--world={text}", ["calibrate", "--quick", "--world", text], "--world")
case("calibrate--world-beyond", ["calibrate", "--world", "65"], "--world")
# validate: the published-results file
BAD = Path(__file__).parent / "bad_inputs"
case("validate-missing-file", ["validate", "--published", "/nonexistent/published.yaml", "--figure", ""],
     "/nonexistent/published.yaml")
case("validate-folder", ["validate", "--published", str(BAD), "--figure", ""], str(BAD))
case("validate-unknown-key", ["validate", "--published", str(BAD / "published" / "unknown_key.yaml"),
                              "--figure", ""], "unknown_key.yaml", "colour")
case("validate-not-utf8", ["validate", "--published", str(BAD / "published" / "latin1.yaml"), "--figure", ""],
     "latin1.yaml")

# run: values no type catches, only the rules
case("run-fault-sleep-abc", ["run", "--fault", "sleep:abc"], "sleep:abc")
case("run-fault-sleep-negative", ["run", "--fault", "sleep:-5"], "sleep:-5")
case("run-fault-unknown", ["run", "--fault", "explode"], "explode")
case("run-override-not-int", ["run", "--model-overrides", "layers=abc"], "layers")
case("run-override-zero", ["run", "--model-overrides", "layers=0"], "layers")
case("run-override-unknown", ["run", "--model-overrides", "depth=4"], "depth")
case("run-override-no-equals", ["run", "--model-overrides", "layers"], "layers")
case("run-world-beyond-machine", ["run", "--dp", "100000"], "world size 100000")
case("run-world-size-mismatch", ["run", "--dp", "2", "--world-size", "3"], "world_size")
case("run-unknown-model", ["run", "--model", "gpt9"], "gpt9")
# context parallel: each rule names the field and the fix
case("run-cp-seq-not-in-2cp-chunks", ["run", "--cp", "3"], "cp (3)", "seq (32)", "2 × cp = 6")
case("run-cp-ulysses-heads", ["run", "--backend", "deepspeed", "--tp", "2", "--cp", "4"], "cp_comm ulysses",
     "heads (4)", "tp × cp = 8")
case("run-cp-on-ddp", ["run", "--backend", "ddp", "--cp", "2"], "backend ddp has no context parallel", "cp = 1")
case("run-cp-comm-backend-lacks", ["run", "--cp", "2", "--cp-comm", "ulysses"], "cp_comm", "backend deepspeed does")
case("run-cp-comm-unknown", ["run", "--cp", "2", "--cp-comm", "rings"], "--cp-comm", "rings")
case("run-world-size-with-cp", ["run", "--cp", "2", "--dp", "2", "--world-size", "2"],
     "tp (1) × cp (2) × pp (1) × dp (2) = 4", "world_size is 2")
case("estimate-cp-on-ddp", ["estimate", "--model", "tiny", "--backend", "ddp", "--cp", "2"], "no context parallel")
case("layout-cp-seq-not-in-2cp-chunks", ["layout", "--cp", "2", "--seq", "6"], "--seq", "seq (6)", "2 × cp = 4")
case("layout-seq-without-cp", ["layout", "--seq", "8"], "--seq", "--cp")
case("layout-world-size-with-cp", ["layout", "--cp", "2", "--dp", "2", "--world-size", "2"],
     "tp (1) × cp (2) × pp (1) × dp (2) = 4", "--world-size")
case("run-debug-launcher-world-2", ["run", "--launcher", "debug", "--dp", "2"], "world size 1 only, not 2")

# sweep files: hand-written (tests/bad_inputs/sweeps)
for file, named in {"steps_huge": "base.steps", "timeout_huge": "base.timeout_s", "world_100000_local": "world_size",
                    "world_size_beyond_bounds": "world_size: world_size must be ≤ 1,000,000",
                    "repeats_huge": "repeats: must be ≤ 1,000", "bom_then_nan": "base.bucket_mb", "latin1": "UTF-8",
                    "binary": "binary", "truncated": "malformed YAML", "a_list": "mapping",
                    "fault_sleep_abc": "base.fault", "dp_zero_in_grid": "grid.dp[1]",
                    "bucket_inf_in_grid": "grid.bucket_mb[1]", "slurm_poll_nan": "launcher.poll_s",
                    "slurm_mem_negative": "launcher.mem_gb", "prune_factor_text": "prune.slower_than_best",
                    "prune_a_list": "prune: must be a mapping"}.items():
    case(f"sweep-file-{file}", ["sweep", f"{{inp}}/sweeps/{file}.yaml", "--dry-run"], f"{file}.yaml", named)
case("sweep-file-is-a-folder", ["sweep", "{d}/folder.yaml", "--dry-run"], "folder.yaml")
case("sweep-file-missing", ["sweep", "{d}/missing.yaml", "--dry-run"], "missing.yaml")
case("sweep-file-empty", ["sweep", "{d}/empty.yaml", "--dry-run"], "empty.yaml")
case("sweep-out-is-a-file", ["sweep", "{d}/ok.yaml", "--out", "{d}/a-file.txt"], "a-file.txt")
case("sweep-max-parallel-zero", ["sweep", "{d}/ok.yaml", "--max-parallel", "0"], "--max-parallel")
for file, named in {"ranks_zero": "ranks_per_node", "poll_negative": "poll_s"}.items():
    case(f"sweep-profile-{file}", ["sweep", "{d}/ok.yaml", "--launcher", "slurm", "--profile",
                                   f"{{inp}}/profiles/{file}.yaml", "--dry-run"], f"{file}.yaml", named)
case("sweep-resume-out-holds-rows", ["sweep", "{d}/ok.yaml", "--out", "{d}/good"], "--resume")
case("sweep-hardware-unknown", ["sweep", "{d}/ok.yaml", "--hardware", "nosuch", "--dry-run"], "nosuch")
case("sweep-hardware-with-slurm", ["sweep", "{d}/ok.yaml", "--launcher", "slurm", "--hardware", "cpu", "--dry-run"],
     "--hardware")

# hardware files for estimate and plan
for file, named in {"memory_negative": "memory_bytes", "peak_nan": "peak_flops.fp32",
                    "gpus_per_node_float": "gpus_per_node", "efficiency_above_one": "compute_efficiency",
                    "bandwidth_text": "intra_node_bw", "malformed": "malformed YAML", "not_utf8": "UTF-8"}.items():
    case(f"estimate-hardware-{file}", ["estimate", "--model", "tiny", "--hardware", f"{{inp}}/hardware/{file}.yaml"],
         f"{file}.yaml", named)
    case(f"plan-hardware-{file}", ["plan", "--model", "tiny", "--gpus", "8", "--global-batch", "8",
                                   "--hardware", f"{{inp}}/hardware/{file}.yaml"], f"{file}.yaml", named)
case("estimate-hardware-folder", ["estimate", "--model", "tiny", "--hardware", "{d}/folder.yaml"], "folder.yaml")
case("estimate-hardware-missing", ["estimate", "--model", "tiny", "--hardware", "{d}/missing.yaml"], "missing.yaml")
case("plan-hardware-unknown", [*PLAN[:-4], "--hardware", "tpu-v9", "--global-batch", "8"], "tpu-v9")

# result rows: hand-written files and generated ones (one declared column holding what its type cannot)
ROW_FILES = ("null", "list", "string", "no_run_id", "truncated", "not_utf8")
ROW_EDITS = {"steps-1e30": {"steps": 10**30}, "status-unknown": {"status": "exploded"}, "run_id-number": {"run_id": 5},
             "schema-text": {"SCHEMA_VERSION": "1"}, "tp-text": {"tp": "two"}, "mfu-text": {"mfu": "fast"},
             "sequence_parallel-text": {"sequence_parallel": "yes"}, "ok-without-time": {"status": "ok"},
             "skipped-without-error": {"error": None}}
READERS = {"results": ["results", "{rows}"], "report": ["report", "{rows}", "-o", "{d}/report"],
           "compare": ["compare", "{d}/good", "{rows}"], "history-add": ["history", "add", "{rows}", "--history",
                                                                      "{d}/history.parquet"]}
for reader, argv in READERS.items():
    for name in (*ROW_FILES, *ROW_EDITS):
        case(f"{reader}-row-{name}", [a.replace("{rows}", f"{{d}}/rows-{name}") for a in argv],
             f"rows-{name}/runs/", "not a result row")
for reader, argv in READERS.items():  # the row file given directly, and parquet files of the wrong kind
    case(f"{reader}-truncated-parquet", [a.replace("{rows}", "{d}/truncated.parquet") for a in argv],
         "truncated.parquet")
    case(f"{reader}-foreign-parquet", [a.replace("{rows}", "{d}/foreign.parquet") for a in argv], "foreign.parquet")
    case(f"{reader}-text-as-parquet", [a.replace("{rows}", "{d}/a-file.txt") for a in argv], "a-file.txt")
    case(f"{reader}-parquet-tp-text", [a.replace("{rows}", "{d}/tp-text.parquet") for a in argv], "tp-text.parquet",
         "column tp")
    case(f"{reader}-parquet-bool-number", [a.replace("{rows}", "{d}/bool-number.parquet") for a in argv],
         "bool-number.parquet", "column sequence_parallel")
    case(f"{reader}-empty-folder", [a.replace("{rows}", "{d}/empty-folder") for a in argv], "empty-folder")
    case(f"{reader}-missing", [a.replace("{rows}", "{d}/nowhere") for a in argv], "nowhere")
case("results-row-json-null", ["compare", "{d}/good", "{inp}/rows/null.json"], "null.json")
case("report-out-is-a-file", ["report", "{d}/good", "-o", "{d}/a-file.txt"], "a-file.txt")
case("compare-threshold-nan", ["compare", "{d}/good", "{d}/good", "--threshold", "nan"], "--threshold")
case("compare-threshold-negative", ["compare", "{d}/good", "{d}/good", "--threshold", "-5%"], "--threshold")
case("compare-threshold-text", ["compare", "{d}/good", "{d}/good", "--threshold", "abc"], "--threshold")
case("compare-metric-threshold-inf", ["compare", "{d}/good", "{d}/good", "--metric-threshold", "mfu=inf"],
     "--metric-threshold")
case("compare-baseline-meta-null", ["compare", "{d}/meta-null", "{d}/good"], "baseline.json")
case("compare-baseline-meta-not-json", ["compare", "{d}/meta-broken", "{d}/good"], "baseline.json")
case("compare-baseline-missing", ["compare", "{d}/nowhere", "{d}/good"], "nowhere")
case("history-show-folder", ["history", "show", "--history", "{d}/empty-folder"], "empty-folder")
case("history-show-truncated", ["history", "show", "--history", "{d}/truncated.parquet"], "truncated.parquet")
case("history-show-foreign", ["history", "show", "--history", "{d}/foreign.parquet"], "foreign.parquet")
case("history-show-not-a-history", ["history", "show", "--history", "{d}/not-history.parquet"], "not-history.parquet",
     "time")
case("history-show-missing", ["history", "show", "--history", "{d}/nowhere.parquet"], "nowhere.parquet")
case("history-show-window-zero", ["history", "show", "--window", "0"], "--window")
case("history-show-threshold-inf", ["history", "show", "--threshold", "inf"], "--threshold")
case("history-add-into-folder", ["history", "add", "{d}/good", "--history", "{d}/empty-folder"], "empty-folder")


# --- the files the cases read ----------------------------------------------------------------------------


def _row(**edits) -> dict:
    return {**skipped_row(RunConfig(), "a reason"), **edits}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    for name in NUMBER_FIELDS:
        for text in BAD_VALUES:
            axis = "pp" if name == "tp" else "tp"  # any other axis: a key is an axis or a base value, not both
            (d / f"base-{name}-{text}.yaml").write_text(
                f"grid: {{{axis}: [1]}}\nbase: {{{name}: {YAML_VALUES[text]}}}\n")
    (d / "folder.yaml").mkdir()
    (d / "empty-folder").mkdir()
    (d / "empty.yaml").write_text("")
    (d / "ok.yaml").write_text("grid: {tp: [1]}\n")
    (d / "a-file.txt").write_text("not a table\n")
    good = ResultStore(d / "good")
    for seed in (0, 1):
        good.write(skipped_row(RunConfig(seed=seed), "a reason"))
    good.write_parquet()
    for name in ROW_FILES:
        runs = d / f"rows-{name}" / "runs"
        runs.mkdir(parents=True)
        (runs / f"{name}.json").write_bytes((INPUTS / "rows" / f"{name}.json").read_bytes())
    for name, edits in ROW_EDITS.items():
        runs = d / f"rows-{name}" / "runs"
        runs.mkdir(parents=True)
        (runs / "abc123.json").write_text(json.dumps(_row(**edits)))
    parquet = (d / "good" / "results.parquet").read_bytes()
    (d / "truncated.parquet").write_bytes(parquet[: len(parquet) // 2])
    import pandas as pd
    pd.DataFrame({"x": [1, 2]}).to_parquet(d / "foreign.parquet")
    table = pd.read_parquet(d / "good" / "results.parquet")
    table.assign(tp=table["tp"].astype(str)).to_parquet(d / "tp-text.parquet")
    table.assign(sequence_parallel=1.5).to_parquet(d / "bool-number.parquet")
    table[["run_id", "config_id", "status"]].to_parquet(d / "not-history.parquet")
    for name, text in (("meta-null", "null"), ("meta-broken", "{")):
        (d / name).mkdir()
        (d / name / "baseline.json").write_text(text)
        (d / name / "results.parquet").write_bytes(parquet)
    return d


def _bench(argv: list[str], capsys) -> tuple[int, str]:
    """`bench ARGV` in this process: (exit status, stdout + stderr)."""
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def _assert_refused(code: int, output: str, names: list[str]) -> None:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert code == 2, output
    assert "Traceback" not in output, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output  # the issue allows three; we print one
    for name in names:
        assert name in output, f"{name!r} not named in: {output}"


@pytest.mark.parametrize("argv, names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused(argv, names, scratch, capsys, monkeypatch):
    monkeypatch.chdir(scratch)
    argv = [a.format(inp=INPUTS, d=scratch) for a in argv]
    _assert_refused(*_bench(argv, capsys), names)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_a_bad_local_rank_limit_is_refused_not_defaulted(value, scratch, capsys, monkeypatch):
    monkeypatch.setenv("PARABENCH_MAX_LOCAL_RANKS", value)
    _assert_refused(*_bench(["sweep", str(scratch / "ok.yaml"), "--dry-run"], capsys),
                    ["PARABENCH_MAX_LOCAL_RANKS", repr(value)])


def test_the_corpus_is_large_and_covers_every_command():
    commands = {argv[0] for _, argv, _ in CASES}
    assert len(CASES) >= 100
    assert commands >= {"run", "sweep", "results", "report", "compare", "history", "layout", "estimate", "plan"}
    for name in ("calibrate", "validate"):  # commands other branches add: they need cases here
        assert name not in app.commands or name in commands, f"bench {name} has no bad-input cases"


# --- beyond the corpus: resume past a corrupt row, the unknown-error path, real subprocesses --------------


def test_resume_moves_a_corrupt_row_aside_and_reruns_its_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "one.yaml"
    sweep.write_text("grid: {seed: [0, 1]}\nbase: {steps: 1, warmup: 0}\nlauncher: debug\n")
    out = tmp_path / "out"
    code, output = _bench(["sweep", str(sweep), "--out", str(out), "--no-progress", "--no-calibrate"], capsys)
    assert code == 0, output
    first, second = sorted((out / "runs").glob("*.json"))
    kept = second.read_bytes()
    first.write_text("null")
    code, output = _bench(["sweep", str(sweep), "--out", str(out), "--resume", "--no-progress", "--no-calibrate"], capsys)
    assert code == 0 and "Traceback" not in output, output
    assert f"{first}: not a result row: a JSON null, not an object" in output
    assert first.with_name(first.name + ".corrupt").read_text() == "null"  # moved aside, not deleted
    assert json.loads(first.read_text())["status"] == "ok"  # rerun
    assert second.read_bytes() == kept  # the good row untouched
    assert "ok 1" in output and "1 resumed" in output


def test_an_unknown_error_prints_one_line_and_saves_its_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    @click.command("explode-for-test")
    def explode():
        {}["no such key"]  # a bug of ours, not a user's mistake

    app.add_command(explode)
    try:
        code, output = _bench(["explode-for-test"], capsys)
    finally:
        app.commands.pop("explode-for-test")
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert code == 3 and len(lines) == 1 and "Traceback" not in output, output
    saved = Path(lines[0].split("traceback saved to ")[1].split(";")[0])
    assert saved.parent == tmp_path / "parabench" / "tracebacks" and "Traceback" in saved.read_text()


@pytest.mark.parametrize("argv, names", [
    (["run", "--timeout-s", "-1", "--steps", "2"], ["--timeout-s"]),
    (["sweep", str(INPUTS / "sweeps" / "binary.yaml")], ["binary.yaml"]),
    (["results", str(INPUTS / "rows")], ["rows"]),
], ids=["run-timeout", "sweep-binary", "results-folder-of-json"])
def test_real_subprocesses(argv, names, tmp_path):
    bench = str(Path(sys.executable).parent / "bench")
    done = subprocess.run([bench, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    _assert_refused(done.returncode, done.stdout + done.stderr, names)


def test_sweep_exit_status_with_failed_runs(tmp_path, capsys, monkeypatch):
    """A failed run is a result (exit 0); --fail-on-failure makes it the sweep's failure (exit 1)."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "f.yaml"
    sweep.write_text("grid: {fault: [none, raise]}\nbase: {steps: 1, warmup: 0}\nlauncher: debug\n")
    code, output = _bench(["sweep", str(sweep), "--out", "a", "--no-progress", "--no-calibrate"], capsys)
    assert code == 0 and "failed 1" in output, output
    code, output = _bench(["sweep", str(sweep), "--out", "a", "--resume", "--no-progress", "--no-calibrate", "--fail-on-failure"],
                          capsys)
    assert code == 1 and "1 run(s) in a failed" in output, output


def test_undeclared_columns_of_any_type_reach_the_parquet_as_text(tmp_path, capsys):
    """Columns the schema does not declare (a newer backend's extras) may mix types or overflow int64:
    the parquet writer gets them as text, never a value its column cannot hold."""
    store = ResultStore(tmp_path / "out")
    store.write({**skipped_row(RunConfig(), "a reason"), "extra": 10**30, "mixed": [1, 2]})
    store.write({**skipped_row(RunConfig(seed=1), "a reason"), "extra": 10**30, "mixed": "text"})
    code, output = _bench(["results", str(tmp_path / "out"), "--quiet"], capsys)
    assert code == 0, output
    import pandas as pd
    df = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert sorted(df["mixed"]) == ["[1, 2]", "text"] and set(df["extra"]) == {str(10**30)}
