"""The config's own resolvers (runner_now, runner_fresh, runner_hydra_subdir, runner_direction), registered
explicitly by the entry points that compose a config: the CLI, the SLURM launcher's tasks, tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.refused import missing, note_made
from runner.rundir import CLASH

_launch = {"time": None}  # rank 0's clock under torchrun (set_launch_time), so that every rank dates the same folder


def set_launch_time(seconds: float | None) -> None:
    """The time that ${runner_now:...} formats (None: the current time at each resolution)."""
    _launch["time"] = seconds


def _now(pattern: str) -> str:
    return time.strftime(pattern, time.localtime(_launch["time"] or time.time()))


def _hydra_subdir(output_dir: str, resume: Any) -> str:
    # A launch that resumes into an existing run folder keeps that folder's .hydra/ and stores its own beside it. A
    # new run pointed at a folder that holds a run must not overwrite its config either: it writes aside, and the
    # CLI then refuses it (runner.rundir.claim).
    # Decided once per folder: Hydra resolves it again after writing .hydra/config.yaml.
    key = f"{output_dir}\0{resume}"
    if key not in _subdirs:
        kind = "resume" if resume is not None else CLASH
        existing = (Path(output_dir) / ".hydra" / "config.yaml").is_file()
        _subdirs[key] = f".hydra/{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" if existing else ".hydra"
    return _subdirs[key]


_claimed: dict[str, str] = {}
_subdirs: dict[str, str] = {}


def _fresh(directory: str, resume: Any = None) -> str:
    # A dated run folder of its own: `directory` if this process can create it, else `directory`-1, -2... (mkdir is
    # atomic: two launches in the same second get two folders). A resume (or an elastic restart, which resumes) goes
    # back to `directory` itself. Under a process group, rank 0 chooses and every rank gets its choice. Cached: Hydra
    # resolves the run folder several times.
    if resume is not None:
        return directory
    if directory not in _claimed:
        import torch.distributed as dist

        choice = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            choice[0] = _claim(directory)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        _claimed[directory] = choice[0]
    return _claimed[directory]


def _claim(directory: str) -> str:
    parents = missing(Path(directory).parent)
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        candidate = directory if n == 0 else f"{directory}-{n}"
        try:
            os.mkdir(candidate)
            note_made([Path(os.path.abspath(candidate)), *parents])  # a refused run removes them (runner.refused)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder beside {directory}")


def _direction(mode: str) -> str:
    # Optuna's direction from the config's `mode` of `monitor` (runner/conf/hparams_search/): one setting, not two
    return {"min": "minimize", "max": "maximize"}[str(mode)]


def register() -> None:
    """Register runner's resolvers with OmegaConf (idempotent)."""
    OmegaConf.register_new_resolver("runner_now", _now, replace=True)
    OmegaConf.register_new_resolver("runner_hydra_subdir", _hydra_subdir, replace=True)
    OmegaConf.register_new_resolver("runner_fresh", _fresh, replace=True)
    OmegaConf.register_new_resolver("runner_direction", _direction, replace=True)
