"""The shared model definition: one GPT, presets, parameter and FLOP counts. No distributed code."""
from models.config import (PRESETS, GPTConfig, count_params, flops_per_token, get_preset)
from models.gpt import GPT, Block, build_model, init_value, init_weights, loss_fn

__all__ = ["PRESETS", "GPTConfig", "count_params", "flops_per_token", "get_preset", "GPT", "Block",
           "build_model", "init_value", "init_weights", "loss_fn"]
