"""benchmarks/suite_cost.py: each process's line at exit (os._exit too), and the grouping by kind and test folder."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

spec = importlib.util.spec_from_file_location("suite_cost", ROOT / "benchmarks" / "suite_cost.py")
suite_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_cost)

VENV = "/venv/lib/python3.11/site-packages"


def test_a_process_writes_its_line_at_exit_and_in_os_exit(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(suite_cost.HOOK)
    log = tmp_path / "processes.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RUNNER_SUITE_COST": str(log)}
    for code in ("sum(range(10**6))", "import os; os._exit(3)"):
        subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=False)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 2 and all(row[0] > 0 and row[3] == str(tmp_path) for row in rows)
    assert [row[4] for row in rows] == [["-c"], ["-c"]]


def test_processes_are_counted_by_kind_and_by_the_test_folder_they_or_their_parents_ran_in() -> None:
    job = "/tmp/pytest-of-me/pytest-7/hsdp0/run"
    rows = [
        [3.0, 1, 0, "/repo", [f"{VENV}/pytest/__main__.py", "tests/e2e"]],
        [1.5, 2, 1, job, [f"{VENV}/torch/distributed/run.py", "--standalone", "-m", "runner"]],
        [2.0, 3, 2, job, ["/repo/runner/__main__.py", "+experiment=digits"]],
        [2.5, 4, 2, job, ["/repo/runner/__main__.py", "+experiment=digits"]],
        [0.5, 5, 4, "/", ["-c"]],  # a loader worker elsewhere: its rank's folder counts it
        [4.0, 6, 1, "/tmp/pytest-of-me/pytest-7/benchmarks0/ddp", ["/repo/benchmarks/ddp.py", "--smoke"]],
    ]
    result = suite_cost.summarise(rows, top=10)
    assert (result["processes"], result["cpu_s"], result["median_process_cpu_s"]) == (6, 13.5, 2.5)
    assert result["kind"] == {
        "benchmarks/ddp.py": {"cpu_s": 4.0, "processes": 1},
        "runner": {"cpu_s": 4.5, "processes": 2},
        "pytest": {"cpu_s": 3.0, "processes": 1},
        "torchrun launcher": {"cpu_s": 1.5, "processes": 1},
        "python -c": {"cpu_s": 0.5, "processes": 1},
    }
    assert list(result["kind"]) == ["runner", "benchmarks/ddp.py", "pytest", "torchrun launcher", "python -c"]
    assert result["folder"] == {
        "hsdp": {"cpu_s": 6.5, "processes": 4},
        "benchmarks": {"cpu_s": 4.0, "processes": 1},
        "(outside a test folder)": {"cpu_s": 3.0, "processes": 1},
    }
