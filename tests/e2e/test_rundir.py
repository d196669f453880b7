"""Run and sweep folders are never shared by accident: two launches in the same second get two folders, a second writer
into a folder in use is refused naming the holder's pid, a new run into a finished run's folder is refused without
touching it, and a second sweep on a sweep folder in use is refused."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import cli, explain, jsonl, popen, python, wait_for

_ROOT: list[Path] = []  # the folder of this module's runs (jobs)
TINY = ["+experiment=digits", "trainer.max_duration=20st", "logger=[console,jsonl]"]


def hold(root: Path, name: str) -> list[str]:
    """A run (or a sweep's first job) that waits after its first step until the test touches root/<name>.release,
    having touched root/<name>.held: still running when the second launch looks, for as long as that takes."""
    held, release = root / f"{name}.held", root / f"{name}.release"
    return [
        "+callbacks.hold._target_=_tasks.Hold",
        f"+callbacks.hold.held={held}",
        f"+callbacks.hold.release={release}",
    ]


# the default run folder's resolver on a fixed name: both launches race for the same folder as in the same second
FRESH = "hydra.run.dir='${runner_fresh:out/run,${resume}}'"


def same_second(root: Path) -> dict[str, Any]:
    """Two launches at once onto one dated folder name."""
    procs = [popen("-m", "runner", *TINY, FRESH, cwd=root) for _ in range(2)]
    return {"codes": [p.wait(timeout=300) for p in procs], "stderr": [p.stderr.read() for p in procs]}


def busy(root: Path) -> dict[str, Any]:
    """A resume=auto into a folder while another run writes there; then a new run into the finished folder."""
    run_dir = root / "busy"
    first = popen("-m", "runner", *TINY, *hold(root, "busy"), f"hydra.run.dir={run_dir}", cwd=root)
    wait_for(first, "busy.held", root)
    second = cli(*TINY, *hold(root, "busy"), "resume=auto", cwd=root, run_dir=run_dir)
    (root / "busy.release").touch()
    first.wait(timeout=300)
    config = (run_dir / ".hydra" / "config.yaml").read_bytes()
    third = cli(*TINY, "seed=1", cwd=root, run_dir=run_dir)
    return {"pid": first.pid, "first": first.returncode, "second": second, "third": third, "config": config}


def sweeps(root: Path) -> dict[str, Any]:
    """Two sweeps on one sweep folder at once."""
    args = ["-m", "runner", "-m", *TINY, *hold(root, "sweep"), "seed=0,1", f"hydra.sweep.dir={root / 'sweep'}"]
    first = popen(*args, cwd=root)
    wait_for(first, "sweep.held", root)
    second = python(*args, cwd=root)
    (root / "sweep.release").touch()
    first.wait(timeout=300)
    return {"first": first.returncode, "second": second}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    _ROOT.append(root)
    return {"same_second": lambda: same_second(root), "busy": lambda: busy(root), "sweeps": lambda: sweeps(root)}


def test_two_launches_in_the_same_second_get_two_folders(runs: dict[str, Future]) -> None:
    outcome = runs["same_second"].result()
    assert outcome["codes"] == [0, 0], outcome["stderr"]
    folders = sorted(p.name for p in (_root(runs) / "out").iterdir())
    assert folders == ["run", "run-1"]
    for name in folders:  # each its own rows, not interleaved
        steps = [r["step"] for r in jsonl(_root(runs) / "out" / name)]
        assert steps == sorted(set(steps)) and steps[-1] == 20


def test_a_second_writer_is_refused_naming_the_holder_and_a_finished_folder_is_not_reused(
    runs: dict[str, Future],
) -> None:
    outcome = runs["busy"].result()
    assert outcome["first"] == 0
    second: subprocess.CompletedProcess = outcome["second"]
    assert second.returncode == 2, explain(second)
    assert f"in use by another process (pid {outcome['pid']})" in second.stderr, explain(second)
    third: subprocess.CompletedProcess = outcome["third"]
    assert third.returncode == 2 and "already holds a run: continue it with resume=auto" in third.stderr, explain(third)
    run_dir = _root(runs) / "busy"
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == outcome["config"]  # the finished run's, untouched
    assert not list((run_dir / ".hydra").glob("clash-*"))
    assert [r["step"] for r in jsonl(run_dir)][-1] == 20 and "seed" not in (run_dir / "summary.json").read_text()


def test_a_second_sweep_on_a_sweep_folder_in_use_is_refused(runs: dict[str, Future]) -> None:
    outcome = runs["sweeps"].result()
    assert outcome["first"] == 0
    second = outcome["second"]
    assert second.returncode == 2 and "sweep folder" in second.stderr and "in use" in second.stderr, explain(second)
    rows = (_root(runs) / "sweep" / "results.csv").read_text().splitlines()
    assert len(rows) == 3  # the header and the first sweep's two jobs


def _root(runs: dict[str, Future]) -> Path:
    return _ROOT[-1]
