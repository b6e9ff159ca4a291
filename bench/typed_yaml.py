"""User-written YAML files (sweep files, Slurm profiles, hardware profiles) read into typed models,
every mistake reported as one line: `FILE: key.path: problem; fix`.

The models are pydantic v2: its errors locate the bad value by key path (('grid', 'tp', 1) is
grid.tp[1]), its strict mode refuses '8' for an integer and 1 for a boolean instead of guessing,
and it is already installed (DeepSpeed depends on it). This module turns its errors into our line;
pydantic itself is imported only by the modules that define a file's model, so the pure maths
(`bench plan` with a built-in profile) never loads it.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from bench.config import ConfigError


class FileError(ConfigError):
    """A file the user must fix: '<file>: <key path>: <problem>'."""

    def __init__(self, source: str, path: str, problem: str):
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def suggest(name, known) -> str:
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def kind(value) -> str:
    """How a YAML value reads to its author."""
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing (empty)",
            bool: "a boolean", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def load_yaml(path: Path) -> Any:
    """The parsed file; malformed YAML is a FileError naming the line and column."""
    import yaml
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise FileError(str(path), "", f"malformed YAML: {where}{getattr(e, 'problem', None) or e}") from None


def key_path(loc: tuple, prefix: str = "") -> str:
    """('grid', 'tp', 1) → 'grid.tp[1]' (after `prefix`, e.g. 'launcher.')."""
    out = prefix.rstrip(".")
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


WANTS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "a string",
         "dict_type": "a mapping", "list_type": "a list", "tuple_type": "a list", "model_type": "a mapping",
         "dataclass_type": "a mapping", "int_from_float": "an integer", "int_parsing": "an integer",
         "float_parsing": "a number", "bool_parsing": "true or false"}
UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def problem(error: dict, unknown: tuple[str, tuple] = ("key", ())) -> str:
    """One pydantic error as our problem text. `unknown`: (what the keys are, the known keys) for
    an unknown-key error."""
    field = next((str(p) for p in reversed(error["loc"]) if isinstance(p, str)), "value")
    value, kind_, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind_ in UNKNOWN:
        noun, known = unknown
        return f"unknown {noun}{suggest(field, known)} (known: {', '.join(map(str, known))})"
    if kind_ in WANTS:
        return f"{field} must be {WANTS[kind_]}, got {value!r} ({kind(value)})"
    if kind_ in ("greater_than_equal", "greater_than"):
        sign = "≥" if kind_ == "greater_than_equal" else ">"
        return f"{field} must be {sign} {ctx.get('ge', ctx.get('gt'))}, got {value!r}"
    if kind_ == "missing":
        return f"{field} is missing"
    if kind_ in ("value_error", "assertion_error"):  # raised by our own checks: their text as written
        return str(ctx.get("error", error["msg"]))
    return error["msg"]  # our own PydanticCustomError messages, and anything pydantic words well itself


def file_error(exc, source: str, prefix: str = "", unknown: tuple[str, tuple] = ("key", ())) -> FileError:
    """The first error of a pydantic ValidationError as a FileError (one line: the first is enough to fix)."""
    error = exc.errors()[0]
    return FileError(source, key_path(error["loc"], prefix), problem(error, unknown))
