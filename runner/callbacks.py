"""Callbacks: small objects with named hooks the loop calls. Early stopping, EMA of the weights, the profiler."""

from __future__ import annotations

import math
import sys
from pathlib import Path
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
        rank, world = run.distributed.rank, run.world_size
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
