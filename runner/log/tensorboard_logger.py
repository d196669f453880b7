"""TensorBoard: event files in the run folder (torch.utils.tensorboard), never the reason training stops."""

from __future__ import annotations

from typing import Any

import numpy as np

from runner import require
from runner.interfaces import Logger
from runner.log import say_lost, scalars


class TensorBoardLogger(Logger):
    """Writes every logged metric as a scalar to event files in `log_dir`, with the resolved config as text.

    `tensorboard --logdir <run folder>` shows a run; `--logdir <sweep folder>` shows its jobs side by side (one run
    each, named by the job's folder). If writing fails, training goes on without TensorBoard and says so once.
    """

    def __init__(self, log_dir: str, flush_secs: float = 30.0) -> None:
        require("tensorboard", "tensorboard", "logger=tensorboard")
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self.writer: Any = None
        self.purge_step: int | None = None

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """TensorBoard drops what the interrupted launch logged after `step` (its purge_step), as metrics.jsonl does."""
        self.purge_step = step + 1

    def start(self, info: dict[str, Any]) -> None:
        """Open the writer; the first launch also records the config."""
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.log_dir, flush_secs=self.flush_secs, purge_step=self.purge_step)
            if self.purge_step is None and info.get("config") is not None:
                from omegaconf import OmegaConf

                # indented: TensorBoard renders text as markdown, and a code block keeps the YAML as it is
                yaml = OmegaConf.to_yaml(OmegaConf.create(info["config"]))
                self.writer.add_text("config", "    " + yaml.replace("\n", "\n    "), 0)
        except Exception as error:
            self._lost("start", error)

    def _lost(self, action: str, error: Exception) -> None:
        say_lost("tensorboard", action, error)
        self.writer = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One scalar per metric at the optimizer step."""
        if self.writer is None:
            return
        try:
            for key, value in scalars(metrics).items():
                self.writer.add_scalar(key, value, step)
        except Exception as error:
            self._lost("log", error)

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        """One histogram per key at the optimizer step (TensorBoard's Histograms and Distributions tabs)."""
        if self.writer is None:
            return
        try:
            for key, numbers in values.items():
                self.writer.add_histogram(key, np.asarray(numbers, dtype=np.float64), step)
        except Exception as error:
            self._lost("log", error)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and close the event file."""
        if self.writer is None:
            return
        try:
            self.writer.close()
        except Exception as error:
            self._lost("close", error)
        self.writer = None
