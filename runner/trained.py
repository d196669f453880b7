"""A finished run rebuilt from its folder: its model with trained weights, its data and its metric callbacks, from its
own .hydra/config.yaml, and only where every `_target_` there is trusted (an SAE's source, runner.evaluate)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import ConfigError
from runner.build import build_data, decided_by_data
from runner.ckpt.files import load_weights
from runner.rundir import CONFIG, MODEL

# What another run's .hydra/config.yaml may name as `_target_`s when runner rebuilds its model and data
# (source.checkpoint): module paths of the project's own tasks. Overridden by the config key `trusted_targets`.
TRUSTED_TARGETS = ("experiments", "runner.data")


def _untrusted_targets(node: Any, trusted: Sequence[str], path: str) -> list[str]:
    # Every _target_ in a resolved config tree that is not under one of the trusted module paths (whole components:
    # `experiments` trusts experiments.digits.MLPClassifier, not experimentsX.evil).
    found = []
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None and not any(
            isinstance(target, str) and target.split(".")[: len(t.split("."))] == t.split(".") for t in trusted
        ):
            found.append(f"{path}._target_={target}")
        for key, value in node.items():
            found += _untrusted_targets(value, trusted, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _untrusted_targets(value, trusted, f"{path}[{i}]")
    return found


def _trusted_node(cfg: DictConfig, key: str, config: Path, trusted: Sequence[str]) -> DictConfig:
    """`cfg[key]` resolved, after checking that every `_target_` in it is trusted: a run folder from elsewhere may be
    anybody's, and instantiating its config would run whatever it names (torch.load of a pickle, builtins.open...)."""
    try:
        node = OmegaConf.to_container(cfg[key], resolve=True)  # an interpolated `_target_: ${x}` is checked resolved
    except Exception as error:
        raise ConfigError(f"cannot read `{key}` of {config}: {error}") from None
    untrusted = _untrusted_targets(node, trusted, key)
    if untrusted:
        raise ConfigError(
            f"refusing to build the {key} of {config}: it names {', '.join(untrusted)}, which is not under the "
            f"trusted module paths {list(trusted)}. A run folder's config could run any code it names; if this run "
            "is yours and its classes live in your own package, add that package: "
            f"trusted_targets=[{','.join(trusted)},mypackage]"
        )
    return OmegaConf.create(node)


def load_trained(
    checkpoint: str | Path,
    trusted: Sequence[str] = TRUSTED_TARGETS,
    weights: str | Path | None = None,
    callbacks: bool = False,
) -> tuple[nn.Module, DictConfig]:
    """A model trained by runner, frozen in eval mode: `checkpoint` is a run folder or its model.safetensors;
    `weights`, other weights for that run's model (one of its checkpoint folders, a .safetensors file).

    The model is built from that run's own config only if every `_target_` in it is under `trusted` module paths;
    the returned config's `data` is checked the same way before build_data may use it. `callbacks=True` adds the
    run's callbacks, resolved but not checked: measuring_callbacks checks each one it would build.
    """
    path = Path(checkpoint)
    run_dir = path if path.is_dir() else path.parent
    what = "source.checkpoint" if weights is None else "weights"
    weights = Path(weights) if weights is not None else run_dir / MODEL if path.is_dir() else path
    config = run_dir / CONFIG
    for needed in (weights, config):
        if not needed.exists():
            raise ConfigError(
                f"{needed} does not exist: give the folder of a finished runner run (or its "
                "model.safetensors), e.g. source.checkpoint=outputs/2026-01-01/12-00-00"
            )
    try:
        cfg = OmegaConf.load(config)
    except Exception as error:
        raise ConfigError(f"{config} is not a readable YAML config ({error})") from None
    for key in ("model", "data"):
        if key not in cfg:
            raise ConfigError(f"{config} has no `{key}`: is {run_dir} the folder of a runner run?")
    if "run_dir" in cfg:  # Hydra's output folder when it ran; outside Hydra, the folder where the run now is
        cfg.run_dir = str(run_dir)
    source = OmegaConf.create({k: _trusted_node(cfg, k, config, trusted) for k in ("model", "data")})
    if callbacks:
        source.callbacks = {name: _resolved(cfg.callbacks, name) for name in cfg.get("callbacks") or {}}
    # A key the data decided (an SAE's d_in) is null in the saved config: the data decides it again
    decided = decided_by_data(source.model, build_data(source)) if _has_null(source.model) else {}
    model = instantiate(source.model, **decided)
    try:
        load_weights(model, weights, strict=True, what=what)
    except ConfigError as error:  # a truncated file or weights of another architecture
        raise ConfigError(f"cannot load {weights} into the model of {config}: {error}") from None
    return model.eval().requires_grad_(False), source


def _resolved(group: DictConfig, name: str) -> Any:
    node = group[name]
    try:
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    except Exception as error:  # an interpolation only Hydra resolves: that callback is left out, and said
        print(f"callbacks.{name} not run: {str(error).splitlines()[0]}", file=sys.stderr)
        return None


def measuring_callbacks(cfg: DictConfig, trusted: Sequence[str] = TRUSTED_TARGETS) -> list[Any]:
    """The callbacks of a finished run's config (load_trained's, callbacks=True) that add validation metrics, those
    with `provides`: perplexity, an SAE's recovered features or its spliced loss; runner.evaluate runs them after the
    validation split, as the run did. One whose `_target_` is not trusted (runner's own callbacks are) is not built:
    said on stderr, with how to trust it."""
    found = []
    for name, node in (cfg.get("callbacks") or {}).items():
        if not node or "_target_" not in node:
            continue
        untrusted = _untrusted_targets(
            OmegaConf.to_container(node), [*trusted, "runner.callbacks"], f"callbacks.{name}"
        )
        if untrusted:
            print(
                f"callbacks.{name} not run: {untrusted[0]} is not under the trusted module paths {list(trusted)} "
                "(add its package to trusted_targets to run it)",
                file=sys.stderr,
            )
            continue
        callback = instantiate(node)
        if callback.provides:
            found.append(callback)
    return found


def _has_null(node: DictConfig) -> bool:
    # literal nulls only (an interpolation that resolves to null is the config's own choice, not the data's)
    return any(value is None for value in OmegaConf.to_container(node, resolve=False).values())
