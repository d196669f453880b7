"""Host reads on two ranks (torchrun, gloo): a step that neither logs, validates, checkpoints nor checks for a stop
makes none, under DDP and FSDP, in fp32, bf16 and fp16 (tests/unit/test_host_reads.py: one process). The DDP fp32 run
also has rank 1 warn after the counted steps (tests/_tasks.py Misbehave): logs/rank-1.log holds its warnings, the
console does not (test_rank_logs: a rank's exception)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import DIGITS_DDP, explain, ok, torchrun

# Steps 3..10 are counted: logging, validation and the stop check fall on step 12 (checkpoints: none).
COUNTED = [
    *DIGITS_DDP,
    "optimizer.fused=true",
    "data.batch_size=16",
    "trainer.max_duration=12st",
    "trainer.log_interval=12st",
    "trainer.val_interval=12st",
    "trainer.stop_check_interval=12st",
    "checkpoint=none",
    "+callbacks.reads._target_=_tasks.CountHostReads",
    "+callbacks.reads.first=2",
    "+callbacks.reads.last=10",
]
# rank 1 warns (warnings.warn and logging) after step 11, past the counted steps: what they count is training alone
RANK_1_WARNS = ["+callbacks.bad._target_=_tasks.Misbehave", "+callbacks.bad.step=11"]
CASES = {
    "ddp-fp32-clip": ["distributed=ddp", "trainer.gradient_clip_val=0.5", *RANK_1_WARNS],
    "ddp-fp16-accumulate": ["distributed=ddp", "precision=fp16", "trainer.accumulate_grad_batches=2"],
    "fsdp-bf16": ["distributed=fsdp", "precision=bf16"],
}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], dict[str, Any]]]:
    """One 2-rank run per case: the launch, its folder and each rank's reads on the counted steps."""

    def job(name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            folder = root / name
            done = ok(torchrun(*COUNTED, *CASES[name], f"hydra.run.dir={folder}", cwd=root))
            reads = [json.loads((folder / f"host-reads-rank{rank}.json").read_text()) for rank in (0, 1)]
            return {"done": done, "run_dir": folder, "reads": reads}

        return run

    return {name: job(name) for name in CASES}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_make_no_host_read_on_a_step_that_does_not_log(runs: dict[str, Future], case: str) -> None:
    assert runs[case].result()["reads"] == [[], []]


def test_rank_1_s_warnings_are_in_its_log_and_not_on_the_console(runs: dict[str, Future]) -> None:
    outcome = runs["ddp-fp32-clip"].result()  # the case with RANK_1_WARNS
    done, run_dir = ok(outcome["done"]), outcome["run_dir"]
    text = (run_dir / "logs" / "rank-1.log").read_text()
    assert "UserWarning: a warning from rank 1" in text and "a logged warning from rank 1" in text
    assert "rank 1" not in done.stdout + done.stderr, explain(done)  # the console: rank 0's, and torchrun's
    assert "rank 1" not in (run_dir / "runner.log").read_text()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) in (["rank-1.log"], ["rank-0.log", "rank-1.log"])
