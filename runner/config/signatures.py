"""What a config component's `_target_` takes: its keyword parameters, their type hints and defaults (the config
checks read them to refuse a key nothing would read and a value of the wrong type)."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

from runner import ConfigError


def parameters_of(target: str, path: str) -> tuple[frozenset[str] | None, dict[str, tuple[Any, Any]]]:
    """The keyword parameters of the callable `target` names (None if it takes **kwargs that cannot be followed, or
    cannot be inspected), and {parameter: (its type hint, its default)} where those can be read. A runner or
    experiments class whose **kwargs go to its base classes' __init__ (a data module of DataModule's loader options,
    an SAE of the base SAE's) takes theirs too."""
    from hydra._internal.utils import _locate

    try:
        obj = _locate(target)
    except Exception as error:
        raise ConfigError(
            f"{path}._target_={target} cannot be imported ({str(error).splitlines()[0]}): check its spelling, or "
            f"choose another {path.split('.')[0]} option"
        ) from None
    try:  # cached by the callable itself, not its name: read twice a build, and a sweep builds once a job
        return _parameters(obj)
    except TypeError:  # an unhashable callable object
        return _parameters.__wrapped__(obj)


@functools.lru_cache(maxsize=512)
def _parameters(obj: Any) -> tuple[frozenset[str] | None, dict[str, tuple[Any, Any]]]:
    try:
        inits = [c.__init__ for c in obj.__mro__ if "__init__" in c.__dict__] if inspect.isclass(obj) else [obj]
    except Exception:  # instantiation will say what is wrong with the target itself
        return None, {}
    accepted: set[str] = set()
    hinted: dict[str, tuple[Any, Any]] = {}
    for init in inits:
        if inits[0] is not init and not getattr(init, "__module__", "").startswith(("runner.", "experiments.")):
            return None, hinted  # **kwargs handed to code not ours (nn.Module, a library): anything may be read
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None, hinted
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # an annotation that names what only a type checker imports: no types from this one
            hints = {}
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
        for p in named:
            hinted.setdefault(p.name, (hints.get(p.name, Any), p.default))
        accepted |= {p.name for p in named}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return frozenset(accepted), hinted
    return None, hinted
