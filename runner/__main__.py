"""`python -m runner`: the command. Joins the process group, agrees on one run folder, trains (runner.train), and
turns the outcome into an exit code: 2 configuration error, 3 non-finite losses, 75 stopped to be resumed, 130 Ctrl-C.
"""

from __future__ import annotations

import gc
import os

# OpenMP's wait policy for this machine's load, before torch loads OpenMP (runner/waits.py): threads that sleep at once
# where other processes use the cores, that spin a moment where none do; a user's own OMP_WAIT_POLICY wins.
from runner import waits  # noqa: E402 - the package's own import runs nothing else first

waits.choose()
gc.disable()  # while torch and the rest load: what runner.collector_paused says (train() pauses it again to build)

import difflib
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import hydra._internal.utils as hydra_utils
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig

from runner import IMPORTED_AT, ConfigError
from runner.config import resolvers
from runner.distributed.env import (
    QUIET_RANK,
    environment,
    exit_without_teardown,
    restart_count,
    shared_launch_time,
    with_resume_auto,
)
from runner.distributed.stopping import watch_for_refusals
from runner.failure import diverged, fail, failed, stopped_by
from runner.log.ranks import log_rank
from runner.log.tee import tee_to
from runner.run import StopReason
from runner.rundir import LOG, claim, unlock
from runner.rundir.old_names import renamed_options
from runner.rundir.refused import remove_refused
from runner.sweeps.job import objective, parallel_jobs, sweep_job, threads_per_job
from runner.timeline import command_started
from runner.train import train

gc.enable()

# Here, at import: every process that runs a job imports this module for main() (the command itself, and a joblib
# worker that unpickles main), and the config's resolvers must exist before Hydra composes or resolves that config.
resolvers.register()


def _one_paragraph(error: Exception) -> str:
    """Hydra's composition error as one paragraph; a misspelled key names its nearest valid sibling."""
    cause = error.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if parent is not None and key is not None and str(error).startswith("Could not override"):
        full = getattr(cause, "full_key", key)
        if full in (options := renamed_options()):
            return f"{full}= is no longer an option: {options[full]}"
        siblings = [str(k) for k in parent.keys()]
        close = difflib.get_close_matches(str(key), siblings, n=1, cutoff=0.5)
        scope = full.rpartition(".")[0]
        hint = f"did you mean {scope + '.' if scope else ''}{close[0]}?" if close else f"keys: {', '.join(siblings)}"
        return (
            f"{full} is not a key of the config ({hint}). `python -m runner ... --cfg job` prints every key; "
            f"a key of your own that some component reads is added with +{full}=..."
        )
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "provider=" not in line]
    lines = [line for line in lines if not line.startswith(("Config search path", "See https://"))]
    return " ".join(lines)


def _hydra_user_errors(run_and_report: Callable[[Callable[[], Any]], Any]) -> Callable[[Callable[[], Any]], Any]:
    """Hydra's reporter, with a command-line mistake (unknown option, misspelled key, bad override) as one paragraph
    and exit code 2 like every other configuration error, instead of Hydra's exit 1."""

    def translated(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except (ConfigCompositionException, MissingConfigException, OverrideParseException) as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            fail(ConfigError(_one_paragraph(error)), 2)
        except ConfigError as error:  # from outside a job: a sweep folder that another sweep holds
            fail(error, 2)
        except OSError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1" or _raised_in_job(error):
                raise
            fail(ConfigError(_folder_error(error)), 2)

    return lambda func: run_and_report(lambda: translated(func))


def _raised_in_job(error: BaseException) -> bool:
    # Whether `error` came out of main() (training's own, reported as it is) rather than from Hydra making the run
    # folder around it (mkdir, .hydra/, the log file) before the job starts.
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is main.__wrapped__.__code__:
            return True
        tb = tb.tb_next
    return False


def _folder_error(error: OSError) -> str:
    """What to do when the run folder cannot be made or written: hydra.run.dir names a file, or an unwritable place."""
    where = Path(str(error.filename)) if error.filename else None
    why = "it is a file, not a folder" if where is not None and where.is_file() else error.strerror or str(error)
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(sys.argv) else "hydra.run.dir"
    return (
        f"cannot make the run folder {where or ''} ({why}): {key} must name a folder you can write (made if missing), "
        f"e.g. {key}=outputs/my-run"
    )


_cli_entered: float | None = None  # when cli() began: Hydra's composition is the time from there to main()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train one run; return the best value of `monitor` so that sweepers can optimize it (runner.sweeps.job)."""
    global _cli_entered
    if _cli_entered is not None:  # the command's first job: its process start, imports and composition are its own
        command_started(IMPORTED_AT, config_s=time.perf_counter() - _cli_entered)
        _cli_entered = None
    hydra_cfg = HydraConfig.get()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir, rank = Path(hydra_cfg.runtime.output_dir), environment()["rank"]
    try:  # a bad `threads` (0, -3) is a ConfigError from here, before the folder is claimed: exit 2 (a sweep's too)
        threads = threads_per_job(cfg.get("threads"), parallel_jobs(hydra_cfg.launcher) if in_sweep else 1)
    except ConfigError as error:
        remove_refused(run_dir)
        if not in_sweep:  # said here: raised, it comes after a line of Hydra's ("Error executing job with ...")
            fail(error, 2)
        raise
    if threads is not None:
        torch.set_num_threads(threads)
    started, job = time.perf_counter(), sweep_job()
    try:
        if rank == 0:  # rank 0 owns the folder: its lock, its log
            claim(run_dir, hydra_cfg.output_subdir)
            tee_to(run_dir / LOG)
        log_rank(run_dir, rank)  # every rank: its warnings and errors in logs/rank-K.log
        if not in_sweep:  # another rank refused while this one waits for it in a collective: exit 2 with one line
            watch_for_refusals(lambda cause: stopped_by(cfg, cause, time.perf_counter() - started))
        run = train(cfg, sweep=job)
    except Exception as error:
        return failed(cfg, error, time.perf_counter() - started)
    finally:
        unlock(run_dir)
    reason = run.stop_reason
    if reason == StopReason.NONFINITE:
        message = diverged(run)
        if not in_sweep:  # in a sweep, one diverged trial must not end the others
            fail(message, reason.exit_code)
        print(f"error: {message}", file=sys.stderr)
    elif reason.resumable:  # preempted, max_time, Ctrl-C: a checkpoint of this step exists
        if run.strategy.is_main:
            print(
                f"stopped ({reason}) at step {run.progress.step}: continue with resume=auto "
                f"{shlex.quote(f'hydra.run.dir={cfg.run_dir}')}",
                file=sys.stderr,
            )
        sys.exit(reason.exit_code)
    return objective(reason, run.state.best.value, cfg.mode)


def debug_last(args: list[str]) -> list[str]:
    """`args` with each `debug=X` moved to the end as `+debug=X`. Hydra merges `+experiment=...` after every default,
    so a debug option in the defaults list would lose to the experiment's own durations; appended after it, the debug
    option's values win, and values given on the command line still win over both."""
    debug = [a for a in args if a.startswith(("debug=", "+debug="))]
    return [a for a in args if a not in debug] + ["+" + a.lstrip("+") for a in debug]


def run_dir_to_hydra_run_dir(args: list[str]) -> list[str]:
    """`args` with a `run_dir=X` given as `hydra.run.dir=X`. run_dir follows Hydra's output folder, where Hydra writes
    .hydra/ and rank 0's runner.log goes: set alone, it would split one run over two folders (X and outputs/...)."""
    given = [a for a in args if a.lstrip("+").startswith("run_dir=")]
    if not given:
        return args
    folder = given[-1].partition("=")[2]
    if {"-m", "--multirun"} & set(args):
        raise ConfigError(
            f"run_dir={folder} names one folder, and each job of a sweep needs its own: give the sweep's folder with "
            f"hydra.sweep.dir={folder} instead"
        )
    other = [a.partition("=")[2] for a in args if a.lstrip("+").startswith("hydra.run.dir=")]
    if other and other[-1] != folder:
        raise ConfigError(f"run_dir={folder} and hydra.run.dir={other[-1]} name two folders for one run: give one")
    return [a for a in args if a not in given] + ([] if other else [f"hydra.run.dir={folder}"])


def cli() -> None:
    """The command: under torchrun or SLURM, join the process group first and agree on one run folder;
    `runner init DIR` makes a project of your own (runner.tools.scaffold)."""
    global _cli_entered
    _cli_entered = time.perf_counter()
    if sys.argv[1:2] == ["init"]:
        from runner.tools.scaffold import main as init

        sys.exit(init(sys.argv[2:]))
    # hydra-core is pinned to 1.3.x, whose _run_hydra reports errors through this module-level function.
    hydra_utils.run_and_report = _hydra_user_errors(hydra_utils.run_and_report)
    try:
        resolvers.set_launch_time(shared_launch_time())
    except ConfigError as error:  # a launch that cannot form its process group (no rendezvous address, say)
        fail(error, 2)
    rank = environment()["rank"]
    if restart_count() > 0:
        # torchrun --max-restarts restarted the workers after a failure: go on from the run's newest checkpoint
        # (the launch time, hence the run folder, is the first launch's).
        sys.argv = with_resume_auto(sys.argv)
        if rank == 0:
            print(f"elastic restart {restart_count()}: resuming from the newest checkpoint", file=sys.stderr)
    if rank > 0:
        sys.argv += QUIET_RANK
    sys.argv[1:] = debug_last(sys.argv[1:])
    try:
        sys.argv[1:] = run_dir_to_hydra_run_dir(sys.argv[1:])
    except ConfigError as error:
        fail(error, 2)
    if environment()["world_size"] == 1:
        try:
            main()
        finally:
            # The job is over: the interpreter's teardown would walk and free every object torch made, one by one
            # (0.8 of a digits run's 2.9 s of CPU); frozen, they are left to the OS. (Ranks skip the teardown.)
            gc.freeze()
        return
    try:
        main()
    except SystemExit as stop:
        exit_without_teardown(stop.code)
    exit_without_teardown(0)


if __name__ == "__main__":
    cli()
