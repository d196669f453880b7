"""A runner callback for the benchmarks: stamps the optimizer steps and reports the final loss (see common.Stamps)."""

from __future__ import annotations

from benchmarks.common import Stamps, final_loss
from runner.callbacks import Callback
from runner.loop import Run


class StepTimer(Callback):
    """Writes the first-step time, the steady-state time per step and the final loss to `out` at the end of fit."""

    def __init__(self, size: str, warmup: int, out: str) -> None:
        self.size, self.out, self.stamps = size, out, Stamps(warmup)

    def on_optimizer_step(self, run: Run) -> None:
        """Stamp the step."""
        self.stamps.step(run.progress.step, run.progress.finished)

    def on_fit_end(self, run: Run) -> None:
        """Write the figures."""
        self.stamps.write(self.out, final_loss=final_loss(run.task, self.size))
