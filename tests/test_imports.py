"""The import graph: no cycle among the modules of bench/ and models/ (lazy imports count), and the
pure maths imports and runs without torch (a meta-path finder refuses it in a fresh interpreter)."""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "models")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports, at module level or inside a function (a lazy import still
    ties the two modules together), but not under `if TYPE_CHECKING:` (annotations only). The project
    has absolute imports only."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: relative import"
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import bench.a.b` imports bench.a too: keep the module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of nodes (first = last), or None (depth-first, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_bench_and_models():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "deepspeed"):
                raise ImportError(f"{name} is not importable in this test")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def _pure_modules() -> list[str]:
    analysis = sorted(n for n in modules() if n.startswith("bench.analysis."))
    return ["models", "models.config", "bench.layout", "bench.schedule", "bench.choices", "bench.config", "bench.capabilities",
            *analysis,
            "bench.cli.analysis", "bench.cli"]


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       # no calibrated profiles: reading one needs the YAML schema
                                                       "PARABENCH_PROFILES": os.devnull})


def test_pure_maths_imports_without_torch():
    done = _run_without_torch(f"""
        import importlib
        for name in {_pure_modules()!r}:
            importlib.import_module(name)
        assert "torch" not in sys.modules
        try:
            import torch
        except ImportError:
            print("refused")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"  # the finder works: a torch import would have failed above


@pytest.mark.parametrize("args", [
    ["layout", "--tp", "2", "--pp", "2", "--dp", "2", "--model", "tiny"],
    ["estimate", "--model", "llama2-7b", "--tp", "2", "--dp", "4", "--hardware", "h100-sxm", "--dtype", "bf16-mixed"],
    ["plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-sxm", "--global-batch", "32", "--top", "1"],
], ids=["layout", "estimate", "plan"])
def test_analysis_commands_run_without_torch(args):
    done = _run_without_torch(f"""
        sys.argv = ["bench", *{args!r}]
        from bench.cli import main
        try:
            main()
        finally:
            assert "torch" not in sys.modules
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
