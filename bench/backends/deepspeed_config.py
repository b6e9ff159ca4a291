"""The DeepSpeed config of a run, generated from its RunConfig (never hand-written), `ds_set` applied.

Pure (no torch, no deepspeed import): a test can read the generated config without a rank. What
follows from the RunConfig (batch, ZeRO and its buckets, precision), the knobs that only run the engine
and the `ds_set` arithmetic are conventions (`bench.conventions`: the cost model and
bench.capabilities' check read them too); this module puts them together for the backend.
"""
from __future__ import annotations

from bench.conventions import DEEPSPEED_RUNTIME, apply_ds_set, deepspeed_sections


def generate(cfg) -> dict:
    """The config DeepSpeed gets for `cfg`, before `ds_set` overrides."""
    return {**deepspeed_sections(cfg), **DEEPSPEED_RUNTIME}


def final_config(cfg) -> dict:
    """Generated config with the run's `ds_set` overrides applied: what `deepspeed.initialize` gets."""
    return apply_ds_set(generate(cfg), cfg.ds_set)
