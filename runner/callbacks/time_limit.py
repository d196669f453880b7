"""A wall-clock limit on fit (trainer.max_time): stop in time for the checkpoint to be saved, exit 75, resume later."""

from __future__ import annotations

import time

from runner import ConfigError
from runner.durations import parse_time
from runner.run import Callback, Run, StopReason


class TimeLimit(Callback):
    """Stops the run (stop_reason 'max_time', resumable) once `max_time` of wall-clock time has passed since fit began.

    Set through trainer.max_time, a little under a cluster's time limit: the checkpoint callback saves at the stop.
    """

    def __init__(self, max_time: str | float) -> None:
        self.seconds = parse_time(max_time)
        if self.seconds <= 0:
            raise ConfigError(f"trainer.max_time={max_time} must be longer than zero")
        self.deadline = float("inf")

    def on_fit_start(self, run: Run) -> None:
        """Start the clock."""
        self.deadline = time.monotonic() + self.seconds

    def on_optimizer_step(self, run: Run) -> None:
        """Ask to stop once the time is up."""
        if time.monotonic() >= self.deadline:
            run.request_stop(StopReason.MAX_TIME)
