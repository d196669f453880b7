"""A checkpoint callback for tests/e2e/test_dcp_ranks.py: one rank is SIGKILLed in the middle of a distributed save
(its shards written, its own files and the manifest not yet), as the OOM killer or a lost node would.

    checkpoint._target_=_dcp_ranks.KillMidSave +checkpoint.kill_folder=step-00000020 +checkpoint.kill_rank=1
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.ckpt.callback import Checkpoint


class KillMidSave(Checkpoint):
    """Kills rank `kill_rank` after DCP wrote the shards of `kill_folder`, before that rank seals it."""

    def __init__(self, kill_folder: str | None = None, kill_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_folder, self.kill_rank = kill_folder, kill_rank

    def _finish(self, folder: Path, write: Callable[[], dict[str, Any] | None]) -> None:
        if folder.name == self.kill_folder and torch.distributed.get_rank() == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._finish(folder, write)
