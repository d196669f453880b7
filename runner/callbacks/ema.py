"""An exponential moving average of the weights: validated on, saved with the checkpoints, applied at the end."""

from __future__ import annotations

from typing import Any

import torch

from runner import ConfigError
from runner.callbacks.early_stopping import EarlyStopping
from runner.progress import parse_duration
from runner.run import Callback, Run


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
