"""The shape of the code: imports point one way (no cycle, found by parsing every import, including those inside
functions and under TYPE_CHECKING). That every module imports on its own, first, in a fresh process is checked in the
e2e tier (tests/e2e/test_structure.py: a subprocess)."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, project_modules

MODULES = project_modules()


def _imports(module: str, path: Path) -> set[str]:
    """The project modules that `module` imports anywhere in its source (the most specific module a name is in)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:  # `from runner import rundir` names the module runner.rundir, `import x.y` names x.y
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Every project module's imports (_imports), parsed once for the tests of this module."""
    return {module: _imports(module, path) for module, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    graph = _graph()
    assert graph["runner.train"] >= {"runner.build", "runner.loop"}  # the parser sees real edges
    assert "runner.rundir" in graph["runner.ckpt.files"]  # `from runner import ConfigError, rundir`
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_framework_imports_nothing_of_the_experiments() -> None:
    # runner/ is a framework that ships without its examples: a task reaches it through the hooks it declares (the
    # runner.renamed, runner.folders and runner.tools entry point groups), never by being imported from it
    graph = _graph()
    assert "experiments.sae.coders.base" in graph["experiments.sae.coders.activations"]  # the parser sees the task's
    upward = {m: sorted(t for t in targets if t.startswith("experiments")) for m, targets in graph.items()}
    assert {m: t for m, t in upward.items() if m.startswith("runner") and t} == {}


def test_the_sae_coders_import_nothing_above_them() -> None:
    # the coder is the recipe: its tools (export, feature pages, folder loading) bind to it from above
    graph = _graph()
    coders = [m for m in MODULES if m.startswith("experiments.sae.coders")]
    below = [*coders, "experiments.sae.objectives", "experiments.sae.metrics"]  # the losses and the metrics' math
    above = {m: sorted(t for t in graph[m] if t.startswith("experiments") and t not in below) for m in below}
    assert {m: t for m, t in above.items() if t} == {}


def test_run_and_the_leaf_modules_know_nothing_of_the_loop() -> None:
    leaves = ["runner.run", "runner.progress", "runner.meter", "runner.rundir", "runner.precision", "runner.data"]
    leaves += ["runner.config.trust", "runner.config.resolvers", "runner.config.confine", "runner.data.samplers"]
    leaves += ["runner.validation"]
    leaves += [m for m in MODULES if m.startswith(("runner.callbacks", "runner.ckpt", "runner.log"))]
    for module in leaves:
        assert "runner.loop" not in _graph()[module], f"{module} imports runner.loop"
        assert "runner.build" not in _graph()[module], f"{module} imports runner.build"


def test_the_command_chooses_openmp_s_wait_policy_before_anything_imports_torch() -> None:
    # OpenMP reads OMP_WAIT_POLICY once, when torch loads it: the choice must run before the first import of torch or
    # of any module that imports it (every runner module but the package's __init__ and runner.waits does)
    tree = ast.parse((ROOT / "runner" / "__main__.py").read_text())
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    first = next(i for i, node in enumerate(body) if ast.unparse(node) == "waits.choose()")
    imports = [ast.unparse(node) for node in body[:first] if isinstance(node, ast.Import | ast.ImportFrom)]
    assert imports == ["from __future__ import annotations", "import gc", "import os", "from runner import waits"]
    waits_imports = [
        n
        for n in ast.walk(ast.parse((ROOT / "runner" / "waits.py").read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom)
    ]
    assert {alias.name for n in waits_imports for alias in n.names} <= {"annotations", "os", "time"}


@pytest.mark.parametrize(
    ("running", "environ", "policy", "why"),
    [
        (3, {}, "PASSIVE", "2 other process(es) running"),  # this one and two others
        (1, {}, None, "no other process running"),  # libgomp's own: spin a moment, then sleep
        (None, {}, "PASSIVE", "not readable"),
        (3, {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE", "yours (OMP_WAIT_POLICY set)"),
        (3, {"GOMP_SPINCOUNT": "1000"}, None, "yours (GOMP_SPINCOUNT set)"),
    ],
)
def test_the_wait_policy_follows_the_machine_s_load_unless_the_user_chose(running, environ, policy, why, monkeypatch):
    from runner import waits

    monkeypatch.setattr(waits, "_running", lambda: running)
    monkeypatch.setattr(waits, "chosen", {})
    chosen = waits.choose(environ)
    assert environ.get("OMP_WAIT_POLICY") == policy and why in chosen["why"], chosen


def test_every_python_m_tool_gets_the_wait_policy_and_a_library_import_does_not(tmp_path: Path) -> None:
    # runner/__init__.py sets it when sys.argv[0] is "-m": what Python puts there while `-m` imports a tool's package
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import sys\nprint(sys.argv[0])\n")
    (tmp_path / "pkg" / "tool.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    seen = subprocess.run([sys.executable, "-m", "pkg.tool"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert seen.stdout.strip() == "-m", seen

    def policy(argv0: str, **extra: str) -> str:
        code = f"import sys; sys.argv[:1] = [{argv0!r}]; import runner.waits; print(runner.waits.chosen)"
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True)
        return done.stdout.strip()

    assert "'why': " in policy("-m")  # python -m runner.generate, runner.tools.features, ...: chosen (by the load)
    assert policy("-c") == "{}"  # import runner from a notebook or a script: nothing
    assert "'policy': 'ACTIVE', 'why': 'yours" in policy("-m", OMP_WAIT_POLICY="ACTIVE")  # the user's own wins


def _too_large(modules: dict[str, Path], lines: int, function_lines: int) -> tuple[list[str], list[str]]:
    """(modules over `lines`, functions over `function_lines`), each with its size."""
    modules_over, functions_over = [], []
    for module, path in sorted(modules.items()):
        source = path.read_text(encoding="utf-8")
        if (n := len(source.splitlines())) > lines:
            modules_over.append(f"{module} ({n} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > function_lines:
                    functions_over.append(f"{module}.{node.name} ({n} lines)")
    return modules_over, functions_over


def test_every_module_and_function_stays_readable_in_one_sitting(tmp_path: Path) -> None:
    # A module over ~300 lines holds more than one idea, a function over ~60 more than one screen (DESIGN.md)
    (tmp_path / "big.py").write_text("def f():\n" + "    x = 1\n" * 60 + "\n" * 240)
    assert _too_large({"big": tmp_path / "big.py"}, 300, 60) == (["big (301 lines)"], ["big.f (61 lines)"])
    assert _too_large(MODULES, 300, 60) == ([], [])
