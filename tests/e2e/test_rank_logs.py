"""logs/rank-K.log under torchrun (2 processes, gloo): rank 1 warns, or raises, after its third optimizer step
(tests/_tasks.py Misbehave); its file holds the warning or the traceback, and the console does not show its warning."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import DIGITS_DDP, explain, ok, torchrun

MISBEHAVE = [
    *DIGITS_DDP,
    "distributed=ddp",
    "trainer.max_duration=6st",
    "+callbacks.bad._target_=_tasks.Misbehave",
    "+callbacks.bad.step=3",
]


def _run(root: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    return torchrun(*MISBEHAVE, *extra, f"hydra.run.dir={root / name}", cwd=root), root / name


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {
        "warned": lambda: _run(root, "warned"),
        "raised": lambda: _run(root, "raised", "+callbacks.bad.raise_error=true"),
    }


def test_rank_1_s_warnings_are_in_its_log_and_not_on_the_console(runs: dict[str, Future]) -> None:
    done, run_dir = runs["warned"].result()
    ok(done)
    text = (run_dir / "logs" / "rank-1.log").read_text()
    assert "UserWarning: a warning from rank 1" in text and "a logged warning from rank 1" in text
    assert "rank 1" not in done.stdout + done.stderr, explain(done)  # the console: rank 0's, and torchrun's
    assert "rank 1" not in (run_dir / "runner.log").read_text()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) in (["rank-1.log"], ["rank-0.log", "rank-1.log"])


def test_rank_1_s_exception_and_its_traceback_are_in_its_log(runs: dict[str, Future]) -> None:
    done, run_dir = runs["raised"].result()
    assert done.returncode != 0, explain(done)
    text = (run_dir / "logs" / "rank-1.log").read_text()
    assert "the run failed: RuntimeError: misbehaving on rank 1 at step 3" in text
    assert "Traceback (most recent call last)" in text and "in on_optimizer_step" in text
    assert "a warning from rank 1" not in text  # raised instead of warning
