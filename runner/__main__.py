"""`python -m runner`: compose the config, build the run, resume, fit, write the summary, tear down."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner import ConfigError
from runner.build import build, run_info, sweep_job
from runner.callbacks import Callback
from runner.checkpoint import Checkpoint, load_checkpoint, newest_valid, save_weights
from runner.distributed import environment
from runner.loggers import run_metadata, write_json
from runner.loop import RESUMABLE, Run, fit
from runner.state import FINISHED, model_weights, restore
from runner.sweep import objective, parallel_jobs, threads_per_job

# Exit codes: 2 configuration error, 3 stopped by non-finite losses, 75 stopped to be resumed (preempted by
# SIGTERM/SIGUSR1, or trainer.max_time), 130 interrupted (Ctrl-C).
EXIT_CODES = {"nonfinite": 3, "preempted": 75, "max_time": 75, "interrupted": 130}


def _hydra_subdir(output_dir: str, resume: Any) -> str:
    # A launch that resumes into an existing run folder keeps that folder's .hydra/ and stores its own beside it.
    if resume is not None and (Path(output_dir) / ".hydra" / "config.yaml").is_file():
        return f".hydra/resume-{time.strftime('%Y%m%d-%H%M%S')}"
    return ".hydra"


OmegaConf.register_new_resolver("runner_hydra_subdir", _hydra_subdir, replace=True)
# Optuna's direction from the config's `mode` of `monitor` (conf/hparams_search/): one setting, not two to keep equal.
OmegaConf.register_new_resolver(
    "runner_direction", lambda mode: {"min": "minimize", "max": "maximize"}[str(mode)], replace=True
)
_launch = {"time": None}  # set by cli(): rank 0's clock under torchrun, so that every rank dates the same folder
OmegaConf.register_new_resolver(
    "runner_now", lambda pattern: time.strftime(pattern, time.localtime(_launch["time"] or time.time())), replace=True
)


def summarize(run: Run, wall_time_s: float) -> dict[str, Any]:
    """What summary.json holds."""
    p = run.progress
    best = run.best
    return {
        "stop_reason": run.stop_reason,
        "progress": {k: getattr(p, k) for k in ("step", "micro_batch", "epoch", "samples", "tokens")},
        "metrics": run.metrics,
        "best": {"monitor": run.monitor, "value": best.value, "step": best.step} if best.value is not None else None,
        "nonfinite_steps": run.nonfinite_steps,
        "wall_time_s": wall_time_s,
        "samples_per_s": p.samples / wall_time_s if wall_time_s > 0 else 0.0,
    }


def resume(run: Run, cfg: DictConfig) -> dict[str, Any] | None:
    """Restore the checkpoint that `cfg.resume` names ('auto': the newest valid one of this run); its manifest."""
    where = cfg.get("resume")
    if where is None:
        return None
    say = print if run.distributed.is_main else lambda *a, **k: None
    if where == "auto":
        saver = next((cb for cb in run.callbacks if isinstance(cb, Checkpoint)), None)
        directory = saver.dir if saver is not None else Path(cfg.run_dir) / "checkpoints"
        found = newest_valid(directory)
        if found is None:
            say(f"resume=auto: no checkpoint in {directory}; starting from scratch", file=sys.stderr)
            return None
        folder, contents = found
    else:
        folder, contents = Path(where), load_checkpoint(where)
    manifest = restore(run, contents, allow_changes=cfg.get("resume_allow_changes", False))
    say(f"resuming from {folder} (step {manifest['step']})", file=sys.stderr)
    return manifest


@contextlib.contextmanager
def _preemptible(run: Run) -> Iterator[None]:
    # SIGTERM and SIGUSR1 (what SLURM sends before a time limit): finish the current optimizer step, save a
    # checkpoint (the checkpoint callback saves whenever a run stops), write the summary, exit 75.
    def handler(signum: int, frame: Any) -> None:
        print(f"received {signal.Signals(signum).name}: stopping after this step", file=sys.stderr)
        run.request_stop("preempted")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def train(cfg: DictConfig, extra_callbacks: Sequence[Callback] = ()) -> Run:
    """Build the run, resume it if asked, fit, and write model.safetensors and summary.json (rank 0)."""
    run_dir = Path(cfg.run_dir)
    run = build(cfg)
    run.callbacks += list(extra_callbacks)
    manifest = resume(run, cfg)
    if manifest is not None and manifest["stop_reason"] in FINISHED:
        if run.distributed.is_main:
            step, reason = manifest["step"], manifest["stop_reason"]
            print(f"resume: this run already finished at step {step} ({reason}); nothing to do", file=sys.stderr)
        run.stop_reason = manifest["stop_reason"]
        return run
    if run.distributed.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it, unless train() is called from Python
        name = "run.json" if manifest is None else f"run-resumed-at-{manifest['step']}.json"
        write_json(run_dir / name, run_metadata(str(run.device), run.world_size))
    started, summary = time.perf_counter(), None
    try:
        with _preemptible(run):
            for logger in run.loggers:
                logger.start(run_info(run, cfg))
            fit(run)
        summary = summarize(run, time.perf_counter() - started)
    except KeyboardInterrupt:
        run.stop_reason = "interrupted"
        summary = summarize(run, time.perf_counter() - started)
    finally:
        weights = model_weights(run) if summary is not None else None  # collective under FSDP: every rank
        if summary is not None and run.distributed.is_main:
            save_weights(weights, run_dir / "model.safetensors")
            write_json(run_dir / "summary.json", summary)
        for logger in run.loggers:
            logger.close(summary)
        run.distributed.close()
    return run


def _fail(error: Exception, code: int) -> None:
    # Every rank says why it stops (a missing file may be missing on one node only), each naming itself.
    rank = environment()["rank"]
    print(f"error{f' on rank {rank}' if rank else ''}: {error}", file=sys.stderr)
    sys.exit(code)


def _record_failure(cfg: DictConfig, error: BaseException, wall_time_s: float) -> None:
    # A sweep job's row in results.csv and `runner.report` say why it failed (a single run says so on the console
    # and leaves no summary.json, like any run that never finished). A summary.json already there (a finished
    # or preempted launch that this one failed to resume) is kept: nothing it says is lost.
    path = Path(cfg.run_dir) / "summary.json"
    if environment()["rank"] == 0 and path.parent.is_dir() and not path.exists():
        error_text = str(error) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
        write_json(path, {"stop_reason": "failed", "error": error_text, "wall_time_s": wall_time_s})


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train one run; return the best value of `monitor` so that sweepers can optimize it (see runner.sweep)."""
    hydra_cfg = HydraConfig.get()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    threads = threads_per_job(cfg.get("threads"), parallel_jobs(hydra_cfg.launcher) if in_sweep else 1)
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        run = train(cfg)
    except Exception as error:
        if sweep_job() is not None:  # the job's row in results.csv says why (under torchrun too)
            _record_failure(cfg, error, time.perf_counter() - started)
        if in_sweep:  # one failed job must not end the sweep (fail_fast: SweepResults stops it)
            if not isinstance(error, ConfigError):
                traceback.print_exc()
            print(f"error: job {hydra_cfg.job.num} failed: {error}", file=sys.stderr)
            return objective("failed", None, cfg.mode)
        if isinstance(error, ConfigError):
            _fail(error, 2)
        raise
    if run.stop_reason == "nonfinite":
        message = RuntimeError(
            f"stopped after {run.max_nonfinite_steps} optimizer steps in a row with a non-finite loss "
            "or gradient norm (trainer.max_nonfinite_steps). Lower the learning rate, enable "
            "trainer.gradient_clip_val, or check the data for NaN/inf."
        )
        if not in_sweep:  # in a sweep, one diverged trial must not end the others
            _fail(message, EXIT_CODES["nonfinite"])
        print(f"error: {message}", file=sys.stderr)
    elif run.stop_reason in (*RESUMABLE, "interrupted"):
        if run.stop_reason in RESUMABLE and run.distributed.is_main:
            print(
                f"stopped ({run.stop_reason}) at step {run.progress.step}: continue with resume=auto "
                f"hydra.run.dir={cfg.run_dir}",
                file=sys.stderr,
            )
        sys.exit(EXIT_CODES[run.stop_reason])
    return objective(run.stop_reason, run.best.value, cfg.mode)


def cli() -> None:
    """The command: under torchrun or SLURM, join the process group first and agree on one run folder."""
    from runner.distributed import exit_without_teardown, restart_count, shared_launch_time

    try:
        _launch["time"] = shared_launch_time()
    except ConfigError as error:  # a launch that cannot form its process group (no rendezvous address, say)
        _fail(error, 2)
    rank = environment()["rank"]
    if restart_count() > 0:
        # torchrun --max-restarts restarted the workers after a failure: go on from the run's newest checkpoint
        # (the launch time, hence the run folder, is the first launch's).
        sys.argv = [a for a in sys.argv if not a.startswith(("resume=", "+resume=", "++resume="))] + ["resume=auto"]
        if rank == 0:
            print(f"elastic restart {restart_count()}: resuming from the newest checkpoint", file=sys.stderr)
    if rank > 0:
        # Rank 0 owns the filesystem: the other ranks write no .hydra/ and no runner.log.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    if environment()["world_size"] == 1:
        main()
        return
    try:
        main()
    except SystemExit as stop:
        exit_without_teardown(stop.code)
    exit_without_teardown(0)


if __name__ == "__main__":
    cli()
