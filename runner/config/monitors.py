"""Pre-flight checks of what a run monitors (summary's best, a scheduler's plateau, a callback's metric): every
monitor names a validation metric this run will produce, and in time, before the first step."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from runner import ConfigError
from runner.data import first_rows, to_device
from runner.interfaces import Precision
from runner.run import Run
from runner.validation import summarize


def wanted(run: Run) -> set[str]:
    """The metrics something in the run monitors."""
    return {run.settings.monitor, run.schedule.monitor, *(cb.monitor for cb in run.callbacks)} - {None}


def check_monitors(run: Run, no_val_split: str | None = None) -> None:
    """Refuse to start when a scheduler or callback monitors a metric that this run can never produce.

    `no_val_split`: the data module's own word on why it holds no validation split and the setting that gives it one.
    """
    readers = [("the scheduler", run.schedule.monitor, "a scheduler without one, e.g. scheduler=cosine")]
    for cb in run.callbacks:
        kind = type(cb).__name__
        readers.append((kind, cb.monitor, getattr(cb, "monitor_off", None) or f"callbacks=[...] without {kind}"))
    validates = hasattr(run.task, "validation_step")
    why = (no_val_split or "the data has no 'val' split") if validates else "the model has no validation_step"
    for who, name, off in readers:
        if name and not name.startswith("val/"):
            raise ConfigError(f"{who} monitors {name!r}; it must be a validation metric, named 'val/...'")
        if name and (run.val_loader is None or not validates):
            raise ConfigError(f"{who} monitors {name!r}, but this run never validates: {why}. Or do without it: {off}")


@torch.no_grad()
def validation_metrics(
    task: torch.nn.Module, val_loader: Iterable | None, precision: Precision, device: torch.device
) -> set[str]:
    """The names validation will log, from one validation_step on the first validation batch's first two samples
    (the names do not depend on the batch's size, the check's time does), so that a monitor naming none of them fails
    before training, not at the first validation. Call it on the model before DDP/FSDP wrap it (a forward of an FSDP
    module before its first training step leaves its gradients unreduced). The RNG is restored: training starts as
    without it."""
    if val_loader is None:
        return set()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        task.eval()
        batch = to_device(first_rows(next(iter(val_loader)), 2), device)
        with precision.autocast():
            out = task.validation_step(batch)
            names = {f"val/{k}" for k in summarize(task, {k: torch.as_tensor(v) for k, v in out.items()})}
        task.train()
    return names


def check_monitored_metrics(run: Run, validation_metrics: set[str]) -> None:
    """Refuse a monitor (summary's best, a scheduler, a callback) that names no metric validation will produce."""
    if run.val_loader is None:  # never validates: no best to track (check_monitors refuses a monitor that must)
        return
    monitored = wanted(run)
    produced = validation_metrics | {name for cb in run.callbacks for name in cb.provides}
    for name in sorted(monitored - produced):
        raise ConfigError(
            f"the monitored metric {name!r} is not produced by validation (it gives {sorted(produced)}); set "
            f"monitor= (and scheduler.monitor, callbacks.*.monitor) to one of them"
        )
    # on_validation_end runs in reverse order: a callback reading a metric that only a callback adds must come first.
    for i, reader in enumerate(run.callbacks):
        if reader.monitor is None or reader.monitor in validation_metrics:
            continue
        adders = [cb for cb in run.callbacks if reader.monitor in cb.provides]
        if adders and all(run.callbacks.index(cb) < i for cb in adders):
            raise ConfigError(
                f"{type(reader).__name__} monitors {reader.monitor!r}, which {type(adders[0]).__name__} adds after "
                f"it has read it (callbacks end a validation in reverse order): list {type(reader).__name__} "
                f"before {type(adders[0]).__name__} in callbacks=[...]"
            )
