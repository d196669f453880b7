"""Callbacks for tests/e2e/test_fsdp.py's kill trials: one rank SIGKILLed in the middle of a distributed
save (its shards written, its own files and the manifest not yet), as the OOM killer or a lost node would; a save held
in the writer thread while a test kills the whole job; one rank's disk full.

    checkpoint._target_=_dcp_ranks.KillMidSave +checkpoint.kill_folder=step-00000020 +checkpoint.kill_rank=1
    checkpoint._target_=_dcp_ranks.HoldSeal +checkpoint.hold_folder=step-00000020 checkpoint.async=true
    +callbacks.full._target_=_dcp_ranks.FullDiskOnRank +callbacks.full.step=12 +callbacks.full.rank=1
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.ckpt.callback import Checkpoint
from runner.run import Callback


class KillMidSave(Checkpoint):
    """Kills rank `kill_rank` after DCP wrote the shards of `kill_folder`, before that rank seals it."""

    def __init__(self, kill_folder: str | None = None, kill_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_folder, self.kill_rank = kill_folder, kill_rank

    def _finish(self, folder: Path, write: Callable[[], dict[str, Any] | None]) -> None:
        if folder.name == self.kill_folder and torch.distributed.get_rank() == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._finish(folder, write)


class HoldSeal(Checkpoint):
    """With checkpoint.async=true: the writer thread of every rank, about to seal `hold_folder` (DCP's write of the
    shards under way or done, no manifest yet), says so with a file `held-rank-K` in the run folder and waits there
    (`hold_s`), for the test to kill the whole job."""

    def __init__(self, hold_folder: str | None = None, hold_s: float = 120.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hold_folder, self.hold_s = hold_folder, hold_s

    def _finish(self, folder: Path, write: Callable[[], dict[str, Any] | None]) -> None:
        if folder.name == self.hold_folder:
            (self.dir.parent / f"held-rank-{torch.distributed.get_rank()}").touch()
            time.sleep(self.hold_s)
        super()._finish(folder, write)


class FullDiskOnRank(Callback):
    """From optimizer step `step` on, rank `rank`'s disk is full: every fsync of that process fails with ENOSPC (DCP's
    shard writes fsync too). Only in a run started from scratch: its resume, with room again, trains to the end."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank, self.armed = step, rank, False

    def on_fit_start(self, run: Any) -> None:
        self.armed = run.progress.step == 0 and run.strategy.rank == self.rank

    def on_optimizer_step(self, run: Any) -> None:
        if self.armed and run.progress.step == self.step:
            for callback in run.callbacks:  # a save still being written finishes first, on a disk with room
                if isinstance(callback, Checkpoint):
                    callback.wait()

            def full(fd: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            os.fsync = full
