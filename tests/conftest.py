"""Shared fixtures. Multi-rank tests share warm rank pools per world size (start-up is most of a
small run on this machine); a pool whose run failed restarts by itself."""
import os

import pytest

from bench.spawn import RankPool


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """No test reads or writes the user's cache: a profile calibrated there would change every prediction."""
    saved = {k: os.environ.pop(k, None) for k in ("XDG_CACHE_HOME", "PARABENCH_PROFILES")}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


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
