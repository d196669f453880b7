"""Checks of a composed config before anything is built: a mistake is one paragraph naming the key and what to type.

Hydra refuses a misspelled key unless it is added with `+`, and then accepts anything: `+trainer.max_duraton=60st`
would train the default duration. So every key under `trainer` must be one runner reads, and every key of a component
(a node with `_target_`) must be a parameter of what it names. Hydra also accepts any value for any key
(`model.dropout=abc`): a value must fit the type its parameter is annotated with, so that a wrong type is refused here
by name instead of failing as a TypeError deep inside torch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from runner import ConfigError
from runner.config.hints import check_value, fits, plain_value, set_at, typed
from runner.config.resolvers import check_interpolations
from runner.config.signatures import parameters_of
from runner.config.trust import HYDRA_KEYS
from runner.optimizers import MAX_NS_STEPS

# What runner reads under `trainer` (runner/conf/config.yaml documents each), and the type of each; durations are
# parsed by runner.progress, whose errors name the units (a duration given as a number reads as a bad duration).
TRAINER_KEYS: dict[str, Any] = {
    "max_duration": Any,
    "max_time": str | float | None,
    "accumulate_grad_batches": int,
    "gradient_clip_val": float | None,
    "val_interval": Any,
    "log_interval": Any,
    "max_nonfinite_steps": int,
    "stop_check_interval": Any,
    "val_during_training": float | int | None,
    "peak_flops": float | None,
    "short_run_tolerance": float | None,
}
# The top-level settings of runner/conf/config.yaml that are not a group's, and their types.
TOP_KEYS: dict[str, Any] = {
    "monitor": str | None,
    "mode": Literal["min", "max"],
    "run_dir": str,
    "resume": str | None,
    "resume_allow_changes": bool,
    "init_from": str | None,
    "init_strict": bool,
    "trusted_targets": list[str],
    "threads": int | None,
    "fail_fast": bool,
}
# Optimizer settings torch would refuse with a traceback, or accept where no run can learn: (low, high, closed at
# high, an example). The learning rate's bound is what the optimizer's float32 arithmetic survives: above ~1e37
# torch's Adam raises "value cannot be converted to type float without overflow" mid-step (1e99 did). Up to it, a huge
# rate is a run that diverges, which the non-finite guard stops with exit 3 (the tests diverge runs with 1e30).
OPTIMIZER_RANGES = {
    "lr": (0.0, 1e30, True, "3e-4"),
    "weight_decay": (0.0, math.inf, False, "0.01"),
    "eps": (0.0, 1.0, True, "1e-8"),
    "adam_eps": (0.0, 1.0, True, "1e-8"),  # Muon's Adam part
    "momentum": (0.0, 1.0, False, "0.9"),
    "dampening": (0.0, 1.0, True, "0.0"),
}


# Seeds every generator of a run takes: torch.manual_seed takes 64 bits, numpy's np.random.seed (a DataLoader
# worker's) 32, and runner derives seeds from `seed` by adding to it (the data order of epoch e: seed + e), which a
# seed near 2**64 would overflow in the middle of a run. Within 32 bits every seed derived from it stays inside both.
MAX_SEED = 2**32 - 1


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


# Component keys runner reads itself, before it calls the target (runner/build.py).
RUNNER_READS = {"optimizer": ("lr_scale",)}


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key under `trainer` that runner does not read, and a component key its target does not take."""
    for key in cfg.get("trainer", {}):
        if key not in TRAINER_KEYS:
            raise ConfigError(
                f"trainer.{key} is not a trainer setting ({_nearest(key, set(TRAINER_KEYS), 'trainer.')}); "
                "nothing would read it"
            )
    for path, node, accepted, _ in _targets(cfg):
        if accepted is None:
            continue
        for key in node.keys():
            if key in HYDRA_KEYS or key in accepted or key in RUNNER_READS.get(path, ()):
                continue
            raise ConfigError(
                f"{path}.{key} is not a parameter of {node._target_} ({_nearest(str(key), accepted, path + '.')}); "
                f"nothing would read it. Remove it, or choose another {path.split('.')[0]} option"
            )


def _targets(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, set[str] | None, dict[str, tuple[Any, Any]]]]:
    # every component of the job config with what its target takes
    for path, node in _components(cfg, ""):
        if path == "hydra" or path.startswith("hydra."):
            continue
        target = OmegaConf.select(node, "_target_")
        if isinstance(target, str):
            yield path, node, *parameters_of(target, path)


# ---- types ----------------------------------------------------------------------------------------------------------
def check_types(cfg: DictConfig) -> None:
    """Refuse a value whose type does not fit its setting: the top-level keys, trainer's, and every component key whose
    parameter is annotated (a string for a number, a list for a scalar, null where a value is needed)."""
    for key, hint in TOP_KEYS.items():
        if key in cfg and (got := plain_value(cfg, key))[0]:
            check_value(set_at(cfg, key, key), got[1], hint)
    for key, hint in TRAINER_KEYS.items():
        if key in cfg.get("trainer", {}) and (got := plain_value(cfg.trainer, key))[0]:
            check_value(set_at(cfg.trainer, key, f"trainer.{key}"), got[1], hint)
    for path, node, _, params in _targets(cfg):
        for key in node.keys():
            if key in params and key not in HYDRA_KEYS and (got := plain_value(node, key))[0]:
                check_value(set_at(node, key, f"{path}.{key}"), got[1], *params[key])


# ---- values ---------------------------------------------------------------------------------------------------------
def _missing(node: Any, path: str) -> Iterator[str]:
    # Keys left as ??? (OmegaConf.missing_keys resolves interpolations on the way and raises on `${a}` when a is ???).
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = f"{path}.{key}" if path else str(key)
            if OmegaConf.is_missing(node, key):
                yield child
            else:
                yield from _missing(node._get_node(key), child)


def _check_optimizer(optimizer: Any) -> None:
    # ranges of the optimizer settings (their types are checked with the components')
    for key, (low, high, closed, example) in OPTIMIZER_RANGES.items():
        value = optimizer.get(key)
        if value is None or not fits(value, float):
            continue
        if not (math.isfinite(value) and low <= value and (value <= high if closed else value < high)):
            span = f"in [{low:g}, {high:g}{']' if closed else ')'}" if math.isfinite(high) else f">= {low:g}"
            raise ConfigError(
                f"optimizer.{key} must be a finite number {span}, got {value!r}: e.g. optimizer.{key}={example}"
            )
    for key in ("betas", "adam_betas"):  # Adam's, and Muon's Adam part's: a beta >= 1 makes its bias correction <= 0
        betas = optimizer.get(key)
        if isinstance(betas, Sequence) and not isinstance(betas, str):
            if len(betas) != 2 or not all(fits(b, float) and 0 <= b < 1 for b in betas):
                raise ConfigError(
                    f"optimizer.{key} must be two numbers in [0, 1) (the moving averages' decay rates), got "
                    f"{typed(list(betas))}: e.g. optimizer.{key}=[0.9,0.999]"
                )
    # Adam divides by sqrt(v) + eps: where a gradient was always 0 (an SAE latent that never fired), 0 / 0 makes the
    # weight NaN for good; Muon divides a zero matrix by max(its norm, eps)
    for key in ("eps", "adam_eps"):
        if fits(optimizer.get(key), float) and optimizer.get(key) == 0:
            raise ConfigError(
                f"optimizer.{key} must be > 0: with 0, every weight whose gradient is 0 becomes NaN at its first "
                f"step (0 / 0): e.g. optimizer.{key}=1e-8"
            )
    _check_muon(optimizer)
    scale = optimizer.get("lr_scale")
    if scale is not None and not (isinstance(scale, Mapping) and all(isinstance(k, str) for k in scale)):
        raise ConfigError(
            f"optimizer.lr_scale must map parameter names to multiples of the lr, got {typed(scale)}: e.g. "
            "'+optimizer.lr_scale={W_enc:0.5}' (fnmatch patterns on the names or their last parts)"
        )
    if optimizer.get("nesterov") and (not optimizer.get("momentum") or optimizer.get("dampening")):
        raise ConfigError(
            "optimizer.nesterov=true needs optimizer.momentum > 0 and optimizer.dampening=0: e.g. "
            "optimizer.momentum=0.9"
        )


def _check_muon(optimizer: Any) -> None:
    # Muon's Newton-Schulz iteration (runner/optimizers.py): torch's Muon refuses 100 steps or more (each is three
    # matmuls of every matrix, so a large count never ends a step), 0 steps would not orthogonalise at all, and a
    # coefficient that is not finite makes every matrix's update NaN
    steps = optimizer.get("ns_steps")
    if fits(steps, int) and not 1 <= steps <= MAX_NS_STEPS:
        raise ConfigError(
            f"optimizer.ns_steps must be a whole number in [1, {MAX_NS_STEPS}] (Newton-Schulz steps per update; 5 "
            f"orthogonalise well, and torch's Muon refuses 100 or more), got {steps!r}: e.g. optimizer.ns_steps=5"
        )
    coefficients = optimizer.get("ns_coefficients")
    if isinstance(coefficients, Sequence) and not all(fits(c, float) and math.isfinite(c) for c in coefficients):
        raise ConfigError(
            f"optimizer.ns_coefficients must be three finite numbers, got {typed(list(coefficients))}: e.g. "
            "optimizer.ns_coefficients=[3.4445,-4.775,2.0315] (Keller Jordan's, torch's default)"
        )


def check_values(cfg: DictConfig) -> None:
    """Values that would otherwise fail deep inside numpy or torch with a traceback."""
    missing = sorted(_missing(cfg, ""))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be set (the config leaves {'them' if len(missing) > 1 else 'it'} as ???): "
            f"add {' '.join(f'{k}=...' for k in missing)} to the command line"
        )
    check_interpolations(cfg)
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"seed must be a whole number in [0, {MAX_SEED}] (2**32 - 1, what numpy and torch both take), got "
            f"{seed!r}: e.g. seed=0"
        )
    clip = cfg.get("trainer", {}).get("gradient_clip_val")
    # nan passed `clip <= 0` and made every gradient NaN (clipping scales by clip / norm), so the weights with it; an
    # infinite clip clips nothing, 0 zeroes every gradient: neither is what anyone means (null turns clipping off)
    if fits(clip, float) and not (math.isfinite(clip) and clip > 0):
        raise ConfigError(
            f"trainer.gradient_clip_val must be > 0 or null (off), got {clip!r}: a finite number, the largest global "
            "gradient norm a step keeps, e.g. trainer.gradient_clip_val=1.0"
        )
    _check_optimizer(cfg.get("optimizer", {}))
    device = cfg.get("distributed", {}).get("device")
    if isinstance(device, str) and device != "auto":
        try:
            torch.device(device)
        except (RuntimeError, ValueError):
            raise ConfigError(
                f"distributed.device={device!r} is not a device: auto (a GPU when there is one), cpu, cuda, cuda:1"
            ) from None
    workers = cfg.get("data", {}).get("num_workers")
    if workers is not None and (not isinstance(workers, int) or workers < 0):
        raise ConfigError(f"data.num_workers must be a whole number >= 0 (0: load in this process), got {workers!r}")


def check_config(cfg: DictConfig) -> None:
    """check_values, check_keys and check_types."""
    check_values(cfg)
    check_keys(cfg)
    check_types(cfg)
