"""Callbacks: the options of the `callbacks` config group, one module each (the hooks are runner.run.Callback's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner import ConfigError

if TYPE_CHECKING:
    from runner.run import Run


def needs_every_module(run: Run, option: str, why: str) -> None:
    """Refuse callback `option` where this rank holds only some of the task's modules (distributed=spread)."""
    if not run.strategy.every_module_here:
        raise ConfigError(
            f"callbacks.{option} does not run under distributed={run.strategy.strategy}, where each rank holds only "
            f"its own SAEs: {why}. Leave it out (callbacks=[...] without {option}), or use distributed=ddp"
        )
