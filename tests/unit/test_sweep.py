"""What a sweep job decides in-process: its threads when jobs run in parallel, and what it returns to the sweeper;
Optuna's log lines in a pipe. Sweeps for real (`-m`): tests/e2e/test_sweep.py."""

from __future__ import annotations

import io
import logging
import math
import os
import re
from pathlib import Path

import pytest
from helpers import CONF_DIR
from hydra import compose, initialize_config_dir

from runner.rundir import unlock
from runner.sweeps.callback import SweepResults
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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_optuna_logs_have_colour_codes_only_on_a_terminal(
    stream: type[io.StringIO], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep's start (SweepResults.on_multirun_start, for hparams_search=digits_optuna) fixes Optuna's handler
    import optuna

    for name in ("NO_COLOR", "FORCE_COLOR"):  # colorlog reads them
        monkeypatch.delenv(name, raising=False)
    optuna.logging.get_verbosity()  # Optuna's own handler exists
    (handler,) = [h for h in logging.getLogger("optuna").handlers if type(h) is logging.StreamHandler]  # not pytest's
    out = stream()
    monkeypatch.setattr(handler, "stream", out)
    monkeypatch.setattr(handler, "formatter", handler.formatter)  # Optuna's colorlog formatter again after the test
    log = optuna.logging.get_logger("optuna.study.study")
    log.warning("before")
    assert "\x1b[" in out.getvalue()  # colorlog colours whatever the stream

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            ["+experiment=digits", "hparams_search=digits_optuna", f"hydra.sweep.dir={tmp_path}"],
            return_hydra_config=True,
        )
    SweepResults().on_multirun_start(config=cfg)
    unlock(tmp_path)
    log.warning("Trial 0 finished with value: 0.5")
    after = out.getvalue().split("\n", 1)[1]  # the line logged after the sweep's start
    assert "Trial 0 finished with value: 0.5" in after
    assert ("\x1b[" in after) == out.isatty(), repr(after)
    if not out.isatty():
        assert re.fullmatch(r"\[W \d{4}-\d\d-\d\d [\d:,]+\] Trial 0 finished with value: 0\.5\n", after), after
