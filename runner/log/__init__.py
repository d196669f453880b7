"""Loggers (runner.interfaces.Logger): console, metrics.jsonl (jsonl), wandb (wandb_logger), TensorBoard
(tensorboard_logger), MLflow (mlflow_logger); run facts (info). Here: what the optional ones share."""

from __future__ import annotations

import sys
from typing import Any


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (bools and strings are left out), as floats."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def say_lost(name: str, action: str, error: Exception) -> None:
    """The one line an optional logger prints when it fails: it switches itself off and training goes on."""
    print(
        f"{name}: {action} failed ({type(error).__name__}: {error}); training goes on without {name}",
        file=sys.stderr,
        flush=True,
    )
