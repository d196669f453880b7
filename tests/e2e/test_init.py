"""`runner init DIR`: a project of your own (its package and conf/ beside runner's) that trains as it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env, cli, ok, python, read_json

pytestmark = pytest.mark.slow


def test_runner_init_makes_a_project_that_trains_from_its_own_folder(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    script = shutil.which("runner", path=str(Path(sys.executable).parent))  # the console script pip installed
    assert script, "the runner console script is not installed next to this Python"
    made = ok(
        subprocess.run(
            [script, "init", str(project), "--name", "mytask"],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    )
    assert "--config-dir conf +experiment=mytask" in made.stdout
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "conf/data/mytask.yaml",
        "conf/experiment/mytask.yaml",
        "conf/model/mytask.yaml",
        "mytask/__init__.py",
        "mytask/data.py",
        "mytask/model.py",
        "runner.yaml",
    ]
    # (again into the same folder: refused before anything is written, in tests/unit/test_tool_errors.py)
    # the project's own experiment, with runner's groups and options, from the project folder
    run = project / "run"
    ok(
        cli(
            "--config-dir",
            "conf",
            "+experiment=mytask",
            "trainer.max_duration=2ep",
            "model.hidden=32",
            cwd=project,
            run_dir=run,
        )
    )
    summary = read_json(run / "summary.json")
    assert summary["stop_reason"] == "max_duration" and summary["progress"]["step"] == 2 * 64
    assert summary["metrics"]["val/loss"] < 1.0, summary["metrics"]  # y's variance is about 3.5
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "_target_: mytask.model.Model" in config and "hidden: 32" in config
    # runner.tools.evaluate from the project folder builds mytask's classes: its runner.yaml trusts them (no
    # trusted_targets= on the command line; from elsewhere, refused: tests/unit/test_source_trust.py)
    evaluated = ok(python("-m", "runner.evaluate", str(run), "split=val", cwd=project))
    assert "val/loss" in evaluated.stdout
