"""Test-only tasks for subprocess runs (the tests put this folder on PYTHONPATH)."""

import os
import time
from pathlib import Path

import torch

from experiments.digits import MLPClassifier
from runner.run import Callback


class SkewedValidation(MLPClassifier):
    """Digits, plus a validation metric 'skew' that rank 0's data alone would see improve at every validation
    (1/k at the k-th) and rank 1's alone would see worsen (k): only their exact reduction decides early stopping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validations = 0

    def validation_step(self, batch):
        out = super().validation_step(batch)
        self.validations += 1  # one batch per rank and validation (val_batch_size >= the rank's shard)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        k = float(self.validations)
        return {**out, "skew": torch.tensor(k if rank == 1 else 1 / k)}


class Rendezvous(Callback):
    """At fit start, each job says it started (a file in `dir`) and waits until `count` jobs have.

    Jobs run one after another never all get there: the first one fails after `timeout_s`. Jobs that succeed ran at
    the same time, however long each process took to start.
    """

    def __init__(self, dir: str, count: int, timeout_s: float = 120.0) -> None:
        self.dir, self.count, self.timeout_s = Path(dir), count, timeout_s

    def on_fit_start(self, run) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"{os.getpid()}.started").touch()
        deadline = time.monotonic() + self.timeout_s
        while (started := len(list(self.dir.glob("*.started")))) < self.count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {started} of {self.count} jobs started within {self.timeout_s} s")
            time.sleep(0.05)
