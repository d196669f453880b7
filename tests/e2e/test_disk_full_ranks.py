"""A torchrun job whose one rank cannot read its data file at start-up stops with exit 2 on every rank
(runner.distributed.env's stop notes): only the refused rank prints its paragraph, the other one line, none a gloo
traceback, and the refused start leaves no run folder. torchrun's own exit code is 1 whenever a worker fails (torch's
ChildFailedError): what is sure is each worker's code in its failure table. A full disk on rank 0 during training is
test_distributed's."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import error_lines, explain, no_worker_traceback, torchrun, worker_exit_codes

LM = ["+experiment=lm", "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16"]
LM += ["logger=none", "callbacks=none", "checkpoint=none", "trainer.max_duration=2st", "distributed=ddp"]


def one_rank_refused(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Each rank reads data/<its rank>.jsonl: rank 0's is good, rank 1's has a broken line."""
    rows = [json.dumps({"text": f"def f{i}():\n    return {i}\n" * 8}) for i in range(40)]
    (root / "data").mkdir()
    (root / "data" / "0.jsonl").write_text("\n".join(rows) + "\n")
    (root / "data" / "1.jsonl").write_text("\n".join([*rows[:5], '{"text": "cut', *rows]) + "\n")
    data = f"data.dataset={root / 'data'}/${{oc.env:RANK}}.jsonl"
    folder = root / "refused"
    return torchrun(*LM, data, f"data.cache_dir={root / 'cache'}", f"hydra.run.dir={folder}", cwd=root), folder


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {"one_rank_refused": lambda: one_rank_refused(root)}


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
    no_worker_traceback(proc.stderr)
    assert not folder.exists()  # refused at start-up: no run folder (rank 0 removed it once rank 1 had logged)
    assert not [p for p in (folder.parent / "cache").iterdir() if ".partial-" in p.name]  # no scratch folder
