"""bench history: step changes found by a pure function fed by hand; add/show on real result sets."""
import pytest

from bench.report.history import add, read, series, step_changes
from support.report_runs import result_sets


def test_step_changes_by_hand():
    flat = [100, 101, 99, 100, 102, 98, 100]
    assert step_changes(flat) == []
    step = [100, 101, 99, 100, 130, 131, 129, 130]
    assert step_changes(step) == [4]  # the first point of the new level
    assert step_changes([100, 99, 101, 80, 79, 81, 120, 121, 119], window=3) == [3, 6]
    # one outlier is not a level shift: the windows overlap
    assert step_changes([100, 101, 99, 150, 100, 101, 99]) == []
    # below the threshold
    assert step_changes([100, 100, 100, 105, 105, 105], threshold=0.10) == []
    assert step_changes([100, 100, 100, 105, 105, 105], threshold=0.04) == [3]


@pytest.fixture(scope="module")
def sets(pools, tmp_path_factory):
    return result_sets(pools, tmp_path_factory.mktemp("runs"))


def test_history_add_and_show(sets, tmp_path, monkeypatch, capsys):
    import sys

    from bench.cli import main
    from bench.report.load import load_many
    history = tmp_path / "history.parquet"

    def bench(*args):
        monkeypatch.setattr(sys, "argv", ["bench", *map(str, args)])
        with pytest.raises(SystemExit) as exit_:
            main()
            sys.exit(0)
        out = capsys.readouterr()
        return exit_.value.code or 0, out.out + out.err

    assert bench("history", "add", sets["baseline"], "--history", history)[0] == 0
    # the same rows again: nothing new
    code, out = bench("history", "add", sets["baseline"], "--history", history)
    assert code == 0 and "0 row(s) added" in out
    # a later, slower measurement of the same configs: new run times, same ids
    slowed = load_many([sets["slowed"]])
    slowed["time"] = "2030-01-01T00:00:00+00:00"
    add(slowed, history)
    df = read(history)
    assert {"recorded_at", "recorded_git_sha"} <= set(df.columns) and len(df) == 6 + 3
    cid = slowed["config_id"].iloc[0]
    points = series(df[df["config_id"] == cid], "step_time_s")
    assert len(points) >= 2 and points["value"].iloc[-1] > 0.4
    code, out = bench("history", "show", "--config", cid[:8], "--metric", "step_time_s", "--window", "1",
                      "--history", history, "-o", tmp_path / "h.png")
    assert code == 0 and "step change" in out and (tmp_path / "h.png").stat().st_size > 10_000
    code, out = bench("history", "show", "--history", history)
    assert code == 0 and "native tp1·pp1·dp2" in out
    code, out = bench("history", "show", "--config", "nope", "--history", history)
    assert code == 2 and out.startswith("error: no history rows for config 'nope'")
    code, out = bench("history", "show", "--history", tmp_path / "none.parquet")
    assert code == 2 and "no history yet" in out


def test_history_add_of_a_fragmented_frame_says_nothing(tmp_path):
    """A loaded result set is built column by column (one block per column): `add` must not make pandas
    print its four-line PerformanceWarning on every call."""
    import warnings

    import pandas as pd
    frame = pd.DataFrame({"run_id": ["a"], "time": ["t"], "status": ["ok"]})
    with warnings.catch_warnings():  # building it this way warns too: not what is tested
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        for i in range(120):  # pandas warns past 100 blocks
            frame[f"col{i}"] = [float(i)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.PerformanceWarning)
        added, total = add(frame, tmp_path / "history.parquet")
    assert (added, total) == (1, 1)
