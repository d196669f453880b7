"""A torchrun job whose one rank is refused stops with exit 2 on every rank (runner.distributed.env's stop notes): a
full disk on rank 0 during training (tests/_tasks.FullDiskFrom), a data file that rank 1 alone cannot read at start-up.
Only the refused rank prints its paragraph, the other one line, none a gloo traceback; the full disk resumes
bit-exact, the refused start leaves no run folder. torchrun's own exit code is 1 whenever a worker fails (torch's
ChildFailedError): what is sure is each worker's code in its failure table."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import (
    DIGITS_DDP,
    assert_same_weights,
    error_lines,
    explain,
    metric_rows,
    ok,
    summary,
    torchrun,
    worker_exit_codes,
)

# 20 steps of 2 x 16 samples with checkpoints at steps 10 and 20; rank 0's disk fills after step 12
CHECKPOINTED = [*DIGITS_DDP, "distributed=ddp", "data.batch_size=16", "trainer.max_duration=20st"]
CHECKPOINTED += ["checkpoint.interval=10st"]
FULL = ["+callbacks.full._target_=_tasks.FullDiskFrom", "+callbacks.full.step=12"]
LM = ["+experiment=lm", "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16"]
LM += ["logger=none", "callbacks=none", "checkpoint=none", "trainer.max_duration=2st", "distributed=ddp"]


def full_disk(root: Path) -> dict[str, Any]:
    """The full disk, then (room again) resume=auto."""
    folder = root / "full"
    failed = torchrun(*CHECKPOINTED, *FULL, f"hydra.run.dir={folder}", cwd=root)
    stopped = summary(folder)
    resumed = torchrun(*CHECKPOINTED, *FULL, f"hydra.run.dir={folder}", "resume=auto", cwd=root)
    return {"failed": failed, "summary": stopped, "resumed": resumed, "run_dir": folder}


def one_rank_refused(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Each rank reads data/<its rank>.jsonl: rank 0's is good, rank 1's has a broken line."""
    rows = [json.dumps({"text": f"def f{i}():\n    return {i}\n" * 8}) for i in range(40)]
    (root / "data").mkdir()
    (root / "data" / "0.jsonl").write_text("\n".join(rows) + "\n")
    (root / "data" / "1.jsonl").write_text("\n".join([*rows[:5], '{"text": "cut', *rows]) + "\n")
    data = f"data.dataset={root / 'data'}/${{oc.env:RANK}}.jsonl"
    folder = root / "refused"
    return torchrun(*LM, data, f"data.cache_dir={root / 'cache'}", f"hydra.run.dir={folder}", cwd=root), folder


def reference(root: Path) -> Path:
    """The same job with room on every disk."""
    ok(torchrun(*CHECKPOINTED, f"hydra.run.dir={root / 'reference'}", cwd=root))
    return root / "reference"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {
        "full_disk": lambda: full_disk(root),
        "reference": lambda: reference(root),
        "one_rank_refused": lambda: one_rank_refused(root),
    }


def _no_worker_traceback(stderr: str) -> None:
    # torchrun prints a traceback of its own (ChildFailedError); no worker may
    for said in ("Connection closed by peer", "third_party/gloo", "Error executing job", "runner/__main__.py"):
        assert said not in stderr, stderr[-4000:]


def test_a_full_disk_on_rank_0_exits_2_on_every_rank_with_one_paragraph(runs: dict[str, Future]) -> None:
    failed = runs["full_disk"].result()["failed"]
    assert failed.returncode != 0 and worker_exit_codes(failed.stderr) == [2, 2], explain(failed)
    errors = error_lines(failed.stderr)
    assert len(errors) == 2, failed.stderr[-4000:]
    paragraph, line = sorted(errors, reverse=True)  # "error:" sorts after "error on"
    assert paragraph.startswith("error: disk full: saving checkpoint ") and "step-00000020" in paragraph, paragraph
    assert "resume=auto" in paragraph
    assert line == "error on rank 1: stopped because rank 0 stopped (exit 2; its message says why)", line
    _no_worker_traceback(failed.stderr)
    stopped = runs["full_disk"].result()["summary"]
    assert stopped["stop_reason"] == "failed" and stopped["error"].startswith("disk full: saving checkpoint")


def test_the_run_stopped_by_a_full_disk_resumes_bit_exact(runs: dict[str, Future]) -> None:
    outcome = runs["full_disk"].result()
    resumed = ok(outcome["resumed"])
    assert resumed.stderr.count("resuming from") == 1 and "(step 10)" in resumed.stderr, resumed.stderr[-3000:]
    reference = runs["reference"].result()
    assert_same_weights(outcome["run_dir"], reference)
    assert metric_rows(outcome["run_dir"]) == metric_rows(reference)


def test_a_file_one_rank_alone_cannot_read_stops_every_rank_with_exit_2_and_no_folder(
    runs: dict[str, Future],
) -> None:
    proc, folder = runs["one_rank_refused"].result()
    assert proc.returncode != 0 and worker_exit_codes(proc.stderr) == [2, 2], explain(proc)
    errors = sorted(error_lines(proc.stderr))
    assert len(errors) == 2, proc.stderr[-4000:]
    assert errors[0] == "error on rank 1: " + errors[0].split(": ", 1)[1]  # rank 1's own paragraph
    assert "1.jsonl line 6 is not JSON" in errors[0] and "one JSON object" in errors[0], errors[0]
    assert errors[1] == "error: stopped because rank 1 stopped (exit 2; its message says why)", errors[1]
    _no_worker_traceback(proc.stderr)
    assert not folder.exists()  # refused at start-up: no run folder (rank 0 removed it once rank 1 had logged)
    assert not [p for p in (folder.parent / "cache").iterdir() if ".partial-" in p.name]  # no scratch folder
