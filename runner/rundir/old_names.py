"""What the framework's own modules were called: an older run folder's config names a class by its old name; it is
read as the new one, so the folder still loads (and is still checked as data: the new name must be buildable like any
other). A task package adds its own names through the `runner.renamed` entry point group (a dict, old -> new), and
the configs of classes whose options changed shape through `runner.upgraded` (a dict, a class's dotted name -> a
function from its old config node to the node that means the same now), so the framework never imports a task to
read its folders."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

RENAMED = {
    "runner.refused.NewRunFolder": "runner.rundir.refused.NewRunFolder",
}
_TARGET = re.compile(r"^(\s*(?:- )?_target_:\s*['\"]?)([\w.]+)(['\"]?\s*)$", re.MULTILINE)
_renamed: dict[str, str] = {}
_upgrades: dict[str, Callable[[dict], dict]] = {}
_options: dict[str, str] = {}


def renamed() -> dict[str, str]:
    """Every old dotted name (a module, or a module's class) and its new one: the framework's and each task's."""
    if not _renamed:
        from importlib.metadata import entry_points

        table = dict(RENAMED)
        for point in entry_points(group="runner.renamed"):
            table.update(point.load())
        _renamed.update(table)
    return _renamed


def moved_target(target: Any) -> Any:
    """A `_target_` value by its new name: the class's own entry first, then its module's (renamed)."""
    if not isinstance(target, str):
        return target
    table = renamed()
    if target in table:
        return table[target]
    module, _, name = target.rpartition(".")
    return f"{table[module]}.{name}" if module in table else target


def moved(text: str) -> str:
    """A run config's text with each `_target_` of a renamed class or module named by its new name."""
    return _TARGET.sub(lambda m: m.group(1) + moved_target(m.group(2)) + m.group(3), text)


def upgrades() -> dict[str, Callable[[dict], dict]]:
    """Each class whose config changed shape, by its dotted name, and what reads its old node as the new one."""
    if not _upgrades:
        from importlib.metadata import entry_points

        for point in entry_points(group="runner.upgraded"):
            _upgrades.update(point.load())
    return _upgrades


def upgraded(node: Any) -> Any:
    """A plain config (dicts and lists, as read) with every node of a renamed or reshaped class as it is written now:
    what an older run folder or checkpoint wrote, read as the config that builds the same thing."""
    if isinstance(node, list):
        return [upgraded(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: upgraded(value) for key, value in node.items()}
    target = moved_target(node.get("_target_"))
    if target is not None:
        node["_target_"] = target
    upgrade = upgrades().get(target) if isinstance(target, str) else None
    return upgrade(node) if upgrade is not None else node


def renamed_options() -> dict[str, str]:
    """Each command-line key a task package no longer takes, and how it is spelled now (`runner.renamed_options`)."""
    if not _options:
        from importlib.metadata import entry_points

        for point in entry_points(group="runner.renamed_options"):
            _options.update(point.load())
    return _options
