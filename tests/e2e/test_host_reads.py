"""Host reads on two ranks (torchrun, gloo): a step that neither logs, validates, checkpoints nor checks for a stop
makes none, under DDP and FSDP, in fp32, bf16 and fp16 (tests/unit/test_host_reads.py: one process)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
from helpers import DIGITS_DDP, ok, torchrun

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
CASES = {
    "ddp-fp32-clip": ["distributed=ddp", "trainer.gradient_clip_val=0.5"],
    "ddp-fp16-accumulate": ["distributed=ddp", "precision=fp16", "trainer.accumulate_grad_batches=2"],
    "fsdp-bf16": ["distributed=fsdp", "precision=bf16"],
}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], list]]:
    """One 2-rank run per case: each rank's reads on the counted steps."""

    def job(name: str) -> Callable[[], list]:
        def run() -> list:
            folder = root / name
            ok(torchrun(*COUNTED, *CASES[name], f"hydra.run.dir={folder}", cwd=root))
            return [json.loads((folder / f"host-reads-rank{rank}.json").read_text()) for rank in (0, 1)]

        return run

    return {name: job(name) for name in CASES}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_make_no_host_read_on_a_step_that_does_not_log(runs: dict[str, Future], case: str) -> None:
    assert runs[case].result() == [[], []]
