"""Callbacks: small objects with named hooks the loop calls. Early stopping, EMA of the weights, a time limit."""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING, Any

import torch

from runner import ConfigError
from runner.progress import parse_duration

if TYPE_CHECKING:
    from runner.loop import Run


class Callback:
    """Base class: every hook is a no-op.

    Hooks run in the order the callbacks appear in the config, except on_validation_end, which runs in reverse so that
    it unwinds on_validation_start (a callback that swaps weights in for validation swaps them back last).
    """

    monitor: str | None = None  # a callback that reads a validation metric names it here, so the loop can check it

    def on_fit_start(self, run: Run) -> None:
        """Before the first micro-batch (after a checkpoint, if any, was restored)."""

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


class Best:
    """Tracks the best value of a metric under `mode` ('min' or 'max') with an improvement margin."""

    def __init__(self, mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        self.mode, self.min_delta = mode, abs(min_delta)
        self.value: float | None = None
        self.step: int | None = None

    def update(self, value: float, step: int) -> bool:
        """Record `value`; return True if it beats the best so far by more than min_delta (NaN never does)."""
        if math.isnan(value):
            return False
        if self.value is not None:
            gain = self.value - value if self.mode == "min" else value - self.value
            if gain <= self.min_delta:
                return False
        self.value, self.step = value, step
        return True

    def state_dict(self) -> dict[str, Any]:
        """Best value and step."""
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.value, self.step = state["value"], state["step"]


class EarlyStopping(Callback):
    """Stop after `patience` validations in a row without improvement of `monitor`; can restore the best weights."""

    def __init__(
        self,
        monitor: str = "val/loss",
        mode: str = "min",
        patience: int = 5,
        min_delta: float = 0.0,
        restore_best: bool = False,
    ) -> None:
        if patience < 1:
            raise ConfigError(f"callbacks.early_stopping.patience must be >= 1, got {patience}")
        self.monitor, self.patience, self.restore_best = monitor, patience, restore_best
        self.best = Best(mode, min_delta)
        self.wait = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Count a validation without improvement, or reset and remember the weights."""
        if self.best.update(metrics[self.monitor], run.progress.step):
            self.wait = 0
            if self.restore_best:
                self.best_weights = {k: v.detach().clone() for k, v in run.task.state_dict().items()}
        else:
            self.wait += 1
            if self.wait >= self.patience:
                run.request_stop("early_stopping")

    def on_fit_end(self, run: Run) -> None:
        """Put the best weights back."""
        if self.restore_best and self.best_weights is not None:
            run.task.load_state_dict(self.best_weights)

    def state_dict(self) -> dict[str, Any]:
        """Counters, best value and (with restore_best) the best weights."""
        state = {"wait": self.wait, "best": self.best.state_dict()}
        if self.best_weights is not None:
            state["best_weights"] = self.best_weights
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.wait = state["wait"]
        self.best.load_state_dict(state["best"])
        self.best_weights = state.get("best_weights")


def parse_time(text: str | float) -> float:
    """Seconds in a wall-clock duration: '23h50m', '90m', '1d', '45s', '1h30m15s', or a number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(
        r"\s*(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*"
        r"(?:(\d+(?:\.\d+)?)s)?\s*",
        str(text),
    )
    if not match or not any(match.groups()):
        raise ConfigError(f"cannot read the time {text!r}: write e.g. '23h50m', '90m', '1d', '45s'")
    days, hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


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
            run.request_stop("max_time")


class EMA(Callback):
    """Exponential moving average of the weights, updated every `every` (a duration, e.g. '1st').

    With `validate_with_ema` the validation passes run on the averaged weights; with `apply_at_end` the model ends
    the run holding them. With `callbacks=[ema,early_stopping]`, early stopping sees (and with restore_best keeps)
    the averaged weights it validated, and its restore at the end comes after EMA's apply_at_end.
    """

    def __init__(
        self, decay: float = 0.999, every: str = "1st", validate_with_ema: bool = True, apply_at_end: bool = True
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"callbacks.ema.decay must be in (0, 1), got {decay}")
        self.decay, self.every = decay, parse_duration(every)
        if self.every.value <= 0:
            raise ConfigError(f"callbacks.ema.every={every} must be longer than zero")
        self.validate_with_ema, self.apply_at_end = validate_with_ema, apply_at_end
        self.names: list[str] = []
        self.shadow: list[torch.Tensor] = []
        self._backup: list[torch.Tensor] = []  # the live weights while validation runs on the average
        self.live: list[torch.Tensor] = []

    def on_fit_start(self, run: Run) -> None:
        """Start the average at the current weights (unless a checkpoint already restored it)."""
        stopper = next((i for i, cb in enumerate(run.callbacks) if isinstance(cb, EarlyStopping)), None)
        if stopper is not None and run.callbacks[stopper].restore_best and stopper < run.callbacks.index(self):
            raise ConfigError(
                "list ema before early_stopping (callbacks=[ema,early_stopping]): otherwise "
                "restore_best keeps the live weights of a validation that ran on the EMA weights"
            )
        state = run.task.state_dict(keep_vars=True)
        if not self.shadow:
            self.names = [k for k, v in state.items() if v.is_floating_point()]
            self.shadow = [state[k].detach().clone() for k in self.names]
        self.live = [state[k].detach() for k in self.names]  # parameters and buffers are stable objects

    def on_optimizer_step(self, run: Run) -> None:
        """Move the average towards the current weights in one fused kernel."""
        if run.progress.ticked(self.every):
            with torch.no_grad():
                torch._foreach_lerp_(self.shadow, self.live, 1.0 - self.decay)

    def on_validation_start(self, run: Run) -> None:
        """Validate on the averaged weights."""
        if self.validate_with_ema:
            with torch.no_grad():
                self._backup = [t.clone() for t in self.live]
                torch._foreach_copy_(self.live, self.shadow)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Put the live weights back for training."""
        if self._backup:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self._backup)
            self._backup = []

    def on_fit_end(self, run: Run) -> None:
        """End the run holding the averaged weights."""
        if self.apply_at_end and self.shadow:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self.shadow)

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights by parameter name."""
        return {"shadow": dict(zip(self.names, self.shadow, strict=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.names = list(state["shadow"])
        self.shadow = list(state["shadow"].values())
