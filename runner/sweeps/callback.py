"""Sweeps (`-m`): the Hydra callback that keeps results.csv up to date and prints the leaderboard at the end; Optuna's
log lines without colour codes when they do not go to a terminal."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.rundir import FolderInUse, lock, locked, unlock
from runner.sweeps.frontier import show_frontiers
from runner.sweeps.results import collect, job_row, leaderboard, table_console, write_csv

RESULTS_LOCK = ".results.lock"  # one job at a time writes results.csv (removed when released)


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
        # re-reading every job folder, so the last writer's file has every finished job. A lock of its own: the
        # sweep's process holds the folder's (on_multirun_start) for the whole sweep.
        with locked(sweep_dir, RESULTS_LOCK):
            rows = collect(sweep_dir)
            write_csv(rows, sweep_dir / self.filename)
        return rows

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Create and lock the sweep folder before the sweeper starts (Optuna opens its SQLite storage in it): a
        second sweep on the same folder is refused instead of mixing its rows into this one's results.csv."""
        Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        try:
            lock(config.hydra.sweep.dir, "sweep folder")
        except FolderInUse as error:  # Hydra turns a callback's exception into a warning: stop the sweep here
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        if "optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_", default="")):
            plain_optuna_logs()  # before the sweeper imports Optuna and logs its study

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
            unlock(config.hydra.sweep.dir)
            raise SystemExit(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the final results.csv, print the leaderboard (and the frontier of jobs that report one) and release
        the sweep folder."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = self._update(sweep_dir)
        unlock(sweep_dir)
        if not rows:
            return
        console = table_console()
        console.print(leaderboard(rows, mode=str(config.get("mode", "min")), top=self.top))
        show_frontiers(console, rows)
        counts = Counter(row["status"] for row in rows)
        tally = ", ".join(f"{n} {status}" for status, n in counts.most_common())
        console.print(f"{len(rows)} jobs: {tally}. Results: {sweep_dir / self.filename}", highlight=False)
        if counts["failed"]:
            print(f"{counts['failed']} job(s) failed: their errors are in results.csv and above", file=sys.stderr)
        if counts["failed"] == len(rows):  # nothing to compare: the sweep as a whole failed
            raise SystemExit(1)


def plain_optuna_logs() -> None:
    """Optuna's log lines without colour codes where its stream is not a terminal (a pipe, a file, a SLURM log):
    Optuna's own handler formats them with colorlog, which writes escape codes whatever the stream."""
    import colorlog  # Optuna's dependency
    import optuna

    optuna.logging.get_verbosity()  # makes Optuna's handler, if no Optuna module has made it yet
    for handler in logging.getLogger("optuna").handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler.formatter, colorlog.ColoredFormatter) and not _is_terminal(stream):
            handler.setFormatter(logging.Formatter("[%(levelname)1.1s %(asctime)s] %(message)s"))  # Optuna's format


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())  # a Tee (runner.log.tee) answers for the console it writes to
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False
