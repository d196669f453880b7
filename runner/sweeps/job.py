"""A job of a sweep: which sweep and job it is, how many threads it gets, and what it returns to the sweeper."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner import ConfigError
from runner.run import Best, StopReason

SWEEP_DIR_VARIABLE = "RUNNER_SWEEP_DIR"  # set by runner's torchrun launcher for the processes of a job


@dataclass(frozen=True)
class SweepJob:
    """Job `num` of the sweep whose folder is `dir`."""

    dir: Path
    num: int


def sweep_job() -> SweepJob | None:
    """This process's job when it runs one of a sweep, else None; called once, by the CLI.

    A job of `-m` is Hydra's MULTIRUN mode; a job of runner's torchrun launcher is a plain run (in a child process)
    whose launcher set RUNNER_SWEEP_DIR: the one place that variable is read.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # train() called from Python
        return None
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return SweepJob(Path(hc.sweep.dir), hc.job.num)
    if os.environ.get(SWEEP_DIR_VARIABLE):
        return SweepJob(Path(os.environ[SWEEP_DIR_VARIABLE]), hc.job.num)
    return None


def objective(stop_reason: str | None, best: float | None, mode: str) -> float | None:
    """What a job returns to the sweeper: its best monitored value; the worst value if it diverged; None if it failed.

    A diverged trial is a real (bad) result: +inf under `min` lets Optuna's sampler learn to avoid that region,
    where NaN would make Optuna 2's tell() raise and end the study. None (no value) marks a failed job: Optuna
    records the trial as FAIL and goes on.
    """
    if stop_reason == StopReason.NONFINITE:
        return Best(mode).worst
    if stop_reason == StopReason.FAILED:
        return None
    return best


def threads_per_job(threads: int | None, parallel_jobs: int, cores: int | None = None) -> int | None:
    """Torch threads for one job: `threads` if set, else the cores shared by the jobs that run at once (None: keep).
    A ConfigError for a `threads` that is not a whole number >= 1 (torch refuses 0 and negative counts), or that is
    more than the machine's logical CPUs."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(
                f"threads must be a whole number >= 1, or null (torch's default), got {threads!r}: e.g. threads=4"
            )
        # Torch's threads share out one operation's work and wait for each other at its end: past one per logical
        # CPU they only take turns (threads=5000 ran at 5 samples/s) and exhaust the machine's threads (100000 crashed
        # with a segfault, exit 139). os.cpu_count() and not this process's CPUs (sched_getaffinity): a count that
        # suits the machine is not refused for an affinity the launcher may set differently next time.
        logical = os.cpu_count() or 1
        if threads > logical:
            usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
            yours = f", {usable} of them usable by this process" if usable < logical else ""
            raise ConfigError(
                f"threads={threads} is more than this machine's {logical} logical CPU cores{yours}: threads past "
                f"one per core only wait for each other; give threads={min(usable, logical)} or fewer, or "
                "threads=null (torch's default)"
            )
        return threads
    if parallel_jobs == 1:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // parallel_jobs)


def parallel_jobs(launcher: DictConfig | dict[str, Any]) -> int:
    """How many jobs the launcher runs at once: joblib's n_jobs (-1 = one per core), else one."""
    n_jobs = launcher.get("n_jobs") if "joblib" in str(launcher.get("_target_", "")) else 1
    if n_jobs is None or n_jobs == 0:
        return 1
    cores = len(os.sched_getaffinity(0))
    return n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)  # joblib: -1 all cores, -2 all but one, ...
