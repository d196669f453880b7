"""`python -m runner.report`: the leaderboard, results.csv and PNG curves of a finished sweep, a running one, a run."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import cli, explain, python, read_json, results_csv

from runner.tools.report import PLOT_DPI, PLOT_SIZE, main

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=5st", "trainer.log_interval=5st"]


def finished_sweep(root: Path) -> Path:
    """A finished 2-job sweep (two learning rates), without the results.csv its callback wrote."""
    folder = root / "sweep"
    proc = cli("-m", *TINY, "logger=jsonl", "optimizer.lr=1e-3,3e-2", f"hydra.sweep.dir={folder}", cwd=root)
    assert proc.returncode == 0, explain(proc)
    (folder / "results.csv").unlink()
    return folder


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs): the sweep, and the command on a folder that does not exist."""
    return {
        "sweep": lambda: finished_sweep(root),
        "missing": lambda: python("-m", "runner.report", str(root / "missing"), cwd=root),
    }


@pytest.fixture(scope="module")
def finished(runs: dict[str, Future]) -> Path:
    return runs["sweep"].result()


def image(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))[..., :3]  # RGB floats in [0, 1]


def has_colour(pixels: np.ndarray, hex_colour: str, at_least: int = 50) -> bool:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=-1) < 0.02).sum()) >= at_least


BLUE, ORANGE = "#1f77b4", "#ff7f0e"  # matplotlib's first two line colours: job 0's and job 1's curves


def test_a_finished_sweep_gets_its_leaderboard_csv_and_curves(finished: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert main([str(finished)]) == 0
    out = capsys.readouterr().out
    table = results_csv(finished / "results.csv")
    assert set(table) == {"0", "1"}
    for job, row in table.items():
        done = read_json(finished / job / "summary.json")
        assert row["status"] == "completed" and float(row["best"]) == done["best"]["value"]
        assert row["optimizer.lr"] == ["0.001", "0.03"][int(job)]
    # best first: the table's first row is the job with the lower best val/loss
    winner = min(table, key=lambda job: float(table[job]["best"]))
    first = next(line for line in out.splitlines() if line.startswith("│"))
    assert first.split("│")[1].strip() == winner
    for name in ("val_loss", "train_loss"):
        path = finished / "plots" / f"{name}.png"
        assert f"plot: {path} (2 job(s))" in out
        pixels = image(path)
        assert pixels.shape == (PLOT_SIZE[1] * PLOT_DPI, PLOT_SIZE[0] * PLOT_DPI, 3)
        assert (pixels.min(axis=-1) < 0.5).mean() > 0.005  # axes, ticks, text and lines were drawn
        assert has_colour(pixels, BLUE) and has_colour(pixels, ORANGE)  # one line per job


def test_sort_by_another_metric_and_top(finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main([str(finished), "--metric", "val/acc", "--mode", "max", "--top", "1", "--no-plot", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    table = results_csv(tmp_path / "results.csv")
    winner = max(table, key=lambda job: float(table[job]["val/acc"]))
    body = [line for line in out.splitlines() if line.startswith("│")]
    assert len(body) == 1 and body[0].split("│")[1].strip() == winner  # --top 1: the best job only
    assert "by val/acc (max)" in out and not (tmp_path / "plots").exists()


def test_a_sweep_still_running_is_reported(finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    live = tmp_path / "live"
    shutil.copytree(finished / "0", live / "0")
    shutil.copytree(finished / "1", live / "1")
    # job 1 is mid-run: no summary.json yet, and its metrics.jsonl ends in half a line being written
    (live / "1" / "summary.json").unlink()
    lines = (live / "1" / "metrics.jsonl").read_text().splitlines()
    (live / "1" / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    assert main([str(live), "--plot", "val/loss"]) == 0
    table = results_csv(live / "results.csv")
    assert table["0"]["status"] == "completed" and table["1"]["status"] == "running"
    seen = [json.loads(line) for line in lines[:2]]
    assert int(table["1"]["step"]) == seen[-1]["step"]
    assert float(table["1"]["best"]) == min(r["val/loss"] for r in seen if "val/loss" in r)
    assert has_colour(image(live / "plots" / "val_loss.png"), ORANGE)
    assert "running" in capsys.readouterr().out


def test_a_single_run_folder_is_a_one_row_report(finished: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert main([str(finished / "1"), "--plot", "val/acc"]) == 0
    assert list(results_csv(finished / "1" / "results.csv")) == ["1"]
    assert has_colour(image(finished / "1" / "plots" / "val_acc.png"), BLUE)


def test_without_matplotlib_the_table_and_csv_still_come(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main([str(finished), "--out", str(tmp_path)]) == 0
    assert "plots skipped: matplotlib is not installed (pip install 'runner[report]')" in capsys.readouterr().err
    assert (tmp_path / "results.csv").is_file() and not (tmp_path / "plots").exists()


def test_bad_input_exits_2_with_the_reason(finished: Path, runs: dict[str, Future], tmp_path: Path) -> None:
    proc = runs["missing"].result()
    missing = proc.args[-1]
    assert proc.returncode == 2 and f"error: {missing} is not a folder" in proc.stderr, explain(proc)
    assert main([str(tmp_path)]) == 2  # an empty folder: no runs
    assert main([str(finished), "--metric", "val/bogus", "--no-plot", "--out", str(tmp_path / "x")]) == 2
