"""The run: its settings, its components and its state, the callbacks' hooks, and why a run stops.

A leaf module: the loop, callbacks, checkpoints and loggers take a `Run`; nothing here knows any of them. The
components' interfaces (Precision, Strategy, Schedule, Logger) are runner.interfaces'.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from runner import ConfigError
from runner.durations import Duration
from runner.interfaces import Logger, Precision, Schedule, Strategy
from runner.meter import Meter, WallClock
from runner.progress import TrainingProgress


class StopReason(str, enum.Enum):
    """Why a run stopped: the one table of what each reason means. The value is what files (summary.json,
    manifests, results.csv) record."""

    MAX_DURATION = "max_duration"
    EARLY_STOPPING = "early_stopping"
    NONFINITE = "nonfinite"
    PREEMPTED = "preempted"  # SIGTERM or SIGUSR1 (a cluster about to take the node back)
    MAX_TIME = "max_time"
    INTERRUPTED = "interrupted"  # Ctrl-C
    STOPPED_ON_ANOTHER_RANK = "stopped_on_another_rank"
    FAILED = "failed"  # an exception: written by the CLI for a sweep's results, never set by the loop

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def resumable(self) -> bool:
        """The run goes on when resumed. No extra validation or log row at such a stop, so that the resumed run's
        validations, schedules and metrics.jsonl rows are exactly those of a run that was never stopped."""
        return self in (StopReason.PREEMPTED, StopReason.MAX_TIME, StopReason.INTERRUPTED)

    @property
    def agreed(self) -> bool:
        """Decided on values every rank shares (validation metrics, the reduced non-finite counts): it stops every
        rank after the current step with no agreement. Any other stop is asked by one rank and waits for the loop's
        next stop check (trainer.stop_check_interval)."""
        return self in (StopReason.EARLY_STOPPING, StopReason.NONFINITE)

    @property
    def finished(self) -> bool:
        """Nothing is left to train: a resume only completes the run's final files."""
        return self in (StopReason.MAX_DURATION, StopReason.EARLY_STOPPING)

    @property
    def exit_code(self) -> int:
        """The CLI's exit code: 3 diverged, 75 stopped to be resumed (EX_TEMPFAIL), 130 Ctrl-C, 1 failed."""
        codes = {"nonfinite": 3, "preempted": 75, "max_time": 75, "interrupted": 130, "failed": 1}
        return codes.get(self.value, 0)

    @property
    def status(self) -> str:
        """A sweep's results.csv status for a job that stopped so."""
        if self.finished:
            return "completed"
        return {"nonfinite": "diverged", "failed": "failed"}.get(self.value, "stopped")

    @classmethod
    def status_of(cls, reason: str | None) -> str | None:
        """The status of a reason read from a file (an unknown string is its own status)."""
        try:
            return cls(reason).status
        except ValueError:
            return reason


class Best:
    """Tracks the best value of a metric under `mode` ('min' or 'max') with an improvement margin."""

    def __init__(self, mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        self.mode, self.min_delta = mode, abs(min_delta)
        self.value: float | None = None
        self.step: int | None = None

    def key(self, value: float) -> float:
        """A sort key under this mode: smaller is better."""
        return value if self.mode == "min" else -value

    @property
    def worst(self) -> float:
        """The worst possible value under this mode (what a diverged run scores)."""
        return self.key(math.inf)

    def better(self, value: float, than: float | None, margin: float = 0.0) -> bool:
        """Whether `value` beats `than` (None: nothing yet) by more than `margin` under this mode; NaN never does."""
        if math.isnan(value):
            return False
        return than is None or self.key(than) - self.key(value) > margin

    def update(self, value: float, step: int) -> bool:
        """Record `value`; return True if it beats the best so far by more than min_delta."""
        if not self.better(value, self.value, self.min_delta):
            return False
        self.value, self.step = value, step
        return True

    def state_dict(self) -> dict[str, Any]:
        """Best value and step."""
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.value, self.step = state["value"], state["step"]


# ---- the hooks the loop calls ----------------------------------------------------------------------------------------
@runtime_checkable
class Callback(Protocol):
    """Named hooks the loop calls; every hook is a no-op until a callback overrides it (subclass this).

    Hooks run in the order the callbacks appear in the config, except on_validation_end, which runs in reverse so that
    it unwinds on_validation_start (a callback that swaps weights in for validation swaps them back last).
    """

    monitor: str | None = None  # a callback that reads a validation metric names it here, so the loop can check it
    monitor_off: str | None = None  # the override that stops it reading `monitor`, for a run that never validates
    provides: tuple[str, ...] = ()  # validation metrics a callback adds (on_validation_end): a monitor may name them

    def on_fit_start(self, run: Run) -> None:
        """Before the first micro-batch (after a checkpoint, if any, was restored)."""

    def on_before_optimizer_step(self, run: Run) -> None:
        """Before the optimizer steps: the gradients are final (reduced, unscaled, clipped)."""

    def on_optimizer_step(self, run: Run) -> None:
        """After each optimizer step (skipped non-finite steps included) and the progress count."""

    def on_validation_start(self, run: Run) -> None:
        """Before a validation pass."""

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """After a validation pass with its metrics (keys like 'val/loss')."""

    def on_step_end(self, run: Run) -> None:
        """At the very end of an optimizer step, after its validation and log: the state is complete (checkpoints)."""

    def on_fit_end(self, run: Run) -> None:
        """After the last step, whatever stopped the run."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""


# ---- the run ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What the config fixed for the loop; nothing changes it while the run trains."""

    val_interval: Duration
    log_interval: Duration
    gradient_clip_val: float | None = None
    max_nonfinite_steps: int = 10
    # several ranks agree on a stop asked by one of them (a signal, max_time) at these ticks, not at every step
    stop_check_interval: Duration = Duration(10, "st")
    monitor: str | None = "val/loss"  # the metric that `best` tracks (summary.json, a sweeper's objective)
    config_hash: str | None = None  # sha256 of the job config, recorded in checkpoint manifests
    config: dict[str, Any] | None = None  # the job config (unresolved), in manifests: a resume compares it
    data_info: dict[str, Any] = field(default_factory=dict)  # the data module's facts, for run.json
    compiled: str | None = None  # what torch.compile compiles ("3 x Block (inductor, mode default)"); None: eager
    recomputed: str | None = None  # the units whose activations are recomputed in backward; None: none
    short_run_tolerance: float | None = None  # runner.short_run: the gain over the run's end that says "short"
    val_during_training: float | int | None = None  # the validation split's share read before the last validation


ADDED_STATE = ("monitored",)  # State's fields an older checkpoint may lack; any other missing one is a corrupt file


@dataclass
class State:
    """Everything that changes while the run trains. A checkpoint holds every field (state_dict walks them), so a
    field added here is saved and resumed by construction."""

    progress: TrainingProgress
    best: Best = field(default_factory=Best)
    meter: Meter = None  # type: ignore[assignment]  # training sums since the last log row (default: a new one)
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged value of every metric
    clock: WallClock = field(default_factory=WallClock)  # wall time over every launch
    monitored: list = field(default_factory=list)  # [step, value] of `monitor` at each validation (runner.short_run)

    def __post_init__(self) -> None:
        self.meter = self.meter or Meter(self.progress)

    @property
    def nonfinite_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient norm, as of the last log row (the meter counts
        them on the device)."""
        return self.meter.nonfinite_steps

    @property
    def nonfinite_in_a_row(self) -> int:
        """The current streak of skipped steps, as of the last log row; max_nonfinite_steps of them stop the run."""
        return self.meter.nonfinite_in_a_row

    def state_dict(self) -> dict[str, Any]:
        """Every field: a component's own state_dict, or the value."""
        return {f.name: _state_of(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        for f in fields(self):
            if f.name not in state and f.name in ADDED_STATE:  # a checkpoint from before the field: a new run's
                continue
            value = getattr(self, f.name)
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(state[f.name])
            else:
                setattr(self, f.name, type(value)(state[f.name]))


def _state_of(value: Any) -> Any:
    # A copy of a dict or list: a checkpoint is written in a thread while the run goes on changing them.
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return type(value)(value) if isinstance(value, (dict, list)) else value


@dataclass
class Run:
    """Everything fit() needs, built from the config by runner.build; callbacks receive it too.

    Components are the objects the config named; `settings` are fixed; `state` is what a checkpoint resumes;
    `stop_reason` is why this launch stopped (not resumed: a resumed run goes on).
    """

    task: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    precision: Precision
    strategy: Strategy
    train_loader: Any
    val_loader: Any
    settings: Settings
    state: State
    forward: Any = None  # the training forward: task.training_step, or DDP around it (strategy.wrap)
    callbacks: list[Callback] = field(default_factory=list)
    loggers: list[Logger] = field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_asked: StopReason | None = None  # asked on this rank, not yet agreed with the others (see request_stop)
    data: Any = None  # the data module the loaders came from: a callback may use what it built (a source model)
    # the weights the last validation evaluated (each tensor's storage and version): fit() does not evaluate them again
    evaluated: tuple | None = None

    def __post_init__(self) -> None:
        self.forward = self.forward or self.task.training_step

    @property
    def progress(self) -> TrainingProgress:
        """The run's one clock."""
        return self.state.progress

    @property
    def device(self) -> torch.device:
        """The device this rank trains on."""
        return self.strategy.device

    @property
    def world_size(self) -> int:
        """Processes training together."""
        return self.strategy.world_size

    def working(self, what: str, done: int, total: int | None) -> None:
        """Tell the loggers how far a long pass that logs only at its end has got (Logger.working)."""
        for logger in self.loggers:
            getattr(logger, "working", lambda *_: None)(what, done, total)  # a logger of the user's may lack it

    def request_stop(self, reason: StopReason | str) -> None:
        """Ask the loop to stop; the first reason given wins. An agreed reason (StopReason.agreed) stops after the
        current step; another (a signal, max_time) at the next stop check, where every rank stops at the same step."""
        reason = StopReason(reason)
        if reason.agreed:
            self.stop_reason = self.stop_reason or reason
        else:
            self.stop_asked = self.stop_asked or reason
