"""Kill trials of distributed checkpoints (checkpoint.format=dcp, 2 gloo ranks under FSDP): the whole torchrun job
SIGKILLed while an async save is in flight, and a full disk on rank 1 alone during a save. Each leaves the previous
checkpoint whole and nothing half-visible, and resume=auto continues from it to the uninterrupted run's weights.
(A single rank killed mid-save: tests/e2e/test_dcp_ranks.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import (
    DIGITS_DDP,
    TORCHRUN,
    assert_same_weights,
    child_env,
    error_lines,
    explain,
    ok,
    python,
    summary,
    worker_exit_codes,
)

# 20 steps of 2 x 16 samples, a checkpoint every 10, all kept
FSDP = [*DIGITS_DDP, "distributed=fsdp", "data.batch_size=16", "trainer.max_duration=20st"]
FSDP += ["checkpoint.interval=10st", "checkpoint.keep_last=10"]
HOLD = ["checkpoint._target_=_dcp_ranks.HoldSeal", "+checkpoint.hold_folder=step-00000020", "checkpoint.async=true"]
FULL = ["+callbacks.full._target_=_dcp_ranks.FullDiskOnRank", "+callbacks.full.step=12", "+callbacks.full.rank=1"]


def ranks(root: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    return python(*TORCHRUN, "-m", "runner", *overrides, f"hydra.run.dir={root / name}", cwd=root)


def _staged(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name != "last")


def launcher_killed(root: Path) -> dict[str, Any]:
    """The job (launcher and both workers) SIGKILLed while both ranks' async save of step 20 is in flight; resumed."""
    folder = root / "killed"
    args = [sys.executable, *TORCHRUN, "-m", "runner", *FSDP, *HOLD, f"hydra.run.dir={folder}"]
    job = subprocess.Popen(args, cwd=root, env=child_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not all((folder / f"held-rank-{r}").exists() for r in range(2)):
            assert job.poll() is None, f"exited ({job.returncode}) before the save:\n{job.communicate()[1][-3000:]}"
            time.sleep(0.2)
        # torchrun starts each worker in a session of its own: the launcher's group, then each worker's
        workers = [int(pid) for pid in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
        for group in [job.pid, *workers]:
            os.killpg(group, signal.SIGKILL)
    finally:
        job.kill()
        job.communicate()
    left = _staged(folder)
    return {"rc": job.returncode, "left": left, "resumed": ranks(root, "killed", *FSDP, "resume=auto"), "dir": folder}


def disk_full(root: Path) -> dict[str, Any]:
    """Rank 1's disk full from step 12 (a sync DCP save at step 20), then resumed with room again."""
    failed = ranks(root, "full", *FSDP, *FULL)
    stopped, left = summary(root / "full"), _staged(root / "full")
    resumed = ranks(root, "full", *FSDP, *FULL, "resume=auto")
    return {"failed": failed, "summary": stopped, "left": left, "resumed": resumed, "dir": root / "full"}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {
        "reference": lambda: ok(ranks(root, "reference", *FSDP)) and root / "reference",
        "launcher_killed": lambda: launcher_killed(root),
        "disk_full": lambda: disk_full(root),
    }


def _resumed_from_step_10(outcome: dict[str, Any], reference: Path) -> None:
    resumed = ok(outcome["resumed"])
    assert resumed.stderr.count("resuming from") == 1 and "step-00000010" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_weights(outcome["dir"], reference)
    assert not [n for n in _staged(outcome["dir"]) if ".partial-" in n]  # the resume cleared the staging folder
    assert [n for n in _staged(outcome["dir"]) if n.startswith("step-")] == ["step-00000010", "step-00000020"]


def test_the_whole_job_killed_mid_async_save_leaves_the_previous_checkpoint_to_resume_from(
    runs: dict[str, Future],
) -> None:
    outcome = runs["launcher_killed"].result()
    assert outcome["rc"] != 0
    # step 20 was being written (its staging folder) and never became a checkpoint
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    assert [n for n in outcome["left"] if n.startswith(".step-00000020.partial-")], outcome["left"]
    _resumed_from_step_10(outcome, runs["reference"].result())


def test_a_full_disk_on_rank_1_alone_exits_2_with_one_paragraph_naming_its_file(runs: dict[str, Future]) -> None:
    outcome = runs["disk_full"].result()
    failed = outcome["failed"]
    assert failed.returncode != 0 and worker_exit_codes(failed.stderr) == [2, 2], explain(failed)
    errors = error_lines(failed.stderr)
    assert len(errors) == 2, failed.stderr[-4000:]
    for said in ("[rank0]:", "[rank1]:", "runner/__main__.py"):  # torchrun's own traceback only, no worker's
        assert said not in failed.stderr, failed.stderr[-4000:]
    assert "error: stopped because rank 1 stopped (exit 2; its message says why)" in errors, errors
    paragraph = next(e for e in errors if "disk full" in e)
    assert "step-00000020" in paragraph and "__1_0.distcp" in paragraph and "rank 1" in paragraph, paragraph
    assert "resume=auto" in paragraph, paragraph
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    assert outcome["summary"]["stop_reason"] == "failed"


def test_the_run_stopped_by_one_rank_s_full_disk_resumes_bit_exact(runs: dict[str, Future]) -> None:
    _resumed_from_step_10(runs["disk_full"].result(), runs["reference"].result())
