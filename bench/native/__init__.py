"""The native engine: our own tensor, pipeline and data parallelism over the shared GPT."""
from bench.native.engine import build

__all__ = ["build"]
