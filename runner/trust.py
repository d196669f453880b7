"""What a run folder's config may instantiate. A run folder may be anybody's, and Hydra would call whatever its
`_target_`s name (torch.load of a pickle, os.system...). Trust is decided on what a target *is*, never on how it is
spelled: Hydra resolves `runner.data.torch.load` attribute by attribute to `torch.load`, so a prefix test on the string
would let it through."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from runner import ConfigError

# Resolvers a run folder's config may use when it is resolved before the check: each only reads (the environment, the
# config itself, the clock, the running job's Hydra config). Any other (runner_fresh makes folders; a plugin's may do
# anything) is refused unresolved.
SAFE_RESOLVERS = {
    "oc.env",
    "oc.select",
    "oc.decode",
    "oc.create",
    "oc.dict.keys",
    "oc.dict.values",
    "now",
    "hydra",
    "runner_now",
}
_RESOLVER = re.compile(r"\$\{\s*([\w.\-]+)\s*:")


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
        if (
            i < len(parts)
            and not isinstance(obj, ModuleType)
            and not (inspect.isclass(obj) and _defined_in(obj, trusted))
        ):
            return f"goes through `{here}`, which is neither a module nor a class of a trusted package"
    callable_ = inspect.isclass(obj) or inspect.isfunction(obj)
    if inspect.ismethod(obj):  # a classmethod of a trusted class
        callable_ = inspect.isclass(obj.__self__) and _defined_in(obj.__self__, trusted)
        obj = obj.__func__
    if not callable_:
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


def _targets(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield f"{path}._target_", node["_target_"]
        for key, value in node.items():
            yield from _targets(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{path}[{i}]")


def problems(node: Any, trusted: Sequence[str], path: str) -> tuple[list[str], list[str]]:
    """(forged, untrusted): every `_target_` of a resolved config tree (nested, in lists, in `_args_`) that is spelled
    as a trusted path but is something else, and every one outside the trusted paths, each as `path=target: why`."""
    forged, untrusted = [], []
    for where, target in _targets(node, path):
        found = target_problem(target, trusted)
        if found is not None:
            (forged if found[1] else untrusted).append(f"{where}={target} {found[0]}")
    return forged, untrusted


def unsafe_resolvers(node: Any) -> list[str]:
    """The resolvers an unresolved config tree calls that are not known to only read (SAFE_RESOLVERS)."""
    if isinstance(node, dict):
        return [name for value in node.values() for name in unsafe_resolvers(value)]
    if isinstance(node, list):
        return [name for value in node for name in unsafe_resolvers(value)]
    return [name for name in _RESOLVER.findall(node) if name not in SAFE_RESOLVERS] if isinstance(node, str) else []


def check_resolvers(node: Any, what: str, fix: str) -> None:
    """A ConfigError, before anything is resolved, if the unresolved config tree `node` (`what`) calls a resolver that
    does more than read; `fix` says what to do instead."""
    unsafe = unsafe_resolvers(node)
    if unsafe:
        raise ConfigError(f"{what} calls the resolvers {sorted(set(unsafe))}: {fix}")


def check(node: Any, trusted: Sequence[str], path: str, source: str) -> None:
    """A ConfigError naming every `_target_` of `node` (a resolved config tree read from `source`) that may not run."""
    forged, untrusted = problems(node, trusted, path)
    if forged or untrusted:
        raise ConfigError(
            f"refusing to build the {path} of {source}: {'; '.join(forged + untrusted)}. A run folder's config could "
            f"run any code it names, so only classes and functions defined in the trusted module paths {list(trusted)} "
            "are built; if this run is yours and its classes live in your own package, add that package: "
            f"trusted_targets=[{','.join(trusted)},mypackage]"
        )
