"""Shared fixtures. Multi-rank tests share warm rank pools per world size (start-up is most of a
small run on this machine); a pool whose run failed restarts by itself."""
import subprocess
import sys

import pytest

from bench.spawn import RankPool


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Each test has its own empty cache, never the user's: a profile calibrated there (by `bench calibrate`
    or by an earlier test's sweep) would change every later prediction."""
    monkeypatch.delenv("PARABENCH_PROFILES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def pools():
    cache: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in cache:
            cache[world] = RankPool(world)
        return cache[world]

    yield get
    for pool in cache.values():
        pool.close()


@pytest.fixture
def bench(capsys, monkeypatch):
    """`bench ARGS…` as a user runs it (bench.cli.main: its error handling and exit status), in this
    process: a new interpreter per call costs seconds of imports on this machine."""
    from bench.cli import main

    def call(*args):
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["bench", *map(str, args)])
        with pytest.raises(SystemExit) as exit_:
            main()
            sys.exit(0)
        out = capsys.readouterr()
        assert "Traceback" not in out.err, out.err
        return subprocess.CompletedProcess(args, exit_.value.code or 0, out.out, out.err)
    return call
