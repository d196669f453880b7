"""What a run folder's config may build. A run folder may be anybody's, and Hydra would call whatever its `_target_`s
name (torch.load of a pickle, os.system, a project function that writes files). Least authority, slot by slot: a
target is built only if it *is* a class or factory of a trusted package (decided on what it resolves to, never on how
it is spelled: Hydra resolves `runner.data.torch.load` attribute by attribute to `torch.load`) that opted in to the
slot it stands in with `@buildable(slot)` beside its definition, and its arguments are plain data except the
parameters it declares to take a component. Nothing that writes files opts in."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from omegaconf import grammar_parser
from omegaconf.errors import GrammarParseError
from torch import nn

from runner import ConfigError

# What each slot builds: what a rebuilt run is made of, and nothing else. The model is an nn.Module class; the data
# a data module (it hands out loaders); its splits a factory of datasets; precision one of the precision classes; the
# callbacks those that add validation metrics (what runner.tools.evaluate runs).
SLOTS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model": ("an nn.Module class", lambda obj: inspect.isclass(obj) and issubclass(obj, nn.Module)),
    "data": ("a data module class", lambda obj: inspect.isclass(obj) and hasattr(obj, "train_loader")),
    "splits": ("a factory of dataset splits", lambda obj: inspect.isclass(obj) or inspect.isfunction(obj)),
    "precision": ("a precision class", lambda obj: inspect.isclass(obj) and hasattr(obj, "autocast")),
    "callback": ("a metric callback class", lambda obj: inspect.isclass(obj) and hasattr(obj, "on_validation_end")),
}
_MARK = "__runner_buildable__"
# Hydra's own keys beside _target_ that change nothing of what is built (_partial_ is allowed below the slot's root)
HYDRA_KEYS = {"_target_", "_args_", "_convert_", "_recursive_", "_partial_"}  # instantiate's own, not a class's
# Resolvers a run folder's config may use: each only reads (the environment, the config itself, the clock, the running
# job's Hydra config). Any other is refused unresolved: runner_fresh makes folders, a plugin's may do anything, and
# oc.decode / oc.create parse a string into config again, where an escaped `\${...}` becomes a resolver call.
SAFE_RESOLVERS = {
    "oc.env",
    "oc.select",
    "oc.dict.keys",
    "oc.dict.values",
    "now",
    "hydra",
    "runner_now",
    "runner_direction",
}

T = TypeVar("T")


@dataclass(frozen=True)
class Buildable:
    """A class or factory's opt-in: the slot it may be built in, and its parameters that take a component (-> slot)."""

    slot: str
    components: dict[str, str] = field(default_factory=dict)


def buildable(slot: str, **components: str) -> Callable[[T], T]:
    """Opt a class or factory in to being built from a run folder's config as `slot`; `components` maps each of its
    parameters that takes a built component to that component's slot (every other argument is plain data)."""
    unknown = sorted({slot, *components.values()} - set(SLOTS))
    if unknown:
        raise ValueError(f"buildable: unknown slot(s) {unknown}; the slots are {sorted(SLOTS)}")

    def mark(obj: T) -> T:
        what, fits = SLOTS[slot]
        if not fits(obj):
            raise TypeError(f"@buildable({slot!r}) on {obj!r}, which is not {what}")
        missing = sorted(set(components) - set(inspect.signature(obj).parameters))
        if missing:
            raise TypeError(f"@buildable({slot!r}) on {obj!r}: it has no parameter(s) {missing}")
        setattr(obj, _MARK, Buildable(slot, dict(components)))
        return obj

    return mark


def _opted_in(obj: Any) -> Buildable | None:
    # Its own mark only, never one inherited: a subclass may do what its base does not (write files at __init__)
    mark = vars(obj).get(_MARK) if inspect.isclass(obj) or inspect.isfunction(obj) else None
    return mark if isinstance(mark, Buildable) else None


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _spelled_trusted(target: str, trusted: Sequence[str]) -> bool:
    return any(_under(target, package) for package in trusted)


def _defined_in(obj: Any, trusted: Sequence[str]) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and _spelled_trusted(module, trusted)


def _resolve(target: str, trusted: Sequence[str]) -> Any:
    """The object that Hydra's _locate would return for `target` (same order: attribute first, then submodule), or
    a reason (str) why it may not be instantiated. Imports only modules on the path to or inside a trusted package."""
    parts = target.split(".")
    if not all(part.isidentifier() and not part.startswith("_") for part in parts):
        return "is not a dotted path of public names"
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        here = ".".join(parts[:i])
        if isinstance(obj, ModuleType) and not hasattr(obj, part):
            try:
                obj = importlib.import_module(here)
            except ModuleNotFoundError:
                return f"names no module or attribute `{here}`"
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return f"names no attribute `{here}`"
        if isinstance(obj, ModuleType) and obj.__name__ != here:
            return f"reaches the module `{obj.__name__}` through `{here}`"
        if i < len(parts) and not isinstance(obj, ModuleType):
            return f"goes through `{here}`, which is not a module"
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"is a {type(obj).__name__}, not a class or function"
    if not _defined_in(obj, trusted):
        return f"is `{obj.__module__}.{obj.__qualname__}`, defined outside the trusted packages"
    return obj


def target_problem(target: Any, trusted: Sequence[str]) -> tuple[str, bool] | None:
    """Why `target` may not be instantiated, and whether that is a forgery (spelled as a trusted path but something
    else); None when it is a class or function defined in a trusted package and reached only through its modules."""
    if not isinstance(target, str):
        return f"is a {type(target).__name__}, not a dotted path", True
    if not _spelled_trusted(target, trusted):
        top = target.split(".")[0]
        if not top.isidentifier() or importlib.util.find_spec(top) is None:  # find_spec of a top name runs nothing
            return "is no importable name (a truncated or hand-edited config?)", True
        return "is not under the trusted module paths", False
    try:
        found = _resolve(target, trusted)
    except ImportError as error:  # a trusted module that fails to import is a broken install, not this config's fault
        return f"cannot be imported ({error})", True
    return (found, True) if isinstance(found, str) else None


@dataclass
class Verdict:
    """What checking a config tree found: forgeries (which refuse the whole folder), targets outside the trusted
    packages, targets that did not opt in to this slot (a callback of these two is left out), and the tree with
    `_args_` bound to their names."""

    forged: list[str] = field(default_factory=list)
    untrusted: list[str] = field(default_factory=list)
    unmarked: list[str] = field(default_factory=list)
    node: Any = None

    def refusals(self) -> list[str]:
        """Every reason, forgeries first."""
        return self.forged + self.untrusted + self.unmarked


def _holds_target(node: Any) -> bool:
    if isinstance(node, dict):
        return "_target_" in node or any(_holds_target(v) for v in node.values())
    return isinstance(node, list) and any(_holds_target(v) for v in node)


def _components(value: Any, slot: str, trusted: Sequence[str], path: str, verdict: Verdict) -> Any:
    # A parameter that takes components: each mapping with a _target_ in it (nested in lists or mappings, as
    # MultiSAE's saes: {name: {...}}) is one, checked for `slot`; the rest is plain data.
    if isinstance(value, dict) and "_target_" in value:
        return _component(value, slot, trusted, path, verdict, root=False)
    if isinstance(value, dict):
        return {k: _components(v, slot, trusted, f"{path}.{k}", verdict) for k, v in value.items()}
    if isinstance(value, list):
        return [_components(v, slot, trusted, f"{path}[{i}]", verdict) for i, v in enumerate(value)]
    _resolved_once(value, path, verdict)
    return value


def _resolved_once(value: Any, path: str, verdict: Verdict) -> None:
    # A resolved value that still reads `${...}` (an escaped `\${...}` in the file) would be resolved again when it is
    # built (instantiate resolves its config): any resolver, unchecked, and oc.create's mapping a _target_ unchecked.
    # Only what is built is asked: a callback left out may hold any text.
    verdict.forged += [f"{where} holds `${{`, which building would resolve again" for where, _ in _strings(value, path)]


def _component(node: dict, slot: str, trusted: Sequence[str], path: str, verdict: Verdict, root: bool) -> Any:
    target, what = node["_target_"], SLOTS[slot][0]
    problem = target_problem(target, trusted)
    if problem is not None:
        (verdict.forged if problem[1] else verdict.untrusted).append(f"{path}._target_={target} {problem[0]}")
        return node
    obj = _resolve(target, trusted)
    mark = _opted_in(obj)
    if mark is None or mark.slot != slot:
        why = "does not opt in to being built from a run folder" if mark is None else f"opts in as {mark.slot}"
        verdict.unmarked.append(f"{path}._target_={target} {why}; here it stands for {what}")
        return node
    if root and node.get("_partial_"):
        verdict.forged.append(f"{path}._partial_ asks for a partial, not the {slot} itself")
    arguments = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    if node.get("_args_"):
        arguments = _by_name(obj, node["_args_"], arguments, path, verdict)
    for name, value in arguments.items():
        if name in mark.components:
            arguments[name] = _components(value, mark.components[name], trusted, f"{path}.{name}", verdict)
        elif _holds_target(value):
            verdict.forged.append(f"{path}.{name} holds a _target_, but `{name}` of {target} takes plain data")
        else:
            _resolved_once(value, f"{path}.{name}", verdict)
    return {**{k: v for k, v in node.items() if k in HYDRA_KEYS and k != "_args_"}, **arguments}


def _by_name(obj: Any, args: Any, arguments: dict, path: str, verdict: Verdict) -> dict:
    # Positional arguments bound to the parameters they fill, so that every rule keyed by a parameter's name (a
    # component, a confined cache folder) sees them: `_args_` is a spelling, not a way around those rules.
    signature = inspect.signature(obj)
    parameters = signature.parameters
    try:
        bound = signature.bind_partial(*(args if isinstance(args, list) else [args]))
    except TypeError as error:
        verdict.forged.append(f"{path}._args_ do not fit {obj.__qualname__} ({error})")
        return arguments
    for name in bound.arguments:
        if parameters[name].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            verdict.forged.append(f"{path}._args_ fill `{name}` of {obj.__qualname__}, which is not taken by name")
        elif name in arguments:
            verdict.forged.append(f"{path}._args_ and {path}.{name} both give `{name}`")
    return {**bound.arguments, **arguments}


def problems(node: Any, slot: str, trusted: Sequence[str], path: str) -> Verdict:
    """Every reason the resolved config tree `node` (at `path`) may not be built as `slot`: its target not trusted, not
    opted in, or opted in for another slot; a component where plain data goes; a forged spelling."""
    verdict = Verdict()
    if not isinstance(node, dict) or "_target_" not in node:
        verdict.forged.append(f"{path} is no component ({SLOTS[slot][0]} with a _target_)")
        verdict.node = node
        return verdict
    verdict.node = _component(node, slot, trusted, path, verdict, root=True)
    return verdict


def check(node: Any, slot: str, trusted: Sequence[str], path: str, source: str) -> Any:
    """`node` (a resolved config tree read from `source`) with its `_args_` bound to names, or a ConfigError naming
    every part of it that may not be built as `slot`."""
    verdict = problems(node, slot, trusted, path)
    if verdict.refusals():
        raise ConfigError(
            f"refusing to build the {path} of {source}: {'; '.join(verdict.refusals())}. A run "
            f"folder's config could run any code it names, so only the classes and factories under the trusted "
            f"module paths {list(trusted)} that opt in with @runner.config.trust.buildable are built; if this run "
            f"is yours and its classes live in your own package, mark them and add that package: "
            f"trusted_targets=[{','.join(trusted)},mypackage]"
        )
    return verdict.node


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():  # keys are never resolved
            yield from _strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str) and "${" in node:
        yield path, node


def resolver_calls(tree: Any) -> Iterator[str]:
    """Every resolver call's name in one value parsed by OmegaConf's own grammar (`grammar_parser.parse`)."""
    # a name that is itself interpolated (${${x}:...}) is what it will resolve to, unknown here: reported as written
    if type(tree).__name__ == "InterpolationResolverContext":
        yield tree.resolverName().getText()
    for i in range(tree.getChildCount() if hasattr(tree, "getChildCount") else 0):
        yield from resolver_calls(tree.getChild(i))


def unsafe_resolvers(node: Any) -> list[str]:
    """`resolver (at path)` for every resolver call in the unresolved config tree `node` (any key, any nesting, any
    spelling OmegaConf accepts) that is not known to only read (SAFE_RESOLVERS)."""
    found = []
    for path, text in _strings(node, ""):
        try:
            names = list(resolver_calls(grammar_parser.parse(text, parser_rule="configValue")))
        except GrammarParseError:
            names = ["an interpolation OmegaConf cannot parse"]
        found += [f"{name} (at {path})" for name in names if name not in SAFE_RESOLVERS]
    return found


def check_resolvers(node: Any, what: str, fix: str) -> None:
    """A ConfigError, before anything is resolved, if the unresolved config tree `node` (`what`) calls a resolver that
    does more than read; `fix` says what to do instead."""
    unsafe = unsafe_resolvers(node)
    if unsafe:
        raise ConfigError(f"{what} calls resolvers that do more than read: {', '.join(sorted(set(unsafe)))}; {fix}")
