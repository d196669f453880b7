"""What runner's tools (features, evaluate, sae_eval) read: a finished run (runner.trained.load_trained), or an SAE
folder of SAELens or sparsify attached to the model it reads (experiments/sae/attach.py), as if runner had trained it
there."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from runner import ConfigError
from runner.rundir import CONFIG
from runner.trained import TRUSTED_TARGETS, load_trained

# What a tool takes to attach an SAE folder of SAELens or sparsify to its model (load_model)
ATTACH = ("source", "hook", "module", "target", "skip_positions", "inputs")
ATTACH_TEXT = ("source", "hook", "module", "target")  # read as given; the others as Hydra reads values


def is_foreign(path: str | Path) -> bool:
    """Whether `path` is an SAE folder of SAELens or sparsify (cfg.json, or a sparsify run's folders of them), not
    a runner run (.hydra/)."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG).is_file():
        return False
    return (path / "cfg.json").is_file() or any((p / "cfg.json").is_file() for p in path.iterdir() if p.is_dir())


def load_model(
    path: str | Path,
    trusted: Sequence[str] = TRUSTED_TARGETS,
    attach: dict[str, Any] | None = None,
    weights: str | Path | None = None,
    callbacks: bool = False,
) -> tuple[nn.Module, DictConfig]:
    """What runner's tools read: a finished run's model and config (load_trained), or an SAE folder of SAELens or
    sparsify attached to the model it reads, as if runner had trained it there (`attach`: source, hook, module,
    target, skip_positions, inputs: a transformers source's text; experiments/sae/attach.py)."""
    attach = {key: value for key, value in (attach or {}).items() if value is not None}
    if is_foreign(path):
        if weights is not None:
            raise ConfigError(f"weights={weights}: an SAE folder of SAELens or sparsify holds its own weights")
        from experiments.sae.attach import attached  # noqa: PLC0415 - the SAE task's, for SAE folders alone

        return attached(path, trusted=tuple(trusted), **attach)
    if attach:
        raise ConfigError(
            f"{', '.join(f'{k}=' for k in attach)}: for an SAE folder of SAELens or sparsify; {path} is a runner "
            "run, whose config names what it read"
        )
    return load_trained(path, trusted, weights=weights, callbacks=callbacks)
