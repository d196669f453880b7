"""The config's own resolvers (runner_now, runner_hydra_subdir, runner_direction), registered explicitly by the
entry points that compose a config: the CLI, the SLURM launcher's tasks, tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

_launch = {"time": None}  # rank 0's clock under torchrun (set_launch_time), so that every rank dates the same folder


def set_launch_time(seconds: float | None) -> None:
    """The time that ${runner_now:...} formats (None: the current time at each resolution)."""
    _launch["time"] = seconds


def _now(pattern: str) -> str:
    return time.strftime(pattern, time.localtime(_launch["time"] or time.time()))


def _hydra_subdir(output_dir: str, resume: Any) -> str:
    # A launch that resumes into an existing run folder keeps that folder's .hydra/ and stores its own beside it.
    if resume is not None and (Path(output_dir) / ".hydra" / "config.yaml").is_file():
        return f".hydra/resume-{time.strftime('%Y%m%d-%H%M%S')}"
    return ".hydra"


def _direction(mode: str) -> str:
    # Optuna's direction from the config's `mode` of `monitor` (runner/conf/hparams_search/): one setting, not two
    return {"min": "minimize", "max": "maximize"}[str(mode)]


def register() -> None:
    """Register runner's resolvers with OmegaConf (idempotent)."""
    OmegaConf.register_new_resolver("runner_now", _now, replace=True)
    OmegaConf.register_new_resolver("runner_hydra_subdir", _hydra_subdir, replace=True)
    OmegaConf.register_new_resolver("runner_direction", _direction, replace=True)
