"""A runner callback for the benchmarks: stamps the optimizer steps and reports the final loss (see common.Stamps)."""

from __future__ import annotations

import resource
from pathlib import Path

from benchmarks.common import Stamps, final_loss
from runner.run import Callback, Run


def rank_path(out: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its figures: `out` itself for rank 0, `<stem>.rank<r><suffix>` beside it otherwise."""
    out = Path(out)
    return out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


class StepTimer(Callback):
    """Writes the first-step time, the steady-state time per step and the final loss to `out` at the end of fit.

    Under DDP every rank times its own steps: rank 0 writes `out` (the figures that count; the parent waits for it)
    and rank r > 0 writes rank_path(out, r), so that no two processes write one file.
    """

    def __init__(self, warmup: int, out: str, size: str | None = None, count_ops: bool = True) -> None:
        self.size, self.warmup, self.out, self.count_ops = size, warmup, out, count_ops

    def on_fit_start(self, run: Run) -> None:
        """Place the clock readings: they need the run's length and device."""
        self.stamps = Stamps(self.warmup, run.progress.total_steps(), run.device, count_ops=self.count_ops)

    def on_optimizer_step(self, run: Run) -> None:
        """Stamp the step."""
        self.stamps.step(run.progress.step)

    def on_fit_end(self, run: Run) -> None:
        """Write the figures (this rank's own peak RSS too: under torchrun wait4 sees only the largest process)."""
        rank = getattr(run.strategy, "rank", 0)
        self.stamps.write(
            rank_path(self.out, rank),
            final_loss=final_loss(run.task, self.size) if self.size else None,  # None: not benchmarks.common.Net
            rank=rank,
            world_size=run.world_size,
            rank_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
