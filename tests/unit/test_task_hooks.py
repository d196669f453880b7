"""Every optional task method or attribute the framework looks up by name (getattr/hasattr on the task, found by
parsing every module of runner/) is declared in runner.interfaces.Task and named in TASK_HOOKS, and every name there is
still looked up somewhere: the Protocol stays the whole list of what a task may define."""

from __future__ import annotations

import ast

from helpers import ROOT

from runner.interfaces import TASK_HOOKS

# How runner/ spells the task where it looks a hook up: the built task, a loaded run's model, a task's coder, and the
# strategy's handle on it.
RECEIVERS = {"task", "model", "coder", "run.task", "self.task", "self.model"}
REQUIRED = {"training_step"}


def _lookups(source: str) -> list[tuple[int, str | None]]:
    """(line, name) of each getattr/hasattr on a receiver in RECEIVERS; the name is the constant second argument, or
    each constant of a `for name in (...)` around it; None where the test cannot read it."""
    tree = ast.parse(source)
    loops: dict[tuple[int, str], list[str]] = {}  # a loop variable's constants, for the lookups inside that loop
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, (ast.Tuple, ast.List))
        ):
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts):
                names = [e.value for e in node.iter.elts]
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Call):
                        loops[id(inner), node.target.id] = names
    found: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
        ):
            continue
        if len(node.args) < 2 or ast.unparse(node.args[0]) not in RECEIVERS:
            continue
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.append((node.lineno, name.value))
        elif isinstance(name, ast.Name) and (id(node), name.id) in loops:
            found.extend((node.lineno, each) for each in loops[id(node), name.id])
        else:
            found.append((node.lineno, None))
    return sorted(found, key=lambda each: each[0])  # ast.walk goes breadth first


def _everywhere() -> dict[str, list[str]]:
    """Each name looked up on the task in runner/, with the file:line of every lookup."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "runner").rglob("*.py")):
        for line, name in _lookups(path.read_text(encoding="utf-8")):
            where.setdefault(str(name), []).append(f"{path.relative_to(ROOT)}:{line}")
    return where


def test_the_finder_reads_constant_names_loops_over_constants_and_says_what_it_cannot_read() -> None:
    source = """
if hasattr(run.task, "bogus_hook"):
    getattr(task, "other", None)
for method in ("training_step", "validation_step"):
    hasattr(task, method)
getattr(model, some_name)
getattr(optimizer, "not_the_task")
"""
    assert _lookups(source) == [
        (2, "bogus_hook"),
        (3, "other"),
        (5, "training_step"),
        (5, "validation_step"),
        (6, None),
    ]


def test_every_hook_the_framework_looks_up_is_declared_and_every_declared_hook_is_looked_up() -> None:
    assert len(set(TASK_HOOKS)) == len(TASK_HOOKS), "TASK_HOOKS names a hook twice"
    where = _everywhere()
    undeclared = [
        f"{site}: {name if name != 'None' else 'a name the test cannot read'}"
        for name, sites in sorted(where.items())
        if name not in REQUIRED and name not in TASK_HOOKS
        for site in sites
    ]
    assert not undeclared, f"task hooks missing from runner.interfaces.Task/TASK_HOOKS: {undeclared}"
    stale = sorted(set(TASK_HOOKS) - set(where))
    assert not stale, f"TASK_HOOKS names hooks no runner module looks up: {stale}"
