"""User-written YAML files (sweep files, Slurm profiles, hardware profiles) read into typed models,
every mistake reported as one line: `FILE: key.path: problem; fix`.

The models are pydantic v2: its errors locate the bad value by key path (('grid', 'tp', 1) is
grid.tp[1]), its strict mode refuses '8' for an integer and 1 for a boolean instead of guessing,
and it is already installed (DeepSpeed depends on it; RunConfig is a pydantic dataclass). This module
turns its errors into our line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from bench.config import ConfigError, suggest


class FileError(ConfigError):
    """A file the user must fix: '<file>: <key path>: <problem>'."""

    def __init__(self, source: str, path: str, problem: str):
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def kind(value) -> str:
    """How a YAML value reads to its author."""
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing (empty)",
            bool: "a boolean", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def read_text(path: Path, what: str = "YAML file") -> str:
    """A user's text file, or a FileError naming it: missing, a folder, unreadable, binary or not UTF-8.
    A UTF-8 byte-order mark (Windows editors) is dropped."""
    path = Path(path)
    if path.is_dir():
        raise FileError(str(path), "", f"is a folder, not a {what}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileError(str(path), "", f"no such {what}") from None
    except OSError as e:
        raise FileError(str(path), "", f"cannot read the {what}: {e.strerror or e}") from None
    if b"\0" in data:
        raise FileError(str(path), "", f"a binary file, not a {what} (text)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FileError(str(path), "", f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                                       "save the file as UTF-8") from None


def load_yaml(path: Path, what: str = "YAML file") -> Any:
    """The parsed file; malformed YAML is a FileError naming the line and column."""
    import yaml
    text = read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem_ = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise FileError(str(path), "", f"malformed YAML: {where}{problem_}") from None
    except RecursionError:
        raise FileError(str(path), "", "malformed YAML: nested too deeply") from None


def key_path(loc: tuple, prefix: str = "") -> str:
    """('grid', 'tp', 1) → 'grid.tp[1]' (after `prefix`, e.g. 'launcher.')."""
    out = prefix.rstrip(".")
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


WANTS = {"int_type": "an integer", "float_type": "a number", "finite_number": "a finite number",
         "bool_type": "true or false", "string_type": "a string",
         "dict_type": "a mapping", "list_type": "a list", "tuple_type": "a list", "model_type": "a mapping",
         "dataclass_type": "a mapping", "int_from_float": "an integer", "int_parsing": "an integer",
         "float_parsing": "a number", "bool_parsing": "true or false"}
UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def mistake(problem: str, *at):
    """The error a model's own check raises: `problem` as written, at the key path of the value
    checked plus `at` (e.g. the offending key of a mapping)."""
    from pydantic_core import PydanticCustomError
    return PydanticCustomError("file", "{problem}", {"problem": problem, "at": at})


def known_keys(noun: str, known) -> Callable[[tuple], str]:
    """The problem text of an unknown key among `known` ('unknown slurm profile key; did you mean …')."""
    return lambda loc: f"unknown {noun}{suggest(loc[-1], known)} (known: {', '.join(map(str, known))})"


def problem(error: dict, unknown: Callable[[tuple], str] = known_keys("key", ())) -> str:
    """One pydantic error as our problem text; `unknown` words an unknown key from its location."""
    field = next((str(p) for p in reversed(error["loc"]) if isinstance(p, str)), "value")
    value, kind_, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind_ == "file":
        return ctx["problem"]
    if kind_ in UNKNOWN:
        return unknown(tuple(error["loc"]))
    if kind_ in WANTS:
        return f"{field} must be {WANTS[kind_]}, got {value!r} ({kind(value)})"
    if kind_ in ("greater_than_equal", "greater_than"):
        sign = "≥" if kind_ == "greater_than_equal" else ">"
        return f"{field} must be {sign} {_plain(ctx.get('ge', ctx.get('gt')))}, got {value!r}"
    if kind_ in ("less_than_equal", "less_than"):
        sign = "≤" if kind_ == "less_than_equal" else "<"
        return f"{field} must be {sign} {_plain(ctx.get('le', ctx.get('lt')))}, got {value!r}"
    if kind_ == "missing":
        return f"{field} is missing"
    if kind_ in ("value_error", "assertion_error"):  # raised by our own checks: their text as written
        return str(ctx.get("error", error["msg"]))
    return error["msg"]  # anything else pydantic words well itself


def _plain(number) -> str:
    """1,000,000 for an integer bound (as RunConfig's messages write it); other numbers as given."""
    return f"{number:,}" if type(number) is int else str(number)


def file_error(exc, source: str, prefix: str = "", unknown: Callable[[tuple], str] = known_keys("key", ()),
               data: Any = None) -> FileError:
    """The first error of a pydantic ValidationError as a FileError (one line: the first is enough to
    fix). With the file's `data`, the key path stops at a value the file wrote as a scalar (a model
    may have wrapped it into a list or mapping)."""
    error = exc.errors()[0]
    loc = tuple(error["loc"]) + tuple((error.get("ctx") or {}).get("at", ()))
    return FileError(source, key_path(loc if data is None else in_file(data, loc), prefix), problem(error, unknown))


def in_file(data: Any, loc: tuple) -> tuple:
    """The part of `loc` the file itself spells: it follows mappings and lists, keeps a key the
    mapping lacks (a missing or unknown key), and stops at a scalar."""
    for i, part in enumerate(loc):
        if isinstance(data, dict):
            if part not in data:
                return loc[:i + 1]
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return loc[:i]
    return loc
