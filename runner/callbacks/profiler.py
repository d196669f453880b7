"""The profiler callback: torch.profiler over a window of optimizer steps, so a user sees where the time goes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runner import ConfigError
from runner.durations import parse_duration
from runner.run import Callback

if TYPE_CHECKING:
    from runner.run import Run


class Profiler(Callback):
    """torch.profiler over a window of optimizer steps: a Chrome/Perfetto trace in `dir` and a top-ops table.

    The window opens once `start` (a duration) has elapsed and, after one step of profiler warm-up, records `length`
    (a duration, converted to steps). The
    table of the `row_limit` most expensive ops (by self time on the device that trains) is printed at the end of fit
    and written to `dir`/top_ops.txt; the trace goes to `dir`/trace.json (one per rank when several train).
    """

    def __init__(
        self,
        dir: str,
        start: str = "10st",
        length: str = "5st",
        row_limit: int = 10,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.dir, self.start, self.length = Path(dir), parse_duration(start), parse_duration(length)
        self.row_limit = row_limit
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self.profile: torch.profiler.profile | None = None
        self.steps, self.window, self.done = 0, 0, False

    def on_fit_start(self, run: Run) -> None:
        """Resolve the window in steps; open it now if it starts at once."""
        self.window = run.progress.steps_for(self.length) or 0
        if self.window < 1:
            raise ConfigError(f"callbacks.profiler.length={self.length} must be at least one optimizer step")
        self._maybe_open(run)

    def _maybe_open(self, run: Run) -> None:
        if self.profile is None and not self.done and run.progress.elapsed(self.start):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if run.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # One step of profiler warm-up (its own start-up cost stays out of the figures), then the window; the
            # schedule also marks each step in the trace (ProfilerStep#N).
            schedule = torch.profiler.schedule(wait=0, warmup=1, active=self.window, repeat=1)
            self.profile = torch.profiler.profile(activities=activities, schedule=schedule, **self.options)
            self.profile.start()
            self.first_step = run.progress.step + 2

    def on_optimizer_step(self, run: Run) -> None:
        """Advance the profiler's schedule; close the window after warm-up and `length` steps, or open it."""
        if self.profile is None:
            self._maybe_open(run)
            return
        self.profile.step()
        self.steps += 1
        if self.steps > self.window:
            self._close(run)

    def on_fit_end(self, run: Run) -> None:
        """Close a window that the end of training cut short."""
        if self.profile is not None:
            self._close(run)

    def _close(self, run: Run) -> None:
        self.profile.stop()
        self.done = True
        recorded = self.steps - 1  # the first step after opening was the profiler's warm-up
        if recorded < 1:
            print(
                "profiler: training ended before a step could be recorded; lower callbacks.profiler.start",
                file=sys.stderr,
            )
            self.profile = None
            return
        rank, world = run.strategy.rank, run.world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / ("trace.json" if world == 1 else f"trace_rank{rank}.json")
        self.profile.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
        table = self.profile.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        steps = f"steps {self.first_step}-{self.first_step + recorded - 1}"
        if rank == 0:
            (self.dir / "top_ops.txt").write_text(f"{steps}\n{table}\n", encoding="utf-8")
            print(f"profiler: {steps}, trace in {trace}\n{table}", file=sys.stderr)
        self.profile = None
