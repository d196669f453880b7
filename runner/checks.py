"""Checks of a composed config before anything is built: a mistake is one paragraph naming the key and what to type.

Hydra refuses a misspelled key unless it is added with `+`, and then accepts anything: `+trainer.max_duraton=60st`
would train the default duration. So every key under `trainer` must be one runner reads, and every key of a component
(a node with `_target_`) must be a parameter of what it names.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner import ConfigError

# What runner reads under `trainer` (runner/conf/config.yaml documents each).
TRAINER_KEYS = {
    "max_duration",
    "max_time",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "val_interval",
    "log_interval",
    "max_nonfinite_steps",
    "stop_check_interval",
    "peak_flops",
}
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


# Names from other libraries that difflib cannot see are the same setting.
SYNONYMS = {"learning_rate": "lr", "wd": "weight_decay", "epochs": "max_duration", "max_steps": "max_duration"}


def _nearest(key: str, valid: set[str], prefix: str) -> str:
    close = [SYNONYMS[key]] if SYNONYMS.get(key) in valid else []
    close = close or difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
    return f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(sorted(valid))}"


def _components(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node.keys():
            if isinstance(key, str) and not key.startswith("_"):
                yield from _components(node._get_node(key), f"{path}.{key}" if path else key)


def _parameters(target: str) -> set[str] | None:
    """The keyword parameters of the callable `target` names; None if it takes **kwargs that cannot be followed, or
    cannot be inspected. A runner or experiments class whose **kwargs go to its base classes' __init__ (a data module
    of DataModule's loader options, an SAE of the base SAE's) takes theirs too."""
    from hydra._internal.utils import _locate

    try:
        obj = _locate(target)
        inits = [c.__init__ for c in obj.__mro__ if "__init__" in c.__dict__] if inspect.isclass(obj) else [obj]
    except Exception:  # instantiation will say what is wrong with the target itself
        return None
    accepted: set[str] = set()
    for init in inits:
        if inits[0] is not init and not getattr(init, "__module__", "").startswith(("runner.", "experiments.")):
            return None  # **kwargs handed to code that is not ours (nn.Module, a library): anything may be read
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        accepted |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return accepted
    return None


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key under `trainer` that runner does not read, and a component key its target does not take."""
    for key in cfg.get("trainer", {}):
        if key not in TRAINER_KEYS:
            raise ConfigError(
                f"trainer.{key} is not a trainer setting ({_nearest(key, TRAINER_KEYS, 'trainer.')}); "
                "nothing would read it"
            )
    for path, node in _components(cfg, ""):
        if path == "hydra" or path.startswith("hydra."):
            continue
        target = OmegaConf.select(node, "_target_")
        accepted = _parameters(target) if isinstance(target, str) else None
        if accepted is None:
            continue
        for key in node.keys():
            if key in HYDRA_KEYS or key in accepted:
                continue
            raise ConfigError(
                f"{path}.{key} is not a parameter of {target} ({_nearest(str(key), accepted, path + '.')}); "
                f"nothing would read it. Remove it, or choose another {path.split('.')[0]} option"
            )


def _missing(node: Any, path: str) -> Iterator[str]:
    # Keys left as ??? (OmegaConf.missing_keys resolves interpolations on the way and raises on `${a}` when a is ???).
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = f"{path}.{key}" if path else str(key)
            if OmegaConf.is_missing(node, key):
                yield child
            else:
                yield from _missing(node._get_node(key), child)


def check_values(cfg: DictConfig) -> None:
    """Values that would otherwise fail deep inside numpy or torch with a traceback."""
    missing = sorted(_missing(cfg, ""))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be set (the config leaves {'them' if len(missing) > 1 else 'it'} as ???): "
            f"add {' '.join(f'{k}=...' for k in missing)} to the command line"
        )
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a whole number >= 0, got {seed!r}: e.g. seed=0")
    lr = cfg.get("optimizer", {}).get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0):
        raise ConfigError(f"optimizer.lr must be a finite number >= 0, got {lr!r}: e.g. optimizer.lr=3e-4")
    workers = cfg.get("data", {}).get("num_workers")
    if workers is not None and (not isinstance(workers, int) or workers < 0):
        raise ConfigError(f"data.num_workers must be a whole number >= 0 (0: load in this process), got {workers!r}")


def check_config(cfg: DictConfig) -> None:
    """check_values and check_keys."""
    check_values(cfg)
    check_keys(cfg)
