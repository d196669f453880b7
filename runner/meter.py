"""The training metrics of a run between two log rows, summed on the device so that steps need no host sync."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from runner.progress import TrainingProgress

# Dense peak FLOP/s per GPU (no 2:4 sparsity), from NVIDIA's data sheets: (bf16 and fp16 tensor cores, TF32 tensor
# cores, plain fp32). Matched in order against torch.cuda.get_device_name(): longer names first ("H100 PCIe" before
# "H100", "L40S" before "L40" before "L4").
PEAK_FLOPS = (
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100 NVL", (835e12, 418e12, 60e12)),
    ("H100", (989e12, 494e12, 67e12)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", (835e12, 418e12, 60e12)),
    ("H200", (989e12, 494e12, 67e12)),
    ("GH200", (989e12, 494e12, 67e12)),
    ("B200", (2250e12, 1100e12, 75e12)),
    ("A100", (312e12, 156e12, 19.5e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L40", (181e12, 90.5e12, 90.5e12)),
    ("L4", (121e12, 60e12, 30e12)),
    ("A10", (125e12, 62.5e12, 31.2e12)),
    ("RTX 4090", (165e12, 82.6e12, 82.6e12)),  # fp32 accumulate (GeForce halves it vs fp16 accumulate)
    ("RTX 3090", (71e12, 35.6e12, 35.6e12)),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's dense peak FLOP/s at `precision` ('bf16', 'fp16', 'fp32') from PEAK_FLOPS; None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in PEAK_FLOPS:
        if key in name:
            if precision in ("bf16", "fp16"):
                return half
            # fp32 matmuls use TF32 tensor cores only when allowed (torch.set_float32_matmul_precision("high"))
            return fp32 if torch.get_float32_matmul_precision() == "highest" else tf32
    return None


class Meter:
    """Training outputs and grad norms summed on the device between two logs, so that steps need no host sync.

    Throughput leaves out each launch's first optimizer step (compiling, allocator and kernel warm-up: first_step_s),
    so that eager and compiled runs are measured alike. `flops_per_token` (the task's) and `peak_flops` (one device's)
    give train/mfu when both are known."""

    def __init__(
        self, progress: TrainingProgress, flops_per_token: float | None = None, peak_flops: float | None = None
    ) -> None:
        self.progress, self.flops_per_token, self.peak_flops = progress, flops_per_token, peak_flops
        self.first_step_s: float | None = None  # wall time of this launch's first optimizer step
        # Skipped (non-finite) steps over the run and the streak of them, as of the last read; longest_streak: the
        # longest streak the last read saw (the loop's max_nonfinite_steps check).
        self.nonfinite_steps = self.nonfinite_in_a_row = self.longest_streak = 0
        # On the device since the last read: [loss sum, grad norm sum, skipped steps, current streak, longest streak]
        self.pending: torch.Tensor | None = None
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.micro, self.steps, self.lr = 0, 0, float("nan")
        if self.pending is not None:
            self.pending[:3] = 0
            self.pending[4] = self.pending[3]  # a streak that goes on counts in the next read's longest
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
            "lr": self.lr,
            "pending": None if self.pending is None else self.pending.tolist(),
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.sums = dict(state["sums"])
        self.micro, self.steps, self.lr = (state[k] for k in ("micro", "steps", "lr"))
        self.nonfinite_steps, self.nonfinite_in_a_row = (
            state.get("nonfinite_steps", 0),
            state.get("nonfinite_in_a_row", 0),
        )
        # a checkpoint of an earlier runner kept the loss and norm sums as numbers
        pending = state.get("pending") or [state.get("loss", 0.0), state.get("norm", 0.0), 0, 0, 0]
        self.pending = None if pending is None else torch.tensor(pending, dtype=torch.float64)

    def add(self, out: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's training_step outputs (tensors or numbers) but the loss (see add_step)."""
        for key, value in out.items():
            if key == "loss":
                continue
            value = value.detach() if isinstance(value, torch.Tensor) else float(value)
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.micro += 1

    def add_step(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor, lr: float) -> None:
        """Add one optimizer step's summed micro-batch losses, global gradient norm and skip flag (0/1), all on the
        device and left there, and the learning rate it used (after the progress counted the step)."""
        device = loss_sum.device
        if self.pending is None:
            streak = float(self.nonfinite_in_a_row)
            self.pending = torch.tensor([0.0, 0.0, 0.0, streak, streak], dtype=torch.float64)
        if self.pending.device != device:  # made on the host, or restored from a checkpoint
            self.pending = self.pending.to(device)
        skipped = skipped.double()
        self.pending[:3] += torch.stack([loss_sum.double(), grad_norm.double(), skipped])
        self.pending[3] = (self.pending[3] + skipped) * skipped
        self.pending[4] = torch.maximum(self.pending[4], self.pending[3])
        self.steps += 1
        self.lr = lr
        if self.first_step_s is None:
            if device.type == "cuda":  # the first step's work must be done to be timed (once per launch)
                torch.cuda.synchronize(device)
            self.first_step_s = time.perf_counter() - self.clock
            self.start()  # throughput from here on

    def read(self, strategy: Any, params: list[torch.Tensor]) -> dict[str, float]:
        """Means since the last read, norms, LR, skipped steps, throughput and memory, with one device sync; then
        start over.

        `strategy` (runner.run.Strategy) sums over ranks; `params` are the trained parameters."""
        p, keys, device = self.progress, list(self.sums), strategy.device
        param_norm = strategy.norm([q.detach() for q in params])  # FSDP: over every rank's shards
        pending = self.pending if self.pending is not None else torch.zeros(5, dtype=torch.float64, device=device)
        local = [torch.as_tensor(self.sums[k], device=device).double().reshape(1) for k in keys]
        local += [pending[:1], torch.tensor([float(self.micro)], device=device, dtype=torch.float64)]
        totals = strategy.all_sum(torch.cat(local))  # sums over every rank: global means
        # the norms and skip counts are global already: the same on every rank
        together = torch.cat([totals, param_norm.double().reshape(1), pending[1:]]).tolist()
        *sums, loss, micro, param_norm, norm, skipped, streak, longest = together
        self.nonfinite_steps += round(skipped)
        self.nonfinite_in_a_row, self.longest_streak = round(streak), round(longest)
        elapsed = time.perf_counter() - self.clock
        metrics = {"train/loss": loss / micro, **{f"train/{k}": v / micro for k, v in zip(keys, sums, strict=True)}}
        metrics.update(
            {
                "train/grad_norm": norm / self.steps,
                "train/param_norm": param_norm,
                "train/lr": self.lr,
                "train/nonfinite_steps": self.nonfinite_steps,
                "sys/peak_memory_mb": _peak_memory_mb(device),
            }
        )
        if p.samples > self.samples:  # not when the window held only the untimed first step
            metrics.update(self._throughput(p.samples - self.samples, p.tokens - self.tokens, elapsed))
        self._reset()
        return metrics

    def _throughput(self, samples: int, tokens: int, elapsed: float) -> dict[str, float]:
        # Samples and tokens are global (all ranks, every micro-batch of each step): per device divides by the world
        # size once, and MFU is the per-device rate against one device's peak.
        metrics = {"train/samples_per_s": samples / elapsed}
        if tokens:
            per_device = tokens / elapsed / self.progress.world_size
            metrics.update({"train/tokens_per_s": tokens / elapsed, "train/tokens_per_s_per_device": per_device})
            if self.flops_per_token and self.peak_flops:
                metrics["train/mfu"] = per_device * self.flops_per_token / self.peak_flops
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
