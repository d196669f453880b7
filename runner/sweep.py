"""Sweeps (`-m`): the results.csv callback, the leaderboard at the end, and what a job reports to a sweeper."""

from __future__ import annotations

import fcntl
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.results import collect, job_row, leaderboard, table_console, write_csv


def objective(stop_reason: str | None, best: float | None, mode: str) -> float | None:
    """What a job returns to the sweeper: its best monitored value; the worst value if it diverged; None if it failed.

    A diverged trial is a real (bad) result: +inf under `min` lets Optuna's sampler learn to avoid that region,
    where NaN would make Optuna 2's tell() raise and end the study. None (no value) marks a failed job: Optuna
    records the trial as FAIL and goes on.
    """
    if stop_reason == "nonfinite":
        return math.inf if mode == "min" else -math.inf
    if stop_reason == "failed":
        return None
    return best


def threads_per_job(threads: int | None, parallel_jobs: int, cores: int | None = None) -> int | None:
    """Torch threads for one job: `threads` if set, else the cores shared by the jobs that run at once (None: keep)."""
    if threads is not None:
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


class SweepResults(Callback):
    """Keeps `results.csv` in the sweep folder up to date as jobs finish, and prints the leaderboard at the end.

    A failed job is a row (status `failed`, with its error) and the sweep goes on, unless `fail_fast` is set: then
    the first failed job ends the sweep with an error.
    """

    def __init__(self, fail_fast: bool = False, filename: str = "results.csv", top: int | None = 30) -> None:
        self.fail_fast = fail_fast
        self.filename = filename
        self.top = top

    def _update(self, sweep_dir: Path) -> list[dict[str, Any]]:
        # Parallel launchers (joblib) finish jobs in several processes at once: one writer at a time, each one
        # re-reading every job folder, so the last writer's file has every finished job.
        # The lock is on the folder itself, so no lock file is left behind.
        sweep_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(sweep_dir, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            rows = collect(sweep_dir)
            write_csv(rows, sweep_dir / self.filename)
        finally:
            os.close(lock)  # releases the lock
        return rows

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Create the sweep folder before the sweeper starts (Optuna opens its SQLite storage in it)."""
        Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Add the job's row to results.csv; with fail_fast, end the sweep if the job failed."""
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        rows = self._update(Path(str(config.hydra.sweep.dir)))
        job_dir = Path(str(config.hydra.runtime.output_dir))
        row = next((r for r in rows if r["job"] == job_dir.name), None) or job_row(job_dir)
        if self.fail_fast and row["status"] == "failed":
            print(
                f"error: job {row['job']} failed: {row.get('error')}; stopping the sweep (fail_fast). "
                f"Its folder: {job_dir}; every finished job is in {self.filename}",
                file=sys.stderr,
            )
            # Hydra turns an Exception from a callback into a warning and launches the next job; SystemExit is
            # not an Exception, so it ends the sweep here.
            raise SystemExit(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the final results.csv and print the leaderboard."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = self._update(sweep_dir)
        if not rows:
            return
        console = table_console()
        console.print(leaderboard(rows, mode=str(config.get("mode", "min")), top=self.top))
        counts = Counter(row["status"] for row in rows)
        tally = ", ".join(f"{n} {status}" for status, n in counts.most_common())
        console.print(f"{len(rows)} jobs: {tally}. Results: {sweep_dir / self.filename}", highlight=False)
        if counts["failed"]:
            print(f"{counts['failed']} job(s) failed: their errors are in results.csv and above", file=sys.stderr)
        if counts["failed"] == len(rows):  # nothing to compare: the sweep as a whole failed
            raise SystemExit(1)
