"""The DeepSpeed config of a run, generated from its RunConfig (never hand-written), `ds_set` applied.

Pure (no torch, no deepspeed import): a test can read the generated config without a rank. What
follows from the RunConfig (batch, ZeRO and its buckets, precision) and the `ds_set` arithmetic are
conventions (`bench.conventions`: the cost model and bench.capabilities read them too); this module
adds the knobs that only shape how the engine runs.
"""
from __future__ import annotations

from bench.conventions import apply_ds_set, deepspeed_sections

_RUNTIME = {
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
    # DeepSpeed's throughput timer (on by default) synchronises the whole device at every forward
    # and every engine.step (engine.py `tput_timer`, utils/timer.py): on a GPU a host stall per
    # micro-batch that no other backend pays and that neither sync counter sees
    "timers": {"throughput": {"enabled": False}},
    "dump_state": False,
}


def generate(cfg) -> dict:
    """The config DeepSpeed gets for `cfg`, before `ds_set` overrides."""
    return {**deepspeed_sections(cfg), **_RUNTIME}


def final_config(cfg) -> dict:
    """Generated config with the run's `ds_set` overrides applied: what `deepspeed.initialize` gets."""
    return apply_ds_set(generate(cfg), cfg.ds_set)
