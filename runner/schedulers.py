"""Learning-rate schedules and when they step: once per optimizer step, or after each validation on a metric."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from runner import ConfigError
from runner.durations import Duration, parse_duration
from runner.progress import TrainingProgress


class PerStep:
    """Steps its scheduler once per optimizer step (never per micro-batch, never per rank)."""

    monitor: str | None = None

    def __init__(self, scheduler: LRScheduler) -> None:
        self.scheduler = scheduler

    def on_optimizer_step(self) -> None:
        """Advance the schedule by one optimizer step."""
        self.scheduler.step()

    def on_validation(self, metrics: dict[str, float]) -> None:
        """Per-step schedules ignore validation."""

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.scheduler.load_state_dict(state)


class OnMetric(PerStep):
    """Steps ReduceLROnPlateau once after each validation with the monitored metric."""

    def __init__(self, scheduler: ReduceLROnPlateau, monitor: str) -> None:
        super().__init__(scheduler)
        self.monitor = monitor

    def on_optimizer_step(self) -> None:
        """Plateau schedules do not move between validations."""

    def on_validation(self, metrics: dict[str, float]) -> None:
        """Step on the monitored metric (the loop has already checked that it is there)."""
        self.scheduler.step(metrics[self.monitor])


def _steps(progress: TrainingProgress, duration: str | Duration, what: str) -> int:
    steps = progress.steps_for(duration)
    if steps is None:
        raise ConfigError(
            f"{what}={duration} cannot be converted to optimizer steps before training (the data has no "
            "length, or the duration is in tokens and data.tokens_per_sample is not set); give it in "
            "'st' instead"
        )
    return steps


def _warmup_steps(progress: TrainingProgress, warmup: str, total: int | None) -> int:
    # A warmup longer than the run never reaches optimizer.lr: surely a mistake (a warmup in epochs of a short run)
    warm = _steps(progress, warmup, "scheduler.warmup")
    if total is not None and warm > total:
        raise ConfigError(
            f"scheduler.warmup={warmup} is {warm} optimizer steps, longer than the whole run (trainer.max_duration="
            f"{progress.max_duration}: {total} steps): the learning rate would never reach optimizer.lr. Shorten it, "
            "e.g. scheduler.warmup=0.05dur (a fraction of the run)"
        )
    return warm


def _ratio(min_lr_ratio: float) -> float:
    if not 0 <= min_lr_ratio <= 1:  # (a NaN fails too)
        raise ConfigError(
            f"scheduler.min_lr_ratio must be in [0, 1] (the final LR as a share of optimizer.lr), got {min_lr_ratio}: "
            "e.g. scheduler.min_lr_ratio=0.1"
        )
    return min_lr_ratio


def _warmup(t: int, warm: int) -> float:
    # The LR factor during a linear warmup of `warm` steps: never 0 (the first step learns), 1 from step `warm` on.
    return min(1.0, (t + 1) / (warm + 1))


def constant(optimizer: torch.optim.Optimizer, progress: TrainingProgress, warmup: str = "0st") -> PerStep:
    """Constant learning rate after an optional linear warmup."""
    warm = _warmup_steps(progress, warmup, progress.total_steps())
    return PerStep(LambdaLR(optimizer, lambda t: _warmup(t, warm)))


def cosine(
    optimizer: torch.optim.Optimizer, progress: TrainingProgress, warmup: str = "0.02dur", min_lr_ratio: float = 0.1
) -> PerStep:
    """Linear warmup, then cosine decay that reaches `min_lr_ratio` x the base LR exactly at max_duration."""
    total = _steps(progress, progress.max_duration, "trainer.max_duration")
    warm, min_lr_ratio = _warmup_steps(progress, warmup, total), _ratio(min_lr_ratio)

    def factor(t: int) -> float:
        if t < warm:
            return _warmup(t, warm)
        done = min(1.0, (t - warm) / max(1, total - warm))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    return PerStep(LambdaLR(optimizer, factor))


def wsd(
    optimizer: torch.optim.Optimizer,
    progress: TrainingProgress,
    warmup: str = "0.01dur",
    decay: str = "0.2dur",
    min_lr_ratio: float = 0.0,
) -> PerStep:
    """Warmup-stable-decay: linear warmup, constant, then linear decay to `min_lr_ratio` over the last `decay`."""
    total = _steps(progress, progress.max_duration, "trainer.max_duration")
    warm, min_lr_ratio = _warmup_steps(progress, warmup, total), _ratio(min_lr_ratio)
    cool = _steps(progress, decay, "scheduler.decay")
    parts = [parse_duration(warmup), parse_duration(decay)]
    if all(part.unit == "dur" for part in parts) and sum(part.value for part in parts) <= 1 + 1e-9:
        cool = min(cool, total - warm)  # fractions that fit the run, each rounded up to whole steps (0.01 + 0.99)
    if warm + cool > total:
        raise ConfigError(
            f"scheduler.warmup={warmup} ({warm} steps) and scheduler.decay={decay} ({cool} steps) together are longer "
            f"than the whole run (trainer.max_duration={progress.max_duration}: {total} steps): shorten them, e.g. "
            "scheduler.warmup=0.01dur scheduler.decay=0.2dur"
        )

    def factor(t: int) -> float:
        if t < warm:
            return _warmup(t, warm)
        if t < total - cool:
            return 1.0
        return 1.0 - (1.0 - min_lr_ratio) * min(1.0, (t - (total - cool)) / max(1, cool))

    return PerStep(LambdaLR(optimizer, factor))


class Ticks(PerStep):
    """Multiplies the learning rate by `gamma` each time `every` ticks on TrainingProgress (not a separate count)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, progress: TrainingProgress, every: Duration, gamma: float
    ) -> None:
        self.progress, self.every, self.drops = progress, every, 0
        super().__init__(LambdaLR(optimizer, lambda _: gamma**self.drops))

    def on_optimizer_step(self) -> None:
        """Drop the LR if the step just counted crossed a multiple of `every`."""
        self.drops += self.progress.ticked(self.every)
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state and the number of drops so far."""
        return {**self.scheduler.state_dict(), "drops": self.drops}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.drops = state.pop("drops", 0)
        self.scheduler.load_state_dict(state)


def step(
    optimizer: torch.optim.Optimizer, progress: TrainingProgress, every: str = "1ep", gamma: float = 0.1
) -> PerStep:
    """Multiply the learning rate by `gamma` every `every` (a duration)."""
    if _steps(progress, every, "scheduler.every") < 1:
        raise ConfigError(f"scheduler.every={every} is shorter than one optimizer step")
    if not 0 < gamma <= 1:
        raise ConfigError(f"scheduler.gamma must be in (0, 1] (the LR is multiplied by it), got {gamma}: e.g. 0.5")
    return Ticks(optimizer, progress, progress.resolve(every), gamma)


def plateau(
    optimizer: torch.optim.Optimizer,
    progress: TrainingProgress,
    monitor: str = "val/loss",
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    cooldown: int = 0,
    min_lr: float = 0.0,
) -> OnMetric:
    """ReduceLROnPlateau stepped once per validation: the LR drops after `patience` + 1 validations without gain."""
    if mode not in ("min", "max"):
        raise ConfigError(f"scheduler.mode must be 'min' or 'max', got {mode!r}")
    if not 0 < factor < 1:
        raise ConfigError(f"scheduler.factor must be in (0, 1) (the LR is multiplied by it), got {factor}: e.g. 0.5")
    for name, value in (("patience", patience), ("threshold", threshold), ("cooldown", cooldown), ("min_lr", min_lr)):
        if not value >= 0:  # (a NaN fails too)
            raise ConfigError(f"scheduler.{name} must be >= 0, got {value}")
    scheduler = ReduceLROnPlateau(
        optimizer, mode=mode, factor=factor, patience=patience, threshold=threshold, cooldown=cooldown, min_lr=min_lr
    )
    return OnMetric(scheduler, monitor)
