"""fit(): the loop. A micro-step (forward, backward), an optimizer step (the non-finite guard, clipping, precision,
counting, the schedule), then validation, logging and the callbacks' end of step. What belongs to the step itself
lives here, in one place; every feature is a component or a callback."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from runner import ConfigError
from runner.config.monitors import wanted
from runner.data import batch_size_of, device_batches, tokens_of, with_last
from runner.run import Run, StopReason
from runner.timeline import phase
from runner.validation import batches_of, evaluate_loader


@dataclass
class _Window:
    """What the micro-batches of one optimizer step add up."""

    loss: torch.Tensor | None = None  # the sum of the micro-batches' mean losses, on the device
    tokens: int | None = None  # this rank's tokens (None: the batches carry no num_tokens)
    size: int = 0  # this rank's samples
    samples: int = 0  # the step's samples over all ranks


def fit(run: Run) -> Run:
    """Train until max_duration elapses or something asks to stop; returns `run` with stop_reason and metrics set."""
    p = run.progress
    # the tensors the optimizer steps: the parameters, or *_true's fp32 masters, which hold the gradients once unscaled
    params = run.precision.stepped([q for q in run.task.parameters() if q.requires_grad])
    for cb in run.callbacks:
        cb.on_fit_start(run)
    _tell_task(run)  # a resumed run's last logged row, as the uninterrupted run had it at this step
    if run.device.type == "cuda":
        # sys/peak_memory_mb is this run's (from its weights on): a sweep's jobs share one process, one after another
        torch.cuda.reset_peak_memory_stats(run.device)
    run.state.meter.start()
    run.task.train()
    sampler, window = getattr(run.train_loader, "batch_sampler", None), _Window()
    while run.stop_reason is None and not p.finished:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(p.epoch, skip=p.batch_in_epoch)  # a resumed run goes on with the next unseen batch
        for batch, last in with_last(device_batches(run.train_loader, run.device)):
            if not micro_step(run, batch, last, window):
                continue  # the accumulation window is still open
            optimizer_step(run, params, window, last)
            window = _Window()
            if end_step(run, params):
                break
    if run.stop_reason is None:
        run.stop_reason = StopReason.MAX_DURATION
        p.check_total()
    for cb in run.callbacks:
        cb.on_fit_end(run)
    if run.val_loader is not None and run.stop_reason != StopReason.NONFINITE and not run.stop_reason.resumable:
        # restore_best, EMA and the like may leave other weights than the last validation saw: summary.json
        # describes the weights the run ends with (model.safetensors). The same weights are not evaluated twice.
        if run.evaluated is None or run.evaluated != weights_version(run.task):
            with phase("final validation"):
                run.state.metrics.update(evaluate(run))
    return run


def micro_step(run: Run, batch: object, last: bool, window: _Window) -> bool:
    """Forward and backward of one micro-batch; True when it closes the accumulation window (a step is due)."""
    p = run.progress
    window.samples, size, tokens = p.window_samples(), batch_size_of(batch), tokens_of(batch)
    p.count_micro_batch()
    closes = p.window_done(last)
    with run.strategy.sync(closes):  # DDP: gradients are all-reduced only on the micro-batch that closes the window
        with run.precision.autocast():
            out = run.forward(batch)
        # The step's gradient is the mean over its samples: each micro-batch's mean loss is weighted by its share of
        # them (x world size, which DDP's gradient average divides out). A full window of k micro-batches divides by
        # exactly k; a window of one has no division op at all.
        share = window.samples / (size * run.world_size)
        run.precision.backward(out["loss"] / share if share != 1 else out["loss"])
    if tokens is not None:
        window.tokens = (window.tokens or 0) + tokens
    window.size += size
    loss = out["loss"].detach().float()
    window.loss = loss if window.loss is None else window.loss + loss
    run.state.meter.add(out)
    return closes


def optimizer_step(run: Run, params: list[torch.Tensor], window: _Window, last: bool) -> None:
    """Apply the step (skipped on the device when the loss or gradient norm is not finite), count it, move the
    schedule. Nothing here reads the device: the flag, the loss and the norm are summed on it until the next log."""
    state, precision, optimizer = run.state, run.precision, run.optimizer
    precision.unscale_(optimizer)
    norm = run.strategy.grad_norm(params)  # the global norm, also when the gradients are sharded (FSDP)
    # 1 skips the step on every rank: a non-finite loss on any of them (a rank's loss is its own), or a non-finite
    # global norm. fp16 loss scaling skips overflowed gradients itself (uncounted: overflow is how it finds its scale).
    checked = window.loss if precision.handles_overflow else window.loss + norm
    # x * 0 is (+-)0 for a finite x, NaN for an infinite or NaN one: the flag in two small ops.
    skip = run.strategy.all_max((checked * 0).nan_to_num(1.0, 1.0, 1.0))
    clip = run.settings.gradient_clip_val
    if clip is not None:
        # clip_grad_norm_'s own arithmetic, without a branch on the host: below the threshold it multiplies by
        # exactly 1 (a skipped step's NaN coefficient is harmless: its update is dropped).
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
    for cb in run.callbacks:
        cb.on_before_optimizer_step(run)
    precision.step(optimizer, skip)
    # A task may keep a constraint after each step (an SAE renormalises its decoder rows). It runs after skipped
    # steps too (whether a step was skipped is known on the device only): a skipped step left the weights as they were.
    getattr(run.task, "after_optimizer_step", lambda: None)()
    optimizer.zero_grad(set_to_none=True)
    run.progress.count_optimizer_step(window.samples, _step_tokens(run, window))
    if last:
        run.progress.end_epoch()
    state.meter.add_step(window.loss, norm, skip, optimizer.param_groups[0]["lr"])  # the LR this step used
    run.schedule.on_optimizer_step()
    for cb in run.callbacks:
        cb.on_optimizer_step(run)
    if run.progress.ticked(run.settings.stop_check_interval) or run.world_size == 1:
        _agree_on_stop(run)


def _step_tokens(run: Run, window: _Window) -> int:
    # The step's tokens over all ranks. Data that declares data.tokens_per_sample (fixed-length windows) needs no
    # communication: every rank checks its own batches against it, so the global count is exact. Other data sums its
    # ranks' counts with one small host collective per step (a CPU tensor: gloo, never a device sync).
    tokens, per_sample = window.tokens, run.progress.tokens_per_sample
    if tokens is None:
        return 0
    if per_sample:
        if tokens != window.size * per_sample:
            raise ConfigError(
                f"data.tokens_per_sample={per_sample:g}, but {window.size} samples came with num_tokens={tokens}: "
                "set data.tokens_per_sample=null for data whose samples differ in length"
            )
        return round(window.samples * per_sample)
    if run.world_size == 1:
        return tokens
    return int(run.strategy.all_sum(torch.tensor(tokens)).item())


def end_step(run: Run, params: list[torch.Tensor]) -> bool:
    """Validate and log when due (the last step always does both), then on_step_end; True when training is over."""
    p, state = run.progress, run.state
    metrics = {}
    due = p.ticked(run.settings.val_interval) or p.finished
    if run.val_loader is not None and run.stop_reason != StopReason.NONFINITE and due:
        started = time.perf_counter()
        with phase("validation"):
            metrics = validate(run)  # may ask to stop (early stopping)
        state.meter.clock += time.perf_counter() - started  # throughput is training time only
    done = p.finished or run.stop_reason is not None
    resumable = run.stop_reason is not None and run.stop_reason.resumable
    if p.ticked(run.settings.log_interval) or (done and state.meter.micro and not resumable):
        metrics = {**state.meter.read(run.strategy, params), **metrics}
        # Skipped steps are counted on the device and read here: the limit is enforced at log steps (the steps
        # skipped in between changed no weight).
        if state.meter.longest_streak >= run.settings.max_nonfinite_steps:
            run.request_stop(StopReason.NONFINITE)
    if metrics:
        _log(run, metrics)
        _tell_task(run)
    for cb in run.callbacks:
        cb.on_step_end(run)
    return p.finished or run.stop_reason is not None


def _agree_on_stop(run: Run) -> None:
    # A stop asked on one rank (a signal, max_time, a callback) stops every rank at the same step: the stop checks
    # fall on the same steps everywhere, so no rank is left waiting in a collective, and the steps between them have
    # none. Early stopping and non-finite skips are decided on reduced values, the same everywhere (StopReason.agreed).
    asked = run.stop_asked
    if run.world_size == 1:  # nothing to agree on: checked every step, and a tiny model's step is ~600 us
        run.stop_reason = run.stop_reason or asked
        return
    resumable = [reason for reason in StopReason if reason.resumable]
    flags = run.strategy.any([asked == r for r in resumable] + [asked is not None])
    flagged = [r for r, f in zip([*resumable, StopReason.STOPPED_ON_ANOTHER_RANK], flags, strict=True) if f]
    if flagged:
        run.stop_reason = run.stop_reason or asked or flagged[0]


def _log(run: Run, metrics: dict[str, float]) -> None:
    p = run.progress
    counts = {"epoch": p.epoch_float} if p.batches_per_epoch else {}  # a stream has no epochs
    counts |= {"samples": p.samples, **({"tokens": p.tokens} if p.tokens else {})}
    metrics = {**counts, **metrics}
    run.state.metrics.update(metrics)
    for logger in run.loggers:
        logger.log(metrics, p.step)


def _tell_task(run: Run) -> None:
    # A task may decide what its steps compute from what the log rows read from the device anyway (an SAE's AuxK
    # runs while the last row saw dead latents), so that no other step reads it. The last row is checkpointed
    # (state.metrics), so a resumed run decides as the uninterrupted one did.
    getattr(run.task, "logged", lambda metrics: None)(run.state.metrics)


def weights_version(task: torch.nn.Module) -> tuple:
    """Which weights the task holds now: each parameter's and buffer's storage and in-place version, so that a copy
    into them (EMA, restore_best, a resumed checkpoint) and every optimizer step tell."""
    tensors = [*task.parameters(), *task.buffers()]
    return tuple((t.data_ptr(), t._version) for t in tensors)


def evaluate(run: Run, during_training: bool = False) -> dict[str, float]:
    """One pass over the run's validation loader (the first trainer.val_during_training of it `during_training`):
    evaluate_loader with the run's task, precision and ranks."""
    working = functools.partial(run.working, "validation")
    share = run.settings.val_during_training if during_training else None
    # a loader of unknown length (a data module of your own may give one) is read whole: its share is not known
    total = len(run.val_loader) if hasattr(run.val_loader, "__len__") else None
    batches = batches_of(total, share) if total is not None else None
    metrics = evaluate_loader(
        run.task, run.val_loader, run.precision, run.device, run.strategy.all_sum, working, batches
    )
    if batches == total:  # the whole split: the final pass need not evaluate these weights again
        run.evaluated = weights_version(run.task)
    return metrics


def validate(run: Run) -> dict[str, float]:
    """A validation during training: callbacks around evaluate(), then the best value and plateau schedules."""
    for cb in run.callbacks:
        cb.on_validation_start(run)
    metrics = evaluate(run, during_training=not run.progress.finished)
    for cb in reversed(run.callbacks):  # unwinds on_validation_start: EMA swaps its weights back after the others
        cb.on_validation_end(run, metrics)
    # After the callbacks, so that the best value and a plateau schedule may follow a metric one of them adds.
    for name in wanted(run):
        if name not in metrics:
            raise ConfigError(f"monitored metric {name!r} is not produced by validation; it gave {sorted(metrics)}")
    if run.settings.monitor is not None:
        run.state.best.update(metrics[run.settings.monitor], run.progress.step)
        run.state.monitored.append([run.progress.step, metrics[run.settings.monitor]])
    run.schedule.on_validation(metrics)
    return metrics
