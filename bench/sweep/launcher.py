"""What the sweep runner needs from a launcher, and all it may use: four methods and a name.

Launchers: `LocalLauncher` and `DebugLauncher` (bench.sweep.local), `SlurmLauncher` (bench.sweep.slurm).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from bench.config import RunConfig


class Launcher(Protocol):
    kind: str
    """The rows' `launcher` column: local, debug or slurm."""

    def unsupported(self, cfg: RunConfig) -> str | None:
        """Why this launcher cannot place `cfg` (the run becomes a skipped row), or None."""
        return None

    def check_ready(self, runs: list[RunConfig]) -> None:
        """Raise before anything is written when this machine cannot launch these runs at all."""

    def launch(self, runs: list[RunConfig], started: Callable[[RunConfig], None],
               finished: Callable[..., None]) -> None:
        """Run every config; call `started(cfg)` as each starts and `finished(cfg, row)` with its row
        (`finished(cfg, row, True)` when the launcher's task already stored it: one writer per row)."""
        ...

    def close(self) -> None:
        """Release what is still running (processes, jobs); called after an error or Ctrl-C too."""
