"""Run and sweep folders are never shared by accident: two launches in the same second get two folders, a second writer
into a folder in use is refused naming the holder's pid, a new run into a finished run's folder is refused without
touching it, and a second sweep on a sweep folder in use is refused. The same launches show what a seed fixes: the two
launches in the same second are one seed's run twice (the same metrics), the busy folder's first run another seed's."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import cli, explain, jsonl, metric_rows, popen, python, wait_for

_ROOT: list[Path] = []  # the folder of this module's runs (jobs)
TINY = ["+experiment=digits", "trainer.max_duration=20st", "logger=[console,jsonl]"]
# The seed tests' runs: 30 steps, a log row every 10, so three rows, and the run ends before the first validation's
# interval (an epoch: 45 steps), which then comes at the last step
SEEDED = ["+experiment=digits", "trainer.max_duration=30st", "logger=[console,jsonl]"]


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
    """Two launches at once onto one dated folder name: the same run of seed 0 twice."""
    procs = [popen("-m", "runner", *SEEDED, FRESH, cwd=root) for _ in range(2)]
    return {"codes": [p.wait(timeout=300) for p in procs], "stderr": [p.stderr.read() for p in procs]}


def busy(root: Path) -> dict[str, Any]:
    """A resume=auto into a folder while another run writes there; then a new run into the finished folder. The
    first run is the seed tests' run of seed 1 (its Hold callback only waits: the same training as without it)."""
    run_dir, first_run = root / "busy", [*SEEDED, "seed=1", *hold(root, "busy")]
    first = popen("-m", "runner", *first_run, f"hydra.run.dir={run_dir}", cwd=root)
    wait_for(first, "busy.held", root)
    second = cli(*first_run, "resume=auto", cwd=root, run_dir=run_dir)
    (root / "busy.release").touch()
    first.wait(timeout=300)
    config, summary = (run_dir / ".hydra" / "config.yaml").read_bytes(), (run_dir / "summary.json").read_bytes()
    third = cli(*TINY, "seed=0", cwd=root, run_dir=run_dir)  # another seed than the first run's
    outcome = {"pid": first.pid, "first": first.returncode, "second": second, "third": third}
    return {**outcome, "config": config, "summary": summary}


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
        assert steps == sorted(set(steps)) and steps[-1] == 30


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
    assert [r["step"] for r in jsonl(run_dir)][-1] == 30
    assert (run_dir / "summary.json").read_bytes() == outcome["summary"]  # nor its summary


def test_a_second_sweep_on_a_sweep_folder_in_use_is_refused(runs: dict[str, Future]) -> None:
    outcome = runs["sweeps"].result()
    assert outcome["first"] == 0
    second = outcome["second"]
    assert second.returncode == 2 and "sweep folder" in second.stderr and "in use" in second.stderr, explain(second)
    rows = (_root(runs) / "sweep" / "results.csv").read_text().splitlines()
    assert len(rows) == 3  # the header and the first sweep's two jobs


def seed_zero(runs: dict[str, Future]) -> tuple[Path, Path]:
    """The two run folders of the same-second launches (seed 0 both), which must have exited 0."""
    outcome = runs["same_second"].result()
    assert outcome["codes"] == [0, 0], outcome["stderr"]
    return _root(runs) / "out" / "run", _root(runs) / "out" / "run-1"


def seed_one(runs: dict[str, Future]) -> Path:
    """The busy folder's finished run (seed 1), which must have exited 0."""
    outcome = runs["busy"].result()
    assert outcome["first"] == 0
    return _root(runs) / "busy"


def test_same_seed_gives_identical_metrics(runs: dict[str, Future]) -> None:
    run_a, run_b = seed_zero(runs)
    a, b = jsonl(run_a), jsonl(run_b)
    assert len(a) >= 3 and [r["step"] for r in a] == [r["step"] for r in b]
    assert {k for row in a for k in row} >= {"train/loss", "train/grad_norm", "val/loss", "val/acc"}
    assert metric_rows(run_a) == metric_rows(run_b)


def test_different_seed_gives_different_loss(runs: dict[str, Future]) -> None:
    loss = [r["train/loss"] for r in jsonl(seed_zero(runs)[0]) if "train/loss" in r]
    other = [r["train/loss"] for r in jsonl(seed_one(runs)) if "train/loss" in r]
    assert len(loss) == len(other) == 3
    assert loss != other


def test_one_metrics_row_per_step_when_run_ends_between_validations(runs: dict[str, Future]) -> None:
    steps = [r["step"] for r in jsonl(seed_zero(runs)[0])]
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), steps


def _root(runs: dict[str, Future]) -> Path:
    return _ROOT[-1]
