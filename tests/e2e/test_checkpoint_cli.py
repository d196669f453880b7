"""Checkpoints of the real CLI under fire: SIGKILL in the middle of a save, SIGTERM (a preemption) and resume=auto,
each equal in the end to a run that was never interrupted; a disk that fills up in the middle of a save. The
slowdowns are test callbacks (tests/_tasks.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    DIGITS_12,
    assert_same_weights,
    child_env,
    cli,
    metric_rows,
    ok,
    popen,
    summary,
    wait_for,
    with_run_dir,
)

from runner.ckpt.files import checkpoints, load_checkpoint
from runner.rundir import staged_in
from runner.train import train

# digits with a checkpoint every 10 steps
ARGS = [
    "+experiment=digits",
    "trainer.max_duration=60st",
    "trainer.val_interval=10st",
    "logger=jsonl",
    "checkpoint.interval=10st",
]
# The checkpoint callback whose writer stalls in the middle of writing step 20 (tests/_tasks.py). The resumed launch
# names the same class, without the stall: callback states are restored by position and class.
SLOW_CHECKPOINT = ["checkpoint._target_=_tasks.SlowCheckpoint"]
STALL_AT_20 = ["+checkpoint.slow_folder=step-00000020", "+checkpoint.seconds=60"]
# 50 ms after every optimizer step: the run is still training when the test signals it
SLOW_STEPS = ["+callbacks.slow._target_=_tasks.SleepEachStep", "+callbacks.slow.seconds=0.05"]


def launch(run_dir: Path, *overrides: str):
    """The CLI on ARGS in the background."""
    return popen("-m", "runner", *with_run_dir([*ARGS, *overrides], run_dir), cwd=run_dir.parent)


def uninterrupted(run_dir: Path) -> Path:
    ok(cli(*ARGS, cwd=run_dir.parent, run_dir=run_dir))
    return run_dir


def killed_during_a_save(run_dir: Path) -> dict[str, Any]:
    """SIGKILL while the checkpoint of step 20 is being written, then resume=auto."""
    proc = launch(run_dir, *SLOW_CHECKPOINT, *STALL_AT_20)
    wait_for(proc, "checkpoints/.step-00000020.partial-*", run_dir)
    proc.kill()
    proc.wait()
    left = [p.name for p in checkpoints(run_dir / "checkpoints")]
    half_written = sorted(p.name.rpartition("-")[0] for p in staged_in(run_dir / "checkpoints"))
    resumed = cli(*ARGS, *SLOW_CHECKPOINT, "resume=auto", cwd=run_dir.parent, run_dir=run_dir)
    return {"left": left, "half_written": half_written, "resumed": resumed}


def preempted(run_dir: Path, signals: tuple[int, ...] = (signal.SIGTERM,), resume: bool = True) -> dict[str, Any]:
    """`signals` once the checkpoint of step 10 exists, then (with `resume`) resume=auto."""
    proc = launch(run_dir, *SLOW_STEPS)
    wait_for(proc, "checkpoints/step-00000010", run_dir)
    for sig in signals:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    stopped = {"code": proc.returncode, "err": err, "summary": summary(run_dir)}
    stopped["newest"] = checkpoints(run_dir / "checkpoints")[0].name
    if not resume:
        return {"stopped": stopped}
    # the same callbacks as the stopped launch: a resume refuses another config (test_resume_safety)
    resumed = cli(*ARGS, *SLOW_STEPS, "resume=auto", cwd=run_dir.parent, run_dir=run_dir)
    return {"stopped": stopped, "resumed": resumed}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs), each in <root>/<name>."""
    flows = {
        "uninterrupted": uninterrupted,
        "killed": killed_during_a_save,
        "preempted": preempted,
        "ctrl_c": lambda run_dir: preempted(run_dir, (signal.SIGINT,)),
        # its test reads only how the launch stopped
        "ctrl_c_twice": lambda run_dir: preempted(run_dir, (signal.SIGINT, signal.SIGINT), resume=False),
    }
    return {name: (lambda flow=flow, name=name: flow(root / name)) for name, flow in flows.items()}


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(runs: dict[str, Future]) -> None:
    reference, outcome = runs["uninterrupted"].result(), runs["killed"].result()
    run_dir = reference.parent / "killed"
    assert outcome["left"] == ["step-00000010"]  # step 20 never became a checkpoint
    assert outcome["half_written"] == [".step-00000020.partial"]  # but its folder was begun
    resumed = ok(outcome["resumed"])
    assert "resuming from" in resumed.stderr and "step-00000010" in resumed.stderr
    assert not staged_in(run_dir / "checkpoints")  # the half-written folder was cleaned up
    assert_same_weights(run_dir, reference)
    assert metric_rows(run_dir) == metric_rows(reference)


def test_a_second_ctrl_c_stops_at_once(runs: dict[str, Future]) -> None:
    stopped = runs["ctrl_c_twice"].result()["stopped"]
    assert stopped["code"] == 130, stopped["err"][-2000:]
    assert stopped["summary"]["stop_reason"] == "interrupted"
    assert "Traceback" not in stopped["err"]


@pytest.mark.parametrize(("flow", "code", "reason"), [("preempted", 75, "preempted"), ("ctrl_c", 130, "interrupted")])
def test_sigterm_or_ctrl_c_checkpoints_the_step_and_resumes(
    flow: str, code: int, reason: str, runs: dict[str, Future]
) -> None:
    reference, outcome = runs["uninterrupted"].result(), runs[flow].result()
    run_dir = reference.parent / flow
    stopped = outcome["stopped"]
    assert stopped["code"] == code, stopped["err"][-2000:]
    assert stopped["summary"]["stop_reason"] == reason and 10 <= stopped["summary"]["progress"]["step"] < 60
    assert stopped["newest"] == f"step-{stopped['summary']['progress']['step']:08d}"
    assert "resume=auto" in stopped["err"]
    ok(outcome["resumed"])
    assert summary(run_dir)["stop_reason"] == "max_duration"
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # the first launch's config is kept
    assert list((run_dir / ".hydra").glob("resume-*/overrides.yaml"))
    assert_same_weights(run_dir, reference)
    assert metric_rows(run_dir) == metric_rows(reference)


# Once the writes of step 8's checkpoint begin, every write through runner.rundir.files fails as on a full disk.
DISK_FULL = """
import errno, sys
import runner.rundir.files as rundir

full = []

class Full:
    def __init__(self, path, mode):
        self.file = open(path, mode)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.file.close()
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

def opener(path, mode="r", *args, **kwargs):
    if "w" in mode and (full or "step-00000008" in str(path)):
        full.append(path)
        return Full(path, mode)
    return open(path, mode, *args, **kwargs)

rundir.open = opener
from runner.__main__ import cli
sys.argv = ["runner", *sys.argv[1:]]
cli()
"""


def test_a_full_disk_during_a_checkpoint_stops_cleanly_and_resumes(compose_cfg: Callable, tmp_path: Path) -> None:
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(DISK_FULL))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(script), *DIGITS_12, "threads=1", f"hydra.run.dir={run_dir}"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert "Error executing job" not in done.stderr, done.stderr  # summary.json's own failed write said as a warning
    assert "disk full" in errors[0] and "step-00000008" in errors[0] and "resume=auto" in errors[0]
    leftovers = [p for p in run_dir.rglob("*") if p.name.endswith(".tmp") or ".partial-" in p.name]
    assert leftovers == []
    (kept,) = checkpoints(run_dir / "checkpoints")
    assert kept.name == "step-00000004" and load_checkpoint(kept)
    resumed = train(compose_cfg(*DIGITS_12, "resume=auto", run_dir=run_dir))  # space freed: on from step 4
    assert resumed.progress.step == 12
