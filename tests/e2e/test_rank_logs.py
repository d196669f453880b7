"""logs/rank-K.log under torchrun (2 processes, gloo): rank 1 raises after its third optimizer step (tests/_tasks.py
Misbehave); its file holds the exception and its traceback. A rank's warnings: test_host_reads, whose DDP fp32 run has
rank 1 warn."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import DIGITS_DDP, explain, torchrun

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
    return {"raised": lambda: _run(root, "raised", "+callbacks.bad.raise_error=true")}


def test_rank_1_s_exception_and_its_traceback_are_in_its_log(runs: dict[str, Future]) -> None:
    done, run_dir = runs["raised"].result()
    assert done.returncode != 0, explain(done)
    text = (run_dir / "logs" / "rank-1.log").read_text()
    assert "the run failed: RuntimeError: misbehaving on rank 1 at step 3" in text
    assert "Traceback (most recent call last)" in text and "in on_optimizer_step" in text
    assert "a warning from rank 1" not in text  # raised instead of warning
