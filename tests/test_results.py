"""The result row's declaration (bench/results): everything that names columns derives from it, the
builders fill them as declared, and the ids of existing configs stay what the committed baseline holds."""
import json
import re
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.config import RunConfig, help_text
from bench.report import compare
from bench.results import (ALWAYS, COLUMNS, EXACT, NOISY, Compare, Kind, Status, comm_columns, failure_row,
                           markdown_table, measured_row, skipped_row, RankResult)
from bench.sweep.spec import expand, load_sweep
from bench.results.store import to_dataframe

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "results" / "baselines" / "quickstart"


def test_the_row_schema_page_is_the_declaration_and_its_one_copy():
    page = "docs/row-schema.md"
    assert markdown_table() in (ROOT / page).read_text(), f"{page}: regenerate it: python -m bench.results --write"
    header = markdown_table().splitlines()[0]
    copies = [str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
              if header in p.read_text()]
    assert copies == [page], f"the column table belongs in {page} only; also in {copies}"


def test_config_columns_are_runconfig_fields_with_their_help():
    for f in fields(RunConfig):
        col = COLUMNS[f.name]
        assert col.kind == Kind.CONFIG and col.meaning == help_text(f.name)
    assert COLUMNS["seq"].type == "int" and COLUMNS["bucket_mb"].type == "float"
    assert COLUMNS["sequence_parallel"].type == "bool" and COLUMNS["model_overrides"].type == "str"  # JSON list


def test_dimension_families_expand_to_the_row_names():
    assert comm_columns() == [f"comm_{w}_{d}" for w in ("bytes", "wire_bytes", "ops") for d in ("tp", "cp", "pp", "dp", "ep")]
    for name in comm_columns():
        assert COLUMNS[name].compare == COLUMNS[f"pred_{name}"].compare == Compare.EXACT
        assert COLUMNS[name].ranks == "mean" and COLUMNS[f"pred_{name}"].kind == Kind.PREDICTED
    assert COLUMNS["comm_dp_all_reduce_bytes"].unit == "bytes" and not COLUMNS["comm_pp_send_ops"].always


def test_compare_sets_come_from_the_declaration():
    assert set(compare.NOISY) == set(NOISY) == {"step_time_s", "tokens_per_s", "peak_mem_bytes", "bubble_fraction",
                                                   "pred_step_time_abs_error"}
    assert compare.NOISY["tokens_per_s"] == (True, 0.0) and compare.NOISY["peak_mem_bytes"] == (False, 2.0**20)
    assert {"params", "persistent_bytes", "comm_bytes_dp", "pred_flops_per_step"} <= set(EXACT)
    assert "pred_error" not in EXACT and "wall_s" not in EXACT


def test_every_column_of_the_baseline_is_declared():
    df = pd.read_parquet(BASELINE / "results.parquet")
    assert sorted(set(df.columns) - set(COLUMNS)) == []
    assert set(df.status) <= set(Status)


def test_ids_of_existing_configs_stay_those_of_the_baseline():
    """The skipped rows' ids too: they are hashed from every column by the one digest of bench.config."""
    df = pd.read_parquet(BASELINE / "results.parquet")
    exp = expand(load_sweep(ROOT / "sweeps" / "quickstart.yaml"))
    assert {c.run_id for c in exp.runs} == set(df.run_id[df.status == "ok"])
    assert {r["run_id"] for r in exp.skipped} == set(df.run_id[df.status == "skipped"])
    assert {c.config_id for c in exp.runs} == set(df.config_id[df.status == "ok"])


def test_failure_and_skipped_rows_keep_the_config_and_say_why():
    cfg = RunConfig(tp=2, dp=2)
    failed = failure_row(cfg, Status.TIMEOUT, "hung", 3)
    assert failed["status"] == "timeout" and failed["failed_rank"] == 3 and failed["run_id"] == cfg.run_id
    assert skipped_row(cfg, "the launcher cannot place it")["run_id"] == cfg.run_id
    refused = skipped_row({"model": "tiny", "tp": 3}, "tp does not divide the heads")
    assert refused["status"] == "skipped" and refused["tp"] == 3 and refused["run_id"] == refused["config_id"]
    with pytest.raises(AssertionError):
        failure_row(cfg, "skipped", "use skipped_row")
    df = to_dataframe([failed, refused])
    assert set(ALWAYS) <= set(df.columns) and str(df["tp"].dtype) == "Int64"


def _rank(rank: int, peak: int, comm: dict, losses: list, extras: dict) -> RankResult:
    return RankResult(rank=rank, losses=losses, times=[0.1 * (rank + 1), 0.2, 0.3], peak_mem=peak,
                      state={"params": 10 * (rank + 1), "grads": 10, "optimizer": 20}, comm=comm, extras=extras,
                      peak_flops=(1e12, "test") if rank == 0 else None, device_name="cpu")


def test_measured_row_aggregates_ranks_as_declared():
    cfg = RunConfig(pp=2, steps=2, warmup=1)
    ranks = [_rank(0, 100, {"comm_bytes_pp": 8.0, "comm_pp_send_bytes": 8.0}, [None, None, None],
                   {"bubble_fraction": 0.2, "stage_layers": "[1, 1]", "tp_impl": "native"}),
             _rank(1, 300, {}, [2.0, 1.5, 1.0], {"bubble_fraction": 0.4, "stage_layers": "[9]", "tp_impl": "x"})]
    row = measured_row(cfg, ranks)
    assert row["status"] == "ok" and row["error"] is None
    assert row["peak_mem_bytes"] == 300 and json.loads(row["peak_mem_bytes_per_rank"]) == [100, 300]  # max
    assert row["params_bytes"] == 20 and row["persistent_bytes"] == 50  # max over ranks
    assert row["comm_bytes_pp"] == 4.0 and row["comm_pp_send_bytes"] == 4.0  # mean: rank 1 sent nothing
    assert row["comm_bytes_tp"] == 0.0  # every declared group, even without traffic
    assert row["bubble_fraction"] == pytest.approx(0.3) and row["stage_layers"] == "[1, 1]"  # mean; rank 0
    assert row["loss_first"] == 2.0 and row["loss_last"] == 1.0  # the ranks that computed a loss
    assert row["step_time_s"] == pytest.approx(0.2)  # slowest rank per step, then the median
    assert set(row) <= set(COLUMNS), sorted(set(row) - set(COLUMNS))
    assert not [k for k in row if k.startswith("pred_")]  # predicted outside the ranks (estimate.with_predictions)


def test_no_module_spells_the_comm_columns_or_statuses_by_hand():
    pattern = re.compile(r"""f["']comm_\{|comm_(bytes|wire_bytes|ops)_\{dim\}|STATUSES|"config_id" if""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py")
                 if p.parent.name != "results" and pattern.search(p.read_text())]
    assert offenders == []


def test_report_environment_table_shows_declared_environment_columns():
    from bench.report.tables import ENV_COLUMNS
    assert all(COLUMNS[name].kind == Kind.ENVIRONMENT for name, _ in ENV_COLUMNS)


@pytest.mark.parametrize("cfg", [RunConfig(pp=2, micro_batches=2, steps=2, warmup=1),
                                 RunConfig(backend="fsdp", dp=2, steps=2, warmup=1)], ids=["native-pp2", "fsdp-dp2"])
def test_every_column_of_a_real_row_is_declared(pools, cfg):
    """A new column (a backend extra, a measurement) must be declared before a row carries it."""
    row = pools(2).run(cfg)
    assert row["status"] == "ok", row.get("error")
    assert sorted(set(row) - set(COLUMNS)) == []
    df = to_dataframe([row])
    for name in ("bubble_fraction", "dp_buckets", "fsdp_shard", "comm_dp_all_gather_bytes"):
        if name in row:
            assert df[name].dtype == "float64", name
