"""Early stopping on a validation metric, optionally ending the run with the best weights."""

from __future__ import annotations

from typing import Any

import torch

from runner import ConfigError
from runner.run import Best, Callback, Run, StopReason


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
                run.request_stop(StopReason.EARLY_STOPPING)

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
