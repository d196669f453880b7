"""A run refused before it trains (a ConfigError: a bad value, a missing ??? value) leaves no run folder behind. Its
error is on the console; a folder holding only Hydra's copy of the config and a log of that one error would be
listed beside real runs (and by `runner.tools.report`) as if it were one.

Only a folder this launch made is removed (runner_fresh's dated folder, or a hydra.run.dir that did not exist yet),
only on rank 0, only while no other process holds it, and only while it holds nothing but what a refused launch
writes: a resumed run's folder, a folder the user made, or one with metrics or checkpoints is never touched.
A sweep's jobs keep theirs: results.csv reads each failed job's summary.json.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.distributed.env import environment
from runner.rundir import CONFIG, LOCK, LOG, RANK_LOG, FolderInUse, lock, unlock

# What a launch refused while its run is built writes: Hydra's .hydra/, runner.log, logs/rank-0.log, the lock. A run
# that got further has run.json (runner.train writes it once the run is built): its folder is kept.
REFUSAL_FILES = {Path(CONFIG).parts[0], LOG, Path(RANK_LOG).parts[0], LOCK}

_made: dict[Path, list[Path]] = {}  # folders runner_fresh made -> the folders mkdir made for each, innermost first
_launch: dict[str, list[Path]] = {"made": []}  # this launch's run folder and its new parents, if the launch made them


def missing(folder: str | Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, innermost first: what mkdir(parents=True) makes."""
    path = Path(os.path.abspath(folder))
    return [p for p in (path, *path.parents) if not p.exists()]


def note_made(made: list[Path]) -> None:
    """Record that this process made the folder `made[0]` (and the parents after it): runner_fresh calls it."""
    _made[made[0]] = made


class NewRunFolder(Callback):
    """Hydra callback: before Hydra makes a single run's folder, note whether this launch is the one making it.

    It resolves hydra.run.dir a moment before Hydra does (runner_fresh caches its choice, so both see one folder)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Note the run folder (and parents) that this launch makes, on rank 0."""
        _launch["made"] = []
        _made.clear()  # what runner_fresh makes while hydra.run.dir resolves below is this launch's folder
        try:
            folder = Path(os.path.abspath(str(config.hydra.run.dir)))
        except Exception:  # an interpolation only Hydra's job can resolve: not known to be new, so never removed
            folder = None
        if folder is not None and environment()["rank"] == 0:  # under torchrun, the other ranks touch no folder
            _launch["made"] = _made.get(folder) or missing(folder)
        if torch.distributed.is_initialized():
            # Hydra makes the folder next, on every rank: one that made it before rank 0 looked would hide that this
            # launch made it, and a refused launch would leave it behind
            torch.distributed.barrier()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep's job folders are kept (results.csv reads them): forget any earlier launch of this process."""
        _launch["made"] = []


def remove_refused(run_dir: str | Path) -> bool:
    """Remove `run_dir` (and the parents made for it) if this launch made it and it holds only REFUSAL_FILES;
    whether it is gone. Call it only for a run refused before training (a ConfigError; not a full disk)."""
    made = _launch["made"]
    if not made or made[0] != Path(os.path.abspath(run_dir)):
        return False
    folder = made[0]
    try:
        lock(folder, "run folder")  # this launch's already (runner.__main__ claims it), or taken now: no other writer
    except FolderInUse:
        return False
    if {p.name for p in folder.iterdir()} <= REFUSAL_FILES:
        # Open files (runner.log's copy of the console, the rank log) now write to the removed inodes: nothing
        # written after this recreates the folder
        shutil.rmtree(folder, ignore_errors=True)
        for parent in made[1:]:
            try:
                parent.rmdir()  # only while empty: another run may have put its folder beside this one meanwhile
            except OSError:
                break
    unlock(folder)
    return not folder.exists()
