"""What a sweep job decides in-process: its threads when jobs run in parallel, and what it returns to the sweeper.
Sweeps for real (`-m`): tests/e2e/test_sweep.py."""

from __future__ import annotations

import math
import os

from runner.sweeps.job import objective, parallel_jobs, threads_per_job


def test_threads_per_job_shares_the_cores_between_parallel_jobs() -> None:
    assert threads_per_job(None, 1, cores=16) is None  # one job at a time: torch's default
    assert threads_per_job(None, 4, cores=16) == 4
    assert threads_per_job(None, 3, cores=2) == 1
    assert threads_per_job(2, 4, cores=16) == 2  # `threads` set: it wins
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    cores = len(os.sched_getaffinity(0))
    assert parallel_jobs({"_target_": joblib, "n_jobs": 3}) == 3
    assert parallel_jobs({"_target_": joblib, "n_jobs": -1}) == cores
    assert parallel_jobs({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}) == 1


def test_what_a_job_returns_to_the_sweeper() -> None:
    assert objective("max_duration", 0.25, "min") == 0.25
    assert objective("early_stopping", None, "min") is None  # never validated: no value
    assert objective("nonfinite", 0.25, "min") == math.inf and objective("nonfinite", 0.9, "max") == -math.inf
    assert objective("failed", None, "max") is None
