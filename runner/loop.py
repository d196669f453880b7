"""fit(): the loop. Micro-batches, accumulation, precision, clipping, optimizer and scheduler steps, validation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner import ConfigError
from runner.callbacks import Best, Callback
from runner.data import batch_size_of, to_device, tokens_of, with_last
from runner.distributed import Single
from runner.loggers import Logger
from runner.meter import Meter
from runner.precision import FP32
from runner.progress import Duration, TrainingProgress
from runner.schedulers import PerStep


@dataclass
class Run:
    """Everything fit() needs, built from the config by runner.build; callbacks receive it too."""

    task: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: PerStep
    progress: TrainingProgress
    precision: FP32
    train_loader: Any
    val_loader: Any
    device: torch.device
    val_interval: Duration
    log_interval: Duration
    gradient_clip_val: float | None = None
    max_nonfinite_steps: int = 10
    distributed: Any = None  # runner.distributed.Single (or, later, DDP/FSDP): rank, world size, device
    callbacks: list[Callback] = field(default_factory=list)
    loggers: list[Logger] = field(default_factory=list)
    monitor: str | None = "val/loss"
    best: Best = field(default_factory=Best)
    stop_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged value of every metric
    nonfinite_steps: int = 0
    config_hash: str | None = None  # sha256 of the job config, recorded in checkpoint manifests
    forward: Any = None  # the training forward: task.training_step, or DDP around it (distributed.wrap)

    def __post_init__(self) -> None:
        self.meter = Meter(self.progress)  # training sums between two logs; part of a checkpoint
        self.distributed = self.distributed or Single()
        self.forward = self.forward or self.task.training_step

    @property
    def world_size(self) -> int:
        """Processes training together."""
        return self.distributed.world_size

    def request_stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step; the first reason given wins."""
        self.stop_reason = self.stop_reason or reason


# Stops after which the run goes on when resumed: no extra validation or log row at the stop, so that the resumed
# run's validations, schedules and metrics.jsonl rows are exactly those of a run that was never stopped.
RESUMABLE = ("preempted", "max_time")


def check_monitors(run: Run) -> None:
    """Refuse to start when a scheduler or callback monitors a metric that this run can never produce."""
    readers = [("the scheduler", run.schedule.monitor)]
    readers += [(type(cb).__name__, cb.monitor) for cb in run.callbacks]
    validates = run.val_loader is not None and hasattr(run.task, "validation_step")
    for who, name in readers:
        if name and not name.startswith("val/"):
            raise ConfigError(f"{who} monitors {name!r}; it must be a validation metric, named 'val/...'")
        if name and not validates:
            raise ConfigError(
                f"{who} monitors {name!r}, but this run never validates (no 'val' split or no "
                "validation_step on the model). Add one, or pick a scheduler/callback without a monitor."
            )


def _log(run: Run, metrics: dict[str, float]) -> None:
    p = run.progress
    metrics = {"epoch": p.epoch_float, "samples": p.samples, **({"tokens": p.tokens} if p.tokens else {}), **metrics}
    run.metrics.update(metrics)
    for logger in run.loggers:
        logger.log(metrics, p.step)


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """One pass over the validation loader; metrics are means weighted by batch size, named 'val/<key>'."""
    run.task.eval()
    sums: dict[str, torch.Tensor] = {}
    count = 0
    for batch in run.val_loader:
        batch = to_device(batch, run.device)
        size = batch_size_of(batch)
        with run.precision.autocast():
            out = run.task.validation_step(batch)
        for key, value in out.items():
            sums[key] = sums.get(key, 0.0) + torch.as_tensor(value, device=run.device).detach().double() * size
        count += size
    run.task.train()
    if not sums:
        return {}
    # Sums and counts over every rank's shard, not a mean of means; one device sync.
    totals = run.distributed.all_sum(torch.stack([*sums.values(), torch.tensor(count, device=run.device).double()]))
    values = (totals[:-1] / totals[-1]).tolist()
    return {f"val/{k}": v for k, v in zip(sums, values, strict=True)}


def validate(run: Run) -> dict[str, float]:
    """A validation during training: callbacks around evaluate(), then the best value and plateau schedules."""
    for cb in run.callbacks:
        cb.on_validation_start(run)
    metrics = evaluate(run)
    for name in {run.monitor, run.schedule.monitor, *(cb.monitor for cb in run.callbacks)} - {None}:
        if name not in metrics:
            raise ConfigError(
                f"monitored metric {name!r} is not produced by validation_step; it returns {sorted(metrics)}"
            )
    if run.monitor is not None:
        run.best.update(metrics[run.monitor], run.progress.step)
    run.schedule.on_validation(metrics)
    for cb in reversed(run.callbacks):  # unwinds on_validation_start: EMA swaps its weights back after the others
        cb.on_validation_end(run, metrics)
    return metrics


def fit(run: Run) -> Run:
    """Train until max_duration elapses or something asks to stop; returns `run` with stop_reason and metrics set."""
    p, task, opt, precision, dist = run.progress, run.task, run.optimizer, run.precision, run.distributed
    params = [q for q in task.parameters() if q.requires_grad]
    for cb in run.callbacks:
        cb.on_fit_start(run)
    meter, window_loss, bad_in_a_row = run.meter, None, 0
    meter.start(p)
    # A task may keep a constraint after each applied step (an SAE renormalises its decoder rows).
    after_step = getattr(task, "after_optimizer_step", lambda: None)
    clip = run.gradient_clip_val
    task.train()
    sampler, window_tokens = getattr(run.train_loader, "batch_sampler", None), None
    while run.stop_reason is None and not p.finished:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(p.epoch, skip=p.batch_in_epoch)  # a resumed run goes on with the next unseen batch
        for batch, last in with_last(run.train_loader):
            step_samples, size, tokens = p.window_samples(), batch_size_of(batch), tokens_of(batch)
            p.count_micro_batch()
            closes = p.window_done(last)
            batch = to_device(batch, run.device)
            with dist.sync(closes):  # DDP: gradients are all-reduced only on the micro-batch that closes the window
                with precision.autocast():
                    out = run.forward(batch)
                # The step's gradient is the mean over its samples: each micro-batch's mean loss is weighted by its
                # share of them (x world size, which DDP's gradient average divides out). A full window of k
                # micro-batches divides by exactly k; a window of one has no division op at all.
                share = step_samples / (size * run.world_size)
                precision.backward(out["loss"] / share if share != 1 else out["loss"])
            if tokens is not None:
                window_tokens = (window_tokens or 0) + tokens
            loss = out["loss"].detach()
            window_loss = loss if window_loss is None else window_loss + loss
            meter.add(out)
            if not closes:
                continue

            precision.unscale_(opt)
            norm = dist.grad_norm(params)  # the global norm, also when the gradients are sharded (FSDP)
            # The one host sync per optimizer step reads the window's loss and the global grad norm together.
            loss_sum, norm_value = torch.stack([window_loss.float(), norm.float()]).tolist()
            # fp16 loss scaling skips overflowed grads itself; a non-finite loss is always ours to skip.
            if math.isfinite(loss_sum) and (precision.handles_overflow or math.isfinite(norm_value)):
                if clip is not None and math.isfinite(norm_value) and norm_value > clip:
                    # clip_grad_norm_'s own arithmetic; below the threshold it would multiply by exactly 1.
                    torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
                precision.step(opt)
                after_step()
                bad_in_a_row = 0
            else:
                precision.skip()
                run.nonfinite_steps += 1
                bad_in_a_row += 1
                if bad_in_a_row >= run.max_nonfinite_steps:
                    run.request_stop("nonfinite")
            opt.zero_grad(set_to_none=True)
            meter.add_step(loss_sum, norm_value, opt.param_groups[0]["lr"])  # the LR this step used
            if window_tokens is not None:  # tokens differ by rank: their sum over ranks
                window_tokens = int(dist.all_sum(torch.tensor(window_tokens)).item())
            p.count_optimizer_step(step_samples, window_tokens or 0)
            window_tokens = None
            if last:
                p.end_epoch()
            run.schedule.on_optimizer_step()
            window_loss = None
            for cb in run.callbacks:
                cb.on_optimizer_step(run)
            _agree_on_stop(run)

            # The last step always validates and logs, so the summary describes the final weights and steps.
            metrics = {}
            if (
                run.val_loader is not None
                and run.stop_reason != "nonfinite"
                and (p.ticked(run.val_interval) or p.finished)
            ):
                started = time.perf_counter()
                metrics = validate(run)  # may ask to stop (early stopping)
                meter.clock += time.perf_counter() - started  # throughput is training time only
            done = p.finished or run.stop_reason is not None
            if p.ticked(run.log_interval) or (done and meter.micro and run.stop_reason not in RESUMABLE):
                metrics = {**meter.read(run, params), **metrics}
            if metrics:
                _log(run, metrics)
            for cb in run.callbacks:
                cb.on_step_end(run)
            if done:
                break
    if run.stop_reason is None:
        run.stop_reason = "max_duration"
        p.check_total()
    for cb in run.callbacks:
        cb.on_fit_end(run)
    if run.val_loader is not None and run.stop_reason not in ("nonfinite", *RESUMABLE):
        # restore_best, EMA and the like may leave other weights than the last validation saw: summary.json
        # describes the weights the run ends with (model.safetensors).
        run.metrics.update(evaluate(run))
    return run


def _agree_on_stop(run: Run) -> None:
    # A stop asked on one rank (a signal, max_time, a callback) stops every rank at this same step: no rank is left
    # waiting in a collective. Early stopping and non-finite skips are decided on reduced values, the same everywhere.
    reasons = (*RESUMABLE, "stopped_on_another_rank")
    flags = run.distributed.any([run.stop_reason == r for r in RESUMABLE] + [run.stop_reason is not None])
    for reason, flag in zip(reasons, flags, strict=True):
        if flag:
            run.request_stop(reason)
