"""The debug group through the real command: `debug=NAME` anywhere on the command line wins over the experiment's
durations (the command appends it after +experiment), and a debug run writes no checkpoints and no metrics.jsonl."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import cli, ok, summary


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {
        "sae_fast": lambda: (ok(cli("+experiment=sae", "debug=fast", cwd=root, run_dir=root / "sae")), root / "sae"),
        "digits_limit": lambda: (
            ok(cli("debug=limit", "+experiment=digits", cwd=root, run_dir=root / "d")),
            root / "d",
        ),
    }


def test_sae_debug_fast_runs_four_steps_without_checkpoints_or_metrics_file(runs: dict[str, Future]) -> None:
    _, run_dir = runs["sae_fast"].result()
    s = summary(run_dir)
    assert s["stop_reason"] == "max_duration" and s["progress"]["step"] == 4  # not the preset's 1500
    assert "val/fve" in s["metrics"]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_debug_before_the_experiment_on_the_command_line_still_wins(runs: dict[str, Future]) -> None:
    _, run_dir = runs["digits_limit"].result()
    progress = summary(run_dir)["progress"]
    assert (progress["epoch"], progress["step"]) == (3, 3 * 2)  # 3 epochs of 5% of 45 steps: not digits' 60 epochs
