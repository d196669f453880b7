"""train(cfg): build the run, resume it, fit, write model.safetensors and summary.json, close. The library entry."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner import collector_paused
from runner.build import build
from runner.ckpt.callback import Checkpoint
from runner.ckpt.dcp import open_checkpoint
from runner.ckpt.files import newest_valid
from runner.ckpt.state import restore
from runner.ckpt.stream import save_final_weights
from runner.log.info import run_info, run_metadata
from runner.loop import fit
from runner.run import Callback, Run, StopReason
from runner.rundir import CHECKPOINTS, CONFIG, MODEL, RUN_INFO, SUMMARY, set_aside, write_atomic, write_json
from runner.short_run import short_run
from runner.sweeps.job import SweepJob
from runner.timeline import TIMELINE, TRAINING, phase


def summarize(run: Run, samples_at_start: int = 0, tokens_at_start: int = 0) -> dict[str, Any]:
    """What summary.json holds. Wall time and rate are this launch's (a resumed launch trained only its own samples);
    total_wall_time_s adds the earlier launches' training time."""
    p, best = run.progress, run.state.best
    wall_time_s = run.state.clock.launch_s()
    return {
        "stop_reason": None if run.stop_reason is None else run.stop_reason.value,  # a plain string for every reader
        "progress": {k: getattr(p, k) for k in ("step", "micro_batch", "epoch", "samples", "tokens")},
        "metrics": run.state.metrics,
        "best": {"monitor": run.settings.monitor, "value": best.value, "step": best.step}
        if best.value is not None
        else None,
        "nonfinite_steps": run.state.nonfinite_steps,
        "wall_time_s": wall_time_s,
        "total_wall_time_s": run.state.clock.total_s(),
        # the whole launch's average: startup, compiling, validation and checkpoints included
        "samples_per_s": (p.samples - samples_at_start) / wall_time_s if wall_time_s > 0 else 0.0,
        "tokens_per_s": (p.tokens - tokens_at_start) / wall_time_s if wall_time_s > 0 and p.tokens else None,
        # training alone, after the warm-up: samples_per_s, tokens_per_s (+ _per_device) and mfu, as far as known
        "steady": run.state.meter.steady_throughput(),
        # the first optimizer step's wall time, compiling included (compile is lazy); null when nothing is compiled
        "compile_time_s": run.state.meter.first_step_s if run.settings.compiled else None,
        # the monitored metric still improving at the end of a run that trained its whole max_duration; else null
        "short_run": short_run(run),
        # what the task reads in its final metrics (an SAE whose latents never fired): lines said under the table
        "advice": list(getattr(run.task, "advice", lambda _: [])(run.state.metrics)),
    }


def resume(run: Run, cfg: DictConfig) -> dict[str, Any] | None:
    """Restore the checkpoint that `cfg.resume` names ('auto': the newest valid one of this run); its manifest.

    'scratch': train again from step 0 in this run folder, its earlier outputs moved aside first (nothing deleted);
    the way on when resume=auto refuses a run whose checkpoints all fail verification.
    """
    where = cfg.get("resume")
    if where is None:
        return None
    say = print if run.strategy.is_main else lambda *a, **k: None
    saver = next((cb for cb in run.callbacks if isinstance(cb, Checkpoint)), None)
    directory = saver.dir if saver is not None else Path(cfg.run_dir) / CHECKPOINTS
    if where == "scratch":
        aside = set_aside(cfg.run_dir, directory) if run.strategy.is_main else None
        run.strategy.barrier()  # no rank looks at the folder while rank 0 empties it
        say(
            f"resume=scratch: training from step 0{f'; the earlier files are in {aside}' if aside else ''}",
            file=sys.stderr,
        )
        return None
    if where == "auto":
        # refuses a folder of checkpoints none of which verifies; a distributed one is checked and read collectively
        found = newest_valid(directory, load=lambda folder: open_checkpoint(folder, run.strategy))
        if found is None:
            say(f"resume=auto: no checkpoint in {directory}; starting from scratch", file=sys.stderr)
            return None
        folder, contents = found
    else:
        folder, contents = Path(where), open_checkpoint(where, run.strategy)
    manifest = restore(run, contents, allow_changes=cfg.get("resume_allow_changes", False))
    say(f"resuming from {folder} (step {manifest['step']})", file=sys.stderr)
    for key, (old, new) in manifest["config_changes"].items():
        say(f"resume_allow_changes: {key} changed from {old!r} to {new!r}", file=sys.stderr)
    return manifest


@contextlib.contextmanager
def _preemptible(run: Run) -> Iterator[None]:
    # SIGTERM and SIGUSR1 (what SLURM sends before a time limit): finish the current optimizer step, save a
    # checkpoint (the checkpoint callback saves whenever a run stops), write the summary, exit 75. The first Ctrl-C
    # does the same with exit 130; a second one raises KeyboardInterrupt at once.
    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)
            run.request_stop(StopReason.INTERRUPTED)
            return
        print(f"received {signal.Signals(signum).name}: stopping after this step", file=sys.stderr)
        run.request_stop(StopReason.PREEMPTED)

    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def train(cfg: DictConfig, extra_callbacks: Sequence[Callback] = (), sweep: SweepJob | None = None) -> Run:
    """Build the run, resume it if asked, fit, and write model.safetensors and summary.json (rank 0); a task made of
    several models (`parts`) also gets one model.<name>.safetensors each.

    `sweep`: the job of a sweep this run is (its loggers name and group it so), or None.
    """
    run_dir = Path(cfg.run_dir)
    TIMELINE.begin()
    with phase("build"), collector_paused():  # the first optimizer imports torch._dynamo: most of a run's start
        run = build(cfg)
    run.callbacks += list(extra_callbacks)
    with phase("resume"):
        manifest = resume(run, cfg)
    if manifest is not None and manifest["stop_reason"] is not None and StopReason(manifest["stop_reason"]).finished:
        _finish_again(run, manifest)
    if run.strategy.is_main:
        _write_run_info(run, cfg, run_dir, manifest)
    samples_at_start, tokens_at_start, summary = run.progress.samples, run.progress.tokens, None
    run.state.clock.start()
    try:
        with _preemptible(run):
            with phase("loggers"):
                for logger in run.loggers:
                    logger.start(run_info(run, cfg, sweep))
            with phase(TRAINING):
                fit(run)
        summary = summarize(run, samples_at_start, tokens_at_start)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, with the summary of what was trained
        run.stop_reason = StopReason.INTERRUPTED
        summary = summarize(run, samples_at_start, tokens_at_start)
    finally:
        for saver in (cb for cb in run.callbacks if isinstance(cb, Checkpoint)):
            # a run that raised between two saves keeps the one still writing: the next launch, in this process too,
            # resumes from it rather than finding it half-written and clearing it away
            saver.wait()
        if summary is not None:
            _write_outputs(run, run_dir, summary)
        for logger in run.loggers:
            logger.close(summary)
        if summary is not None:
            # A rank that exits first with a failure code (a diverged run exits 3) has torchrun stop the others at
            # once: every rank waits here until rank 0 has written the run's outputs.
            run.strategy.barrier()
        run.strategy.close()
    return run


def _finish_again(run: Run, manifest: dict[str, Any]) -> None:
    # A kill after the final checkpoint may have cost the final outputs: fit() trains no step but ends the run
    # again from the checkpoint (restore_best, EMA, the final evaluation), and the outputs are written as then.
    if run.strategy.is_main:
        step, reason = manifest["step"], manifest["stop_reason"]
        print(
            f"resume: this run already finished at step {step} ({reason}); writing its final outputs "
            f"({MODEL}, {SUMMARY}) from that checkpoint again",
            file=sys.stderr,
        )
    run.stop_reason = StopReason(manifest["stop_reason"])


def _write_run_info(run: Run, cfg: DictConfig, run_dir: Path, manifest: dict[str, Any] | None) -> None:
    # The run's config where Hydra did not write it, and run.json (run-resumed-at-N.json for a resumed launch)
    run_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it, unless train() is called from Python
    if not (run_dir / CONFIG).exists():
        # run_dir=X moves the run away from Hydra's output folder, which keeps .hydra/: the run folder must hold
        # its config anyway (a finished run is an SAE's source.checkpoint, read from there)
        (run_dir / CONFIG).parent.mkdir(exist_ok=True)
        write_atomic(run_dir / CONFIG, OmegaConf.to_yaml(cfg).encode())
    info = run_metadata(str(run.device), run.world_size)
    if run.settings.data_info:
        info["data"] = run.settings.data_info
    if manifest is not None:
        info["config_changes"] = manifest["config_changes"]  # resume_allow_changes: what differs, honestly
    write_json(run_dir / (RUN_INFO if manifest is None else f"run-resumed-at-{manifest['step']}.json"), info)


def _write_outputs(run: Run, run_dir: Path, summary: dict[str, Any]) -> None:
    # The weights are gathered tensor by tensor on every rank (a collective under FSDP) while rank 0 streams each into
    # the files; rank 0 writes summary.json.
    with phase("final save"):
        save_final_weights(run, run_dir)
    summary["startup"] = TIMELINE.table()
    if run.strategy.is_main:
        write_json(run_dir / SUMMARY, summary)
