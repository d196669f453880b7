"""Config values against type hints: does a plain value (what Hydra composed: numbers, strings, lists, mappings, null)
fit a parameter's annotation, and which key names it. runner.config.checks asks it of every annotated component key, so
that `model.dropout=abc` is refused by name before anything is built instead of failing as a TypeError deep inside
torch."""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner import ConfigError

_NAMES = {type(None): "null", bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
_PLURALS = {bool: "true/false values", int: "whole numbers", float: "numbers", str: "strings"}


def fits(value: Any, hint: Any, alone: bool = True) -> bool:
    """Does `value` fit `hint`? A hint this check cannot read (a class, a tensor) fits anything when `alone`; as one
    member of a union (`float | Tensor`) it fits nothing, so that the others decide."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a, alone=False) for a in args)
    if origin is Literal:
        return value in args
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args, strict=True))
        return all(fits(v, args[0]) for v in value) if args else True
    if hint is dict or origin in (dict, Mapping):
        return isinstance(value, dict)
    return alone


def describe(hint: Any) -> str:
    """The hint in words: 'a number or null', 'a list of whole numbers', "one of 'min', 'max'"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # the members a config value can be (not `Tensor` of float | Tensor)
        readable = [a for a in args if typing.get_origin(a) or a in _NAMES or a in (list, tuple, dict)]
        return " or ".join(dict.fromkeys(describe(a) for a in readable))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} {_PLURALS.get(args[0], 'values')}"
    if origin in (list, tuple, Sequence) and args:
        return f"a list of {_PLURALS.get(args[0], 'values')}"
    if hint is dict or origin in (dict, Mapping):
        return "a mapping {key: value}"
    return _NAMES.get(hint, "a list" if hint in (list, tuple) else getattr(hint, "__name__", str(hint)))


def typed(value: Any) -> str:
    """`value` as it is typed on the command line: [1,2], null, true, {a: 1}."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(typed(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {typed(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def check_value(key: str, value: Any, hint: Any, default: Any = inspect.Parameter.empty) -> None:
    """A ConfigError naming `key` unless `value` fits `hint`, with the parameter's `default` as an example."""
    if default is None and value is None:  # `x: int = None`: null is what the code expects by default
        return
    if not fits(value, hint):
        given = default is not None and default is not inspect.Parameter.empty and fits(default, hint)
        example = f": e.g. {key}={typed(default)}" if given else ""
        if value is None:  # a preset's placeholder left for the user: say what to give, not what null is not
            raise ConfigError(f"{key} is not set (null): give {describe(hint)} on the command line, {key}=...{example}")
        shown = repr(value) if isinstance(value, str) else typed(value)
        raise ConfigError(f"{key} must be {describe(hint)}, got {shown} ({type(value).__name__}){example}")


def plain_value(node: DictConfig, key: str) -> tuple[bool, Any]:
    """(resolved, the value of node[key] as plain Python); a value that only resolves later (a resolver of Hydra's)
    or a component of its own (built and checked on its own) is (False, None)."""
    child = node._get_node(key)
    if isinstance(child, DictConfig) and ("_target_" in child or "_partial_" in child):
        return False, None  # a component of its own: built first, checked on its own
    try:
        value = node[key]
        plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    except Exception:
        return False, None
    return True, plain


def set_at(node: DictConfig, key: str, path: str) -> str:
    """The key a message names for node[key] (at `path`): where the user sets it (data.seq_len is ${model.seq_len},
    data.skip_positions ${oc.select:source.skip_positions,0}: model.seq_len, source.skip_positions)."""
    raw = node._get_node(key)._value()
    source = re.fullmatch(r"\$\{(?:oc\.select:)?([\w.]+)(?:,[^}]*)?\}", raw) if isinstance(raw, str) else None
    return source.group(1) if source else path
