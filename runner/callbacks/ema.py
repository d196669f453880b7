"""An exponential moving average of the weights: validated on, saved with the checkpoints, applied at the end."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError
from runner.callbacks import needs_every_module
from runner.callbacks.early_stopping import EarlyStopping
from runner.ckpt.weights import save_weights
from runner.durations import parse_duration
from runner.run import Callback, Run
from runner.rundir import MODEL_PART
from runner.validation import evaluate_loader


class EMA(Callback):
    """Exponential moving averages of the weights, one per `decay`, updated every `every` (a duration, e.g. '1st').

    The first decay is the run's: with `validate_with_ema` the validation passes run on its weights, with
    `apply_at_end` the model ends the run holding them. Every further decay d (`decay=[0.999,0.9999]`) is validated
    on its own after each validation, as `val/ema_<d>/<metric>`, kept in the checkpoints under its decay, and written
    at the end to `model.ema_<d>.safetensors` in `run_dir`. With `callbacks=[ema,early_stopping]`, early stopping sees
    (and with restore_best keeps) the first average's weights it validated, and its restore at the end comes after
    EMA's apply_at_end.
    """

    def __init__(
        self,
        decay: float | Sequence[float] = 0.999,
        every: str = "1st",
        validate_with_ema: bool = True,
        apply_at_end: bool = True,
        run_dir: str | None = None,
    ) -> None:
        self.decays = [float(d) for d in (decay if isinstance(decay, Sequence) else [decay])]
        if not self.decays or not all(0.0 < d < 1.0 for d in self.decays) or len(set(self.decays)) < len(self.decays):
            raise ConfigError(f"callbacks.ema.decay must be a number in (0, 1) or a list of distinct ones, got {decay}")
        self.every = parse_duration(every)
        if self.every.value <= 0:
            raise ConfigError(f"callbacks.ema.every={every} must be longer than zero")
        self.validate_with_ema, self.apply_at_end = validate_with_ema, apply_at_end
        self.run_dir = Path(run_dir) if run_dir else None
        self.names: list[str] = []
        self.shadows: list[list[torch.Tensor]] = []  # one list of averaged tensors per decay
        self._backup: list[torch.Tensor] = []  # the live weights while validation runs on the average
        self.live: list[torch.Tensor] = []

    @property
    def shadow(self) -> list[torch.Tensor]:
        """The first (the run's) average."""
        return self.shadows[0] if self.shadows else []

    def on_fit_start(self, run: Run) -> None:
        """Start the averages at the current weights (unless a checkpoint already restored them)."""
        stopper = next((i for i, cb in enumerate(run.callbacks) if isinstance(cb, EarlyStopping)), None)
        if stopper is not None and run.callbacks[stopper].restore_best and stopper < run.callbacks.index(self):
            raise ConfigError(
                "list ema before early_stopping (callbacks=[ema,early_stopping]): otherwise "
                "restore_best keeps the live weights of a validation that ran on the EMA weights"
            )
        needs_every_module(run, "ema", "it averages every weight, and swaps them in for validation and the end")
        state = run.task.state_dict(keep_vars=True)
        if not self.shadows:
            self.names = [k for k, v in state.items() if v.is_floating_point()]
            self.shadows = [[state[k].detach().clone() for k in self.names] for _ in self.decays]
        self.live = [state[k].detach() for k in self.names]  # parameters and buffers are stable objects

    def on_optimizer_step(self, run: Run) -> None:
        """Move each average towards the current weights in one fused kernel."""
        if run.progress.ticked(self.every):
            with torch.no_grad():
                for decay, shadow in zip(self.decays, self.shadows, strict=True):
                    torch._foreach_lerp_(shadow, self.live, 1.0 - decay)

    def on_validation_start(self, run: Run) -> None:
        """Validate on the first average's weights."""
        if self.validate_with_ema:
            self._swap_in(self.shadow)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Put the live weights back for training, then validate each further average on its own."""
        self._swap_back()
        for decay, shadow in zip(self.decays[1:], self.shadows[1:], strict=True):
            self._swap_in(shadow)
            try:
                scores = evaluate_loader(run.task, run.val_loader, run.precision, run.device, run.strategy.all_sum)
            finally:
                self._swap_back()
            metrics.update({f"val/ema_{decay:g}/{k.removeprefix('val/')}": v for k, v in scores.items()})

    def _swap_in(self, shadow: list[torch.Tensor]) -> None:
        with torch.no_grad():
            self._backup = [t.clone() for t in self.live]
            torch._foreach_copy_(self.live, shadow)

    def _swap_back(self) -> None:
        if self._backup:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self._backup)
            self._backup = []

    def on_fit_end(self, run: Run) -> None:
        """End the run holding the first average's weights; write every further average's."""
        if self.run_dir is not None:
            for decay, shadow in zip(self.decays[1:], self.shadows[1:], strict=True):
                # full tensors on every rank (FSDP shards gather: a collective), written by rank 0
                weights = {k: _full(t) for k, t in zip(self.names, shadow, strict=True)}
                if run.strategy.is_main:
                    save_weights(weights, self.run_dir / MODEL_PART.format(f"ema_{decay:g}"))
        if self.apply_at_end and self.shadows:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self.shadow)

    def state_dict(self) -> dict[str, Any]:
        """The first average by parameter name ("shadow"), and every average by decay ("shadows")."""
        return {
            "shadow": dict(zip(self.names, self.shadow, strict=True)),
            "shadows": {f"{d:g}": dict(zip(self.names, s, strict=True)) for d, s in self._by_decay()},
        }

    def _by_decay(self) -> list[tuple[float, list[torch.Tensor]]]:
        return list(zip(self.decays, self.shadows, strict=True)) if self.shadows else []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict() (a checkpoint from before several decays holds the first average only)."""
        self.names = list(state["shadow"])
        saved = state.get("shadows", {f"{self.decays[0]:g}": state["shadow"]})
        missing = [f"{d:g}" for d in self.decays if f"{d:g}" not in saved]
        if missing:
            raise ConfigError(
                f"callbacks.ema.decay={self.decays}: the checkpoint has no average for {missing} (it holds "
                f"{sorted(saved)}); resume with the decays it was saved with"
            )
        self.shadows = [list(saved[f"{d:g}"].values()) for d in self.decays]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
