"""Test-only tasks and callbacks for subprocess runs (helpers.child_env puts this folder on PYTHONPATH): select them
on the command line, e.g. `model._target_=_tasks.Affine` or `+callbacks.slow._target_=_tasks.SleepEachStep`."""

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from experiments.digits import MLPClassifier
from runner.ckpt.callback import Checkpoint
from runner.run import Callback


class SkewedValidation(MLPClassifier):
    """Digits, plus a validation metric 'skew' that rank 0's data alone would see improve at every validation
    (1/k at the k-th) and rank 1's alone would see worsen (k): only their exact reduction decides early stopping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validations, self.trained = 0, False

    def training_step(self, batch):
        self.trained = True
        return super().training_step(batch)

    def validation_step(self, batch):
        out = super().validation_step(batch)
        # one batch per rank and validation (val_batch_size >= the rank's shard); the runner's probe for metric names
        # before training is not a validation
        self.validations += self.trained
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        k = float(max(self.validations, 1))
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


class Affine(nn.Module):
    """Digits by one affine map whose parameters sit on the task itself and are used without forward() (as an SAE's
    are): under FSDP only the registered step methods gather them. (Run as `model._target_=_tasks.Affine`.)"""

    def __init__(self, in_features: int = 64, num_classes: int = 10, **unused: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, num_classes) * 0.1)
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy of x @ weight + bias."""
        x, y = batch
        return {"loss": F.cross_entropy(x @ self.weight + self.bias, y)}

    validation_step = training_step  # the class's function, not the instance's FSDP-wrapped training_step


# ---- slowdowns and faults, chosen on the command line through the callbacks group ----------------------------------
# python -m runner ... +callbacks.slow._target_=_tasks.SleepEachStep +callbacks.slow.seconds=0.05


class SleepEachStep(Callback):
    """Sleeps `seconds` after every optimizer step: the run lives long enough for a test to signal it at a chosen
    moment (once a checkpoint exists, say) with steps to spare."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_optimizer_step(self, run) -> None:
        time.sleep(self.seconds)


class _Stall:
    """Sleeps when pickled: torch.save inside write_checkpoint then stalls with the checkpoint half written."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (float, (0.0,))


class SlowCheckpoint(Checkpoint):
    """The checkpoint callback whose writer thread takes `seconds` over the folder named `slow_folder`, in the middle
    of writing it (its temporary folder made, its files not yet): a save in flight that a test can kill.

        checkpoint._target_=_tasks.SlowCheckpoint +checkpoint.slow_folder=step-00000020
        +checkpoint.seconds=60
    """

    def __init__(self, slow_folder: str | None = None, seconds: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slow_folder, self.seconds = slow_folder, seconds

    def write(self, folder: Path, model: dict, state: dict, info: dict) -> None:
        if folder.name == self.slow_folder:
            state = {**state, "stall": _Stall(self.seconds)}
        super().write(folder, model, state, info)


class Desync(Callback):
    """After optimizer step `step`, rank 1 nudges parameter `parameter` by 1e-6: the ranks silently diverge."""

    def __init__(self, step: int, parameter: str) -> None:
        self.step, self.parameter = step, parameter

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.step and run.strategy.rank == 1:
            with torch.no_grad():
                dict(run.task.named_parameters())[self.parameter].view(-1)[0] += 1e-6
