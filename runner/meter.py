"""The training metrics of a run between two log rows, summed on the device so that steps need no host sync."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from runner.progress import TrainingProgress
from runner.timeline import TIMELINE

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
    """One device's dense peak FLOP/s at `precision` (a precision option's name) from PEAK_FLOPS; None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in PEAK_FLOPS:
        if key in name:
            if precision in ("bf16", "fp16", "bf16_true", "fp16_true"):
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
        # This launch's timed log windows: the first (warm-up: allocator, caches, compile of what the first step did
        # not reach) and the steady state, every later one; [samples, tokens, seconds] each
        self.warmup: list[float] | None = None
        self.steady = [0, 0, 0.0]
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        # Each optimizer step's (summed loss, grad norm, skip flag), left on the device as they are: appending costs
        # no device op, and the log step reads them all at once.
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.micro, self.lr = 0, float("nan")
        self.start()

    def start(self) -> None:
        """Start the throughput clock (at the start of fit, and after each read)."""
        self.clock, self.samples, self.tokens = time.perf_counter(), self.progress.samples, self.progress.tokens

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last log, so a resumed run's next row averages the same steps."""
        return {
            "sums": {k: float(v) for k, v in self.sums.items()},  # host values: every rank's is gathered
            "records": self._stacked(torch.device("cpu")).tolist(),
            "micro": self.micro,
            "lr": self.lr,
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.sums = dict(state["sums"])
        # float32 values, exactly as the device held them
        self.records = [tuple(torch.tensor(v, dtype=torch.float32) for v in r) for r in state["records"]]
        self.micro, self.lr = state["micro"], state["lr"]
        self.nonfinite_steps, self.nonfinite_in_a_row = state["nonfinite_steps"], state["nonfinite_in_a_row"]

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
        self.records.append((loss_sum, grad_norm, skipped))
        self.lr = lr
        if self.first_step_s is None:
            if loss_sum.is_cuda:  # the first step's work must be done to be timed (once per launch)
                torch.cuda.synchronize(loss_sum.device)
            self.first_step_s = time.perf_counter() - self.clock
            TIMELINE.lap("first step")  # inside the training phase: its first step is start-up, not training
            self.start()  # throughput from here on

    def _stacked(self, device: torch.device) -> torch.Tensor:
        # the records as one float32 [steps, 3] tensor on `device` (restored ones are on the host)
        if not self.records:
            return torch.zeros(0, 3, device=device)
        return torch.stack([t.to(device, torch.float32) for r in self.records for t in r]).view(-1, 3)

    def read(self, strategy: Any, params: list[torch.Tensor]) -> dict[str, float]:
        """Means since the last read, norms, LR, skipped steps, throughput and memory, with one device sync; then
        start over.

        `strategy` (runner.interfaces.Strategy) sums over ranks; `params` are the trained parameters."""
        p, keys, device = self.progress, list(self.sums), strategy.device
        param_norm = strategy.norm([q.detach() for q in params])  # FSDP: over every rank's shards
        records = self._stacked(device).double()
        local = [torch.as_tensor(self.sums[k], device=device).double().reshape(1) for k in keys]
        local += [records[:, 0].sum().reshape(1), torch.tensor([float(self.micro)], device=device, dtype=torch.float64)]
        totals = strategy.all_sum(torch.cat(local))  # sums over every rank: global means
        # the norms and skip flags are global already: the same on every rank
        values = torch.cat([totals, param_norm.double().reshape(1), records[:, 1:].flatten()]).tolist()
        *sums, loss, micro, param_norm = values[: len(keys) + 3]
        norms, skipped = values[len(keys) + 3 :: 2], values[len(keys) + 4 :: 2]
        self.longest_streak = self.nonfinite_in_a_row
        for flag in skipped:
            self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if flag else 0
            self.longest_streak = max(self.longest_streak, self.nonfinite_in_a_row)
        self.nonfinite_steps += round(sum(skipped))
        elapsed = time.perf_counter() - self.clock
        metrics = {"train/loss": loss / micro, **{f"train/{k}": v / micro for k, v in zip(keys, sums, strict=True)}}
        metrics.update(
            {
                "train/grad_norm": sum(norms) / len(norms),
                "train/param_norm": param_norm,
                "train/lr": self.lr,
                "train/nonfinite_steps": self.nonfinite_steps,
                "sys/peak_memory_mb": _peak_memory_mb(device),
            }
        )
        if p.samples > self.samples:  # not when the window held only the untimed first step
            window = [p.samples - self.samples, p.tokens - self.tokens, elapsed]
            metrics.update(self._throughput(*window))
            if self.warmup is None:
                self.warmup = window
            else:
                self.steady = [a + b for a, b in zip(self.steady, window, strict=True)]
        self._reset()
        return metrics

    def steady_throughput(self) -> dict[str, float]:
        """samples/s, tokens/s and MFU of this launch's steady state: its log windows after the first, which holds
        the warm-up (the first optimizer step, validation and checkpoint writes are out of every window); the first
        window's when there is no other. Empty before any timed window."""
        window = self.steady if self.steady[2] > 0 else self.warmup
        if window is None:
            return {}
        return {key.removeprefix("train/"): value for key, value in self._throughput(*window).items()}

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
