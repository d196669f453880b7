"""`python -m runner.report RUN_DIR` on one finished run, in-process: every metric it logged in one figure. Sweeps,
running ones and the errors: tests/e2e/test_report.py and tests/unit/test_run_file_errors.py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import jsonl

from runner.tools.report import main
from runner.train import train

# digits for 6 optimizer steps: a log row every step, a validation every 3
TINY = ["+experiment=digits", "trainer.max_duration=6st", "trainer.val_interval=3st", "trainer.log_interval=1st"]
TINY += ["logger=jsonl", "checkpoint=none", "callbacks=none"]


@pytest.fixture
def finished_run(compose_cfg: Callable, tmp_path: Path) -> Path:
    train(compose_cfg(*TINY))
    return tmp_path / "run"


def test_one_run_draws_every_metric_it_logged_in_one_figure(finished_run: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert main([str(finished_run)]) == 0
    path = finished_run / "plots" / "curves.png"
    # one panel per metric: train/X and val/X share theirs (loss, acc), the others have their own
    logged = {key for row in jsonl(finished_run) for key in row if "/" in key}
    panels = {key.split("/", 1)[1] if key.startswith(("train/", "val/")) else key for key in logged}
    assert {"train/loss", "val/loss", "val/acc"} <= logged and len(panels) < len(logged)
    assert f"curves: {path} ({len(panels)} metrics)" in capsys.readouterr().out
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and path.stat().st_size > 10_000
    assert not (finished_run / "plots" / "val_loss.png").exists()  # one figure, not one per metric


def test_without_matplotlib_one_run_still_gets_its_table_and_csv(
    finished_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main([str(finished_run)]) == 0
    assert "plots skipped: matplotlib is not installed (pip install 'runner[report]')" in capsys.readouterr().err
    assert (finished_run / "results.csv").is_file() and not (finished_run / "plots").exists()
