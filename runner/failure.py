"""How a job that cannot go on ends: each rank says why in one line, every rank exits with the code they agreed on
(runner.distributed.stopping), and the run folder keeps why in summary.json, or is removed where the run was refused
before it trained (runner.rundir.refused). A diverged run's message says what to change."""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner import ConfigError
from runner.distributed.env import environment
from runner.distributed.stopping import Stop, leave_together, stop_together, stopping_ranks_at
from runner.log.ranks import record_failure
from runner.run import Run, StopReason
from runner.rundir import SUMMARY, DiskFull, FolderInUse, unlock, write_json
from runner.rundir.refused import remove_refused
from runner.sweeps.job import objective


def fail(error: Exception, code: int) -> NoReturn:
    """Say `error` on this rank and exit with `code` once every rank has chosen its own."""
    # Every rank says why it stops (a missing file may be missing on one node only), each naming itself; under
    # several processes it exits once every rank has chosen its code (runner.distributed.stopping).
    _say(error)
    stop_together(code, str(error), isinstance(error, DiskFull))
    leave_together(code)
    sys.exit(code)


def _say(error: Exception) -> None:
    rank = environment()["rank"]
    # One write with its newline: torchrun starts workers unbuffered (python -u), where print's text and newline
    # are two writes and another rank's line can land between them
    sys.stderr.write(f"error{f' on rank {rank}' if rank else ''}: {error}\n")
    sys.stderr.flush()


def failed(cfg: DictConfig, error: Exception, wall_time_s: float) -> float | None:
    """End a job that raised `error`: record it, then exit (2 for a ConfigError), re-raise, or in a sweep go on."""
    # Under several processes, a rank whose collective failed because another rank was refused (a full disk on rank 0,
    # a file missing on one node) stops as that one does, exit 2, with one line; the run records that rank's message.
    # (Asked first: where the watcher thread is stopping this rank already, this thread writes nothing more.)
    cause = stop_together(2 if isinstance(error, ConfigError) else 1, str(error), isinstance(error, DiskFull))
    if not isinstance(error, FolderInUse):  # (that folder is another run's)
        record_failure(error)  # logs/rank-K.log, with the traceback, on every rank
    if cause is not None:
        error = _refused_on(cause)
    if isinstance(error, ConfigError):  # every rank's log is written before rank 0 may remove the folder it is in
        stopping_ranks_at("recorded")
    if not isinstance(error, FolderInUse):
        _leave_folder(cfg, error, wall_time_s)
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # one failed job must not end the sweep (fail_fast: SweepResults)
        if not isinstance(error, ConfigError):
            traceback.print_exc()
        print(f"error: job {HydraConfig.get().job.num} failed: {error}", file=sys.stderr)
        return objective(StopReason.FAILED, None, cfg.mode)
    if cause is not None:  # its paragraph is that rank's to print
        fail(_stopped_line(cause), 2)
    if isinstance(error, ConfigError):
        fail(error, 2)
    raise error


def stopped_by(cfg: DictConfig, cause: Stop, wall_time_s: float) -> None:
    """Stop this rank because another was refused: the run folder says why, the console one line."""
    # Runs in runner.distributed.stopping's watcher thread, which then exits 2 once every rank is ready.
    stopping_ranks_at("recorded")
    # The main thread goes on meanwhile: a warning of its own would make its rank log again, and with it the run folder
    # that a refused start removes; what stopped the run is said here
    logging.disable(logging.CRITICAL)
    _leave_folder(cfg, _refused_on(cause), wall_time_s)
    unlock(HydraConfig.get().runtime.output_dir)
    _say(_stopped_line(cause))


def _leave_folder(cfg: DictConfig, error: Exception, wall_time_s: float) -> None:
    # A run refused before training leaves no folder of its own (runner.rundir.refused); else summary.json says why
    # (a sweep's results.csv reads it)
    refused = isinstance(error, ConfigError) and not isinstance(error, DiskFull)  # (a full disk: resume=auto)
    if not (refused and remove_refused(HydraConfig.get().runtime.output_dir)):
        _record_failure(cfg, error, wall_time_s)


def _record_failure(cfg: DictConfig, error: BaseException, wall_time_s: float) -> None:
    # summary.json of a failed run says why (a sweep job's row in results.csv and `runner.tools.report` read it; the
    # console and runner.log say it too). A summary.json already there (a finished or preempted launch that this one
    # failed to resume) is kept: nothing it says is lost.
    path = Path(cfg.run_dir) / SUMMARY
    if environment()["rank"] == 0 and path.parent.is_dir() and not path.exists():
        error_text = str(error) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
        try:
            write_json(path, {"stop_reason": StopReason.FAILED, "error": error_text, "wall_time_s": wall_time_s})
        except (OSError, ConfigError) as failed:  # a full disk fails this write too: the first error is the one to tell
            print(f"warning: {SUMMARY} not written ({str(failed).split(';')[0]})", file=sys.stderr)


def _refused_on(cause: Stop) -> ConfigError:
    """Another rank's refusal as this rank's error: what the run folder records."""
    return (DiskFull if cause.disk_full else ConfigError)(f"rank {cause.rank}: {cause.message}")


def _stopped_line(cause: Stop) -> ConfigError:
    return ConfigError(f"stopped because rank {cause.rank} stopped (exit 2; its message says why)")


def diverged(run: Run) -> RuntimeError:
    """The error of a run stopped on non-finite losses (StopReason.NONFINITE), with what to change."""
    return RuntimeError(
        f"stopped after {run.settings.max_nonfinite_steps} optimizer steps in a row with a non-finite loss "
        f"or gradient norm (trainer.max_nonfinite_steps). {_nonfinite_advice(run.settings.gradient_clip_val)}"
    )


def _nonfinite_advice(clip: float | None) -> str:
    """What to change after a run stopped on non-finite losses: a clip to set only where none is."""
    if clip is None:
        return "Lower the learning rate, enable trainer.gradient_clip_val (e.g. 1.0), or check the data for NaN/inf."
    # Clipped already: a clip bounds the gradient, and Adam's step is about the learning rate whatever the gradient's
    # size, so the rate is the lever (a smaller clip only helps plain SGD), unless the data itself is not finite.
    return (
        f"The gradients were clipped already (trainer.gradient_clip_val={clip:g}): lower the learning rate "
        "(optimizer.lr; a longer warmup helps too), or check the data for NaN/inf. Only with optimizer=sgd does a "
        "smaller clip also bound each step."
    )
