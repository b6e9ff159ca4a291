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


# The floors of the house, bottom first (docs/architecture.md draws them). A unit is a package of bench/
# (bench.analysis) or a top-level module (bench.config); models/ is one unit. Arrows between units go
# down or stay on their floor, and the unit graph has no cycle: a floor never reaches up.
FLOORS = (
    ("conventions", {"bench", "models", "bench.conventions", "bench.choices", "bench.device", "bench.layout", "bench.schedule",
                     "bench.environment", "bench.data"}),
    ("declarations", {"bench.config", "bench.capabilities", "bench.typed_yaml", "bench.results"}),
    ("models of cost and meters", {"bench.analysis", "bench.metrics"}),
    ("the ranks", {"bench.distributed", "bench.surgery", "bench.context_parallel", "bench.expert_parallel", "bench.loss_scale", "bench.training",
                   "bench.native", "bench.backends", "bench.worker", "bench.spawn", "bench.calibrate"}),
    ("orchestration", {"bench.sweep", "bench.report", "bench.ecosystem"}),
    ("commands", {"bench.cli"}),
)


def unit(module: str) -> str:
    return "models" if module.split(".")[0] == "models" else ".".join(module.split(".")[:2])


def unit_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph.setdefault(unit(name), set()).update(unit(t) for t in imports(name, path, set(mods)) if unit(t) != unit(name))
    return graph


def floor_of(name: str) -> int:
    return next(i for i, (_, units) in enumerate(FLOORS) if name in units)


def test_every_unit_lives_on_one_floor():
    placed = [u for _, units in FLOORS for u in units]
    assert len(placed) == len(set(placed)), "a unit on two floors"
    assert set(unit_graph()) - set(placed) == set(), "place each new package or module on a floor in FLOORS"


def test_the_package_graph_has_no_cycle_and_every_arrow_goes_down():
    graph = unit_graph()
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))
    upward = sorted(f"{a} ({FLOORS[floor_of(a)][0]}) → {b} ({FLOORS[floor_of(b)][0]})"
                    for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))
    assert upward == []


def test_the_floor_check_finds_an_upward_arrow():
    graph = {"bench.analysis": {"bench.backends"}}  # the cost model importing an engine: the knot this test prevents
    assert [b for a, t in graph.items() for b in t if floor_of(b) > floor_of(a)] == ["bench.backends"]


def test_the_floors_are_drawn_in_the_architecture_page():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [f"{name}: {u}" for name, units in FLOORS for u in sorted(units)
               if u != "models" and u.removeprefix("bench.") not in page]
    assert all(name in page for name, _ in FLOORS) and missing == []


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
    analysis = sorted(n for n in modules() if n.startswith(("bench.analysis.", "bench.ecosystem.")))
    return ["models", "models.config", "bench.conventions", "bench.layout", "bench.schedule", "bench.choices",
            "bench.config", "bench.capabilities", *analysis, "bench.ecosystem", "bench.cli.analysis", "bench.cli"]


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
    ["estimate", "--from", "tests/ecosystem/megatron_gpt3_7b_tp4_pp1.yaml", "--hardware", "h100-sxm"],
    ["import", "tests/ecosystem/deepspeed_hf_z3.json", "--model", "gpt2-124m", "--world-size", "8"],
], ids=["layout", "estimate", "plan", "estimate-from", "import"])
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
