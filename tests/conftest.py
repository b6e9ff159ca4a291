"""Shared fixtures. Multi-rank tests share warm rank pools per world size (start-up is most of a
small run on this machine); a pool whose run failed restarts by itself."""
import pytest

from bench.spawn import RankPool


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
