"""Static expansion of a launch script: the argument list a `torchrun … pretrain_gpt.py ARGS` line would get.

Only what can be known without running the script: plain and exported assignments, bash arrays, `$X`,
`${X}`, `${X[@]}`, `${X:-default}` and integer `$((…))`. A variable that cannot be expanded (a positional
`$1`, a command substitution, an unset name) stays as `$NAME` in the value; the reader refuses it, naming
the variable, only where the value matters for the layout or the math.
"""
from __future__ import annotations

import re
import shlex

from bench.ecosystem.table import SourceError

_VAR = re.compile(r"\$\{(\w+)(\[@\]|\[\*\])?(?::-([^}]*))?\}|\$(\w+|\d)")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+)?(\w+)(\+?)=(.*)$", re.S)
_OPENS = ("if ", "for ", "while ", "until ", "case ")
_CLOSES = ("fi", "done", "esac")
LAUNCHERS = ("torchrun", "python", "python3", "deepspeed", "srun", "mpirun")


def logical_lines(text: str) -> list[str]:
    """Lines with continuations joined and arrays `X=( … )` kept whole."""
    lines, buffer, depth = [], "", 0
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        depth += _strip_comment(line).count("(") - _strip_comment(line).count(")")
        if depth > 0:
            buffer += "\n"
            continue
        lines.append(buffer)
        buffer, depth = "", 0
    if buffer.strip():
        lines.append(buffer)
    return lines


def _strip_comment(line: str) -> str:
    try:
        return " ".join(shlex.split(line, comments=True))
    except ValueError:
        return line


def expand_script(text: str, source: str) -> tuple[list[str], int | None]:
    """(the arguments of the script's training command, the world size its launcher gives or None).

    A variable assigned inside an if/for/while/case block has no static value: the command may not use it."""
    env: dict[str, list[str]] = {}
    conditional: dict[str, int] = {}  # name → the line of its assignment under a condition
    depth = 0
    for number, line in enumerate(logical_lines(text), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        first = stripped.split(";")[0].strip()
        if first.startswith(_OPENS):
            depth += 1
            continue
        if first in _CLOSES or first.startswith(("fi ", "done ", "esac ")):
            depth = max(depth - 1, 0)
            continue
        match = _ASSIGN.match(stripped)
        if match and not stripped.startswith(LAUNCHERS):
            name, append, value = match.groups()
            if depth:
                conditional.setdefault(name, number)
            env[name] = (env.get(name, []) if append else []) + _assigned(value, env)
            continue
        if depth:
            continue
        words = _words(stripped, env, conditional, source)
        script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if script is not None and words and words[0].rsplit("/", 1)[-1] in LAUNCHERS:
            return words[script + 1:], _launcher_world(words[:script])
    raise SourceError(source, "", "no training command found (a line running torchrun/python/deepspeed … SCRIPT.py ARGS)")


def _assigned(value: str, env: dict) -> list[str]:
    value = value.strip()
    if value.startswith("(") and value.rstrip().endswith(")"):
        return _words(value.strip()[1:-1], env)
    if value.startswith("$((") and value.endswith("))"):
        return [_arithmetic(value[3:-2], env)]
    if value.startswith(("$(", "`")):
        return ["$(command)"]
    words = _words(value, env)
    return [" ".join(words)] if words else [""]


def _arithmetic(expr: str, env: dict) -> str:
    text = _VAR.sub(lambda m: _scalar(m, env), expr)
    if not re.fullmatch(r"[\d\s+\-*/()]+", text):
        return f"$(({expr}))"
    return str(int(eval(text.replace("/", "//"), {"__builtins__": {}})))  # digits and + - * / ( ) only


def _scalar(match, env) -> str:
    values = _lookup(match, env)
    return " ".join(values)


def _lookup(match, env) -> list[str]:
    name, _, default, bare = match.groups()
    name = name or bare
    if name in env:
        return env[name]
    if default is not None:
        return [default]
    return [f"${name}"]


def _words(text: str, env: dict, conditional: dict | None = None, source: str = "script") -> list[str]:
    """Shell words after expansion: an array `${X[@]}` standing alone becomes its items, each split at blanks
    (unquoted expansion: "--fp8-format hybrid" is two words)."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:
        raise SourceError(source, "", f"cannot split {text[:60]!r}: {e}") from None
    for name, line in (conditional or {}).items():
        if re.search(rf"\$\{{?{name}\b", text):
            raise SourceError(source, f"${name}", f"is set under a condition (line {line}), so it cannot be expanded "
                              "statically; pass the arguments with `bench import megatron -- ARGS…`")
    out = []
    for token in tokens:
        whole = _VAR.fullmatch(token)
        if whole and (whole.group(2) or len(_lookup(whole, env)) > 1):
            out += [word for item in _lookup(whole, env) for word in item.split()]
        elif token.startswith("$((") and token.endswith("))"):
            out.append(_arithmetic(token[3:-2], env))
        else:
            out.append(_VAR.sub(lambda m: _scalar(m, env), token))
    return out


def _launcher_world(words: list[str]) -> int | None:
    """nproc_per_node × nnodes of a torchrun line, when both are plain numbers."""
    options = {}
    for i, word in enumerate(words):
        key, eq, value = word.partition("=")
        key = key.replace("_", "-")
        if key in ("--nproc-per-node", "--nnodes", "--num-gpus", "--num-nodes"):
            options[key] = value if eq else (words[i + 1] if i + 1 < len(words) else "")
    gpus = options.get("--nproc-per-node") or options.get("--num-gpus")
    nodes = options.get("--nnodes") or options.get("--num-nodes") or "1"
    return int(gpus) * int(nodes) if gpus and gpus.isdigit() and nodes.isdigit() else None
