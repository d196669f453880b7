"""Helpers shared by the unit and e2e tests (test files never import each other: what two of them need lives here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runner.run import Callback, Run

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TIMING = {"train/samples_per_s", "sys/peak_memory_mb"}  # wall-clock figures: the only ones a resume may change


class StopAt(Callback):
    """Asks the loop to stop at `step` as a preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step == self.step:
            run.request_stop("preempted")


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl without the wall-clock figures."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights a run wrote (model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))
