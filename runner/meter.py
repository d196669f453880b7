"""The training metrics of a run between two log rows, summed on the device so that steps need no host sync."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from runner.progress import TrainingProgress


class Meter:
    """Training outputs and grad norms summed on the device between two logs, so that steps need no host sync."""

    def __init__(self, progress: TrainingProgress) -> None:
        self.progress = progress
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.micro, self.steps, self.loss, self.norm, self.lr = 0, 0, 0.0, 0.0, float("nan")
        self.start()

    def start(self) -> None:
        """Start the throughput clock (at the start of fit, and after each read)."""
        self.clock, self.samples, self.tokens = time.perf_counter(), self.progress.samples, self.progress.tokens

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last log, so a resumed run's next row averages the same steps."""
        return {
            "sums": {k: float(v) for k, v in self.sums.items()},  # host values: every rank's is gathered
            "micro": self.micro,
            "steps": self.steps,
            "loss": self.loss,
            "norm": self.norm,
            "lr": self.lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.sums = dict(state["sums"])
        self.micro, self.steps, self.loss, self.norm, self.lr = (
            state[k] for k in ("micro", "steps", "loss", "norm", "lr")
        )

    def add(self, out: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's training_step outputs (tensors or numbers) but the loss (see add_step)."""
        for key, value in out.items():
            if key == "loss":
                continue
            value = value.detach() if isinstance(value, torch.Tensor) else float(value)
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.micro += 1

    def add_step(self, loss_sum: float, grad_norm: float, lr: float) -> None:
        """Add one optimizer step's summed micro-batch losses, global gradient norm and the learning rate it used."""
        self.loss += loss_sum
        self.norm += grad_norm
        self.steps += 1
        self.lr = lr

    def read(self, strategy: Any, params: list[torch.Tensor], nonfinite_steps: int) -> dict[str, float]:
        """Means since the last read, norms, LR, throughput and memory, with one device sync; then start over.

        `strategy` (runner.run.Strategy) sums over ranks; `params` are the trained parameters."""
        p, keys, device = self.progress, list(self.sums), strategy.device
        param_norm = strategy.norm([q.detach() for q in params])  # FSDP: over every rank's shards
        local = [torch.as_tensor(self.sums[k], device=device).double().reshape(1) for k in keys]
        local.append(torch.tensor([self.loss, float(self.micro)], device=device, dtype=torch.float64))
        totals = strategy.all_sum(torch.cat(local))  # sums over every rank: global means
        *sums, loss, micro, param_norm = torch.cat([totals, param_norm.double().reshape(1)]).tolist()
        elapsed = time.perf_counter() - self.clock
        metrics = {"train/loss": loss / micro, **{f"train/{k}": v / micro for k, v in zip(keys, sums, strict=True)}}
        metrics.update(
            {
                "train/grad_norm": self.norm / self.steps,
                "train/param_norm": param_norm,
                "train/lr": self.lr,
                "train/nonfinite_steps": nonfinite_steps,
                "train/samples_per_s": (p.samples - self.samples) / elapsed,
                "sys/peak_memory_mb": _peak_memory_mb(device),
            }
        )
        if p.tokens:
            metrics["train/tokens_per_s"] = (p.tokens - self.tokens) / elapsed
        self._reset()
        return metrics


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class WallClock:
    """Wall time of training over every launch of a run: the earlier launches' (restored from the checkpoint) plus
    this launch's since start()."""

    def __init__(self) -> None:
        self.earlier_s, self.started = 0.0, time.perf_counter()

    def start(self) -> None:
        """This launch starts training now."""
        self.started = time.perf_counter()

    def launch_s(self) -> float:
        """Seconds since this launch's start()."""
        return time.perf_counter() - self.started

    def total_s(self) -> float:
        """Seconds over every launch."""
        return self.earlier_s + self.launch_s()

    def state_dict(self) -> dict[str, float]:
        """The total so far: a resumed launch adds its own to it."""
        return {"total_s": self.total_s()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore state_dict()."""
        self.earlier_s = float(state["total_s"])
