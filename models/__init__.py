"""The shared model definition: one GPT, presets, parameter and FLOP counts. No distributed code.

The torch half (`models.gpt`) loads on first use (PEP 562), so `import models` and the pure
`models.config` stay importable without torch: the planner and `bench layout` never pay for it."""
from models.config import PRESETS, GPTConfig, count_active_params, count_params, flops_per_token, get_preset

_TORCH_NAMES = ("GPT", "Block", "MoE", "INIT_BLOCK", "build_model", "init_fill_", "init_range", "init_value",
                "init_weights", "loss_fn", "loss_with_aux")

__all__ = ["PRESETS", "GPTConfig", "count_active_params", "count_params", "flops_per_token", "get_preset",
           *_TORCH_NAMES]


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from models import gpt
        return getattr(gpt, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
