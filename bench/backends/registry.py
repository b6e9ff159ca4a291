"""Backend registry: a name → the module whose `build(ctx)` makes its trainer.

What each backend can run is declared in bench/capabilities.py (pure data, no torch); validation
never needs this module. `build` imports the backend only inside a rank.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.capabilities import BACKENDS

if TYPE_CHECKING:
    from bench.training import RunContext


@dataclass(frozen=True)
class Backend:
    name: str
    module: str

    def build(self, ctx: "RunContext"):
        return importlib.import_module(self.module).build(ctx)


REGISTRY: dict[str, Backend] = {
    b.name: b for b in (
        Backend("native", "bench.native"),
        Backend("ddp", "bench.backends.ddp"),
        Backend("fsdp", "bench.backends.fsdp"),
        Backend("deepspeed", "bench.backends.deepspeed"),
    )
}
assert tuple(sorted(REGISTRY)) == tuple(sorted(BACKENDS)), "every declared backend has a build, and only those"


def get_backend(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}") from None
