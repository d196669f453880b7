"""Sweeps (`-m`): results.csv as jobs finish, failed and diverged jobs, fail_fast, Optuna, joblib in parallel. The
module's sweeps: jobs() below. What a job decides in-process: tests/unit/test_sweep.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import cli, explain, jsonl, offline_run, results_csv, same_history, summary
from omegaconf import OmegaConf

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st"]
WANDB = "logger=[console,jsonl,wandb]"
OPTUNA = ["+experiment=digits", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2"]
OPTUNA += ["trainer.max_duration=20st", "trainer.val_interval=10st"]
HAS_OPTUNA = importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
HAS_JOBLIB = importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None
needs_optuna = pytest.mark.skipif(not HAS_OPTUNA, reason="hydra-optuna-sweeper (pip install runner[sweep])")
needs_joblib = pytest.mark.skipif(not HAS_JOBLIB, reason="hydra-joblib-launcher (pip install runner[sweep])")

SEARCH = """\
# @package _global_
defaults:
  - override /hydra/sweeper: optuna
  - override /hydra/sweeper/sampler: random
hydra:
  mode: MULTIRUN
  sweeper:
    direction: ${runner_direction:${mode}}
    study_name: mixed
    storage: sqlite:///${hydra.sweep.dir}/optuna.db
    n_trials: 6
    n_jobs: 1
    sampler:
      seed: 0
    params:
      optimizer.lr: choice(1e-3, 1e30)
      trainer.max_duration: choice(20st, 3x)
"""


Sweep = tuple[subprocess.CompletedProcess, Path]
Runs = dict[str, Future]


def sweep(root: Path, name: str, *overrides: str) -> Sweep:
    """`python -m runner -m *overrides` with its sweep folder <root>/<name>."""
    folder = root / name
    return cli("-m", *overrides, f"hydra.sweep.dir={folder}", cwd=root), folder


def optuna_and_more(root: Path) -> tuple[Sweep, Sweep]:
    """Two Optuna trials, then one more in a second launch pointed at the first one's study (its SQLite file)."""
    first = sweep(root, "optuna", *OPTUNA)
    storage = f"hydra.sweeper.storage=sqlite:///{first[1]}/optuna.db"
    return first, sweep(root, "more", *OPTUNA[:2], "hydra.sweeper.n_trials=1", *OPTUNA[3:], storage)


def optuna_mixed(root: Path) -> Sweep:
    """SEARCH (random sampler, seed 0): six trials, some diverged (lr 1e30), some failed (duration 3x)."""
    (root / "conf" / "hparams_search").mkdir(parents=True)
    (root / "conf" / "hparams_search" / "mixed.yaml").write_text(SEARCH)
    return sweep(
        root, "optuna_mixed", f"--config-dir={root / 'conf'}", "+experiment=digits", "hparams_search=mixed",
        "trainer.val_interval=10st", "trainer.max_nonfinite_steps=2",
    )  # fmt: skip


def joblib(root: Path) -> Sweep:
    """Two jobs with joblib's n_jobs=2. Both wait at fit start until both have started (tests/_tasks.py Rendezvous):
    they complete only if they ran at the same time."""
    rendezvous = ["+callbacks.rendezvous._target_=_tasks.Rendezvous", f"+callbacks.rendezvous.dir={root}/met"]
    return sweep(
        root, "joblib", "+experiment=digits", "trainer.max_duration=30st", "data.num_workers=2", *rendezvous,
        "+callbacks.rendezvous.count=2", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=1e-3,3e-3",
    )  # fmt: skip


def jobs(root: Path, runs: Runs) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs), the longest first: name -> (process, sweep folder)."""
    found = {
        "grid": lambda: sweep(root, "grid", *TINY, WANDB, "optimizer.lr=1e-3,3e-3", "seed=0,1"),
        "failed_job": lambda: sweep(
            root, "failed_job", "+experiment=digits", "trainer.val_interval=10st", "trainer.max_duration=3x,20st"
        ),
        "fail_fast": lambda: sweep(root, "fail_fast", *TINY, "fail_fast=true", "model.hidden=[-3],[16]"),
        "all_failed": lambda: sweep(root, "all_failed", *TINY, "model.hidden=[-3],[-4]"),
    }
    if HAS_OPTUNA:
        found = {"optuna": lambda: optuna_and_more(root), "optuna_mixed": lambda: optuna_mixed(root), **found}
    if HAS_JOBLIB:
        found["joblib"] = lambda: joblib(root)
    return found


def _study(folder: Path, name: str) -> Any:
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/optuna.db")


def test_a_2x2_sweep_has_4_job_folders_and_a_results_row_each(runs: Runs) -> None:
    proc, folder = runs["grid"].result()
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in folder.iterdir()) == ["0", "1", "2", "3", "multirun.yaml", "results.csv"]
    rows = results_csv(folder)
    expected = {"0": ("0.001", "0"), "1": ("0.001", "1"), "2": ("0.003", "0"), "3": ("0.003", "1")}
    for job, (lr, seed) in expected.items():
        row, done = rows[job], summary(folder / job)
        for name in (".hydra/config.yaml", "metrics.jsonl", "summary.json"):
            assert (folder / job / name).is_file()
        assert (row["optimizer.lr"], row["seed"]) == (lr, seed)
        assert yaml.safe_load((folder / job / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] == float(lr)
        assert (row["status"], row["stop_reason"], row["step"]) == ("completed", "max_duration", "20")
        assert float(row["best"]) == done["best"]["value"] and row["monitor"] == "val/loss"
        assert float(row["val/acc"]) == done["metrics"]["val/acc"]
        assert float(row["wall_time_s"]) == done["wall_time_s"] and row["error"] == ""
    # the leaderboard, best first: its first data row is the job with the lowest best val/loss
    best = min(rows.values(), key=lambda r: float(r["best"]))
    table = proc.stdout[proc.stdout.index("4 job(s), by best val/loss (min)") :]
    first = next(line for line in table.splitlines() if line.startswith("│"))
    assert first.split("│")[1].strip() == best["job"], table
    assert "4 jobs: 4 completed." in proc.stdout

    # wandb: one finished run per job (none logged into another's), grouped by the sweep, named by the job
    wandb_runs = [offline_run(folder / job) for job in "0123"]
    assert len({run["id"] for run in wandb_runs}) == 4 and all(run["exit"] == 0 for run in wandb_runs)
    assert {(run["group"], run["job_type"]) for run in wandb_runs} == {(f"{folder.parent.name}/grid", "digits")}
    names = [f"{job}: optimizer.lr={lr} seed={seed}" for job, (lr, seed) in expected.items()]
    assert [run["name"] for run in wandb_runs] == names
    for run, job in zip(wandb_runs, "0123", strict=True):
        assert run["config"]["seed"] == int(rows[job]["seed"])
        same_history(run, jsonl(folder / job))  # each run holds its own job's numbers
        assert f"wandb: logging offline to {run['dir']}; upload it with `wandb sync {run['dir']}`" in proc.stderr


def test_a_failed_job_is_a_row_with_its_error_and_the_sweep_goes_on(runs: Runs) -> None:
    proc, folder = runs["failed_job"].result()
    assert proc.returncode == 0, explain(proc)
    rows = results_csv(folder)
    assert rows["0"]["status"] == "failed" and "cannot read duration '3x'" in rows["0"]["error"]
    assert summary(folder / "0")["stop_reason"] == "failed"
    assert rows["1"]["status"] == "completed" and float(rows["1"]["best"]) > 0
    assert "1 job(s) failed" in proc.stderr and "job 0: cannot read duration '3x'" in proc.stdout


def test_fail_fast_stops_at_the_first_failed_job_and_all_failed_exits_1(runs: Runs) -> None:
    proc, folder = runs["fail_fast"].result()
    assert proc.returncode == 1, explain(proc)
    assert "job 0 failed" in proc.stderr and "stopping the sweep (fail_fast)" in proc.stderr
    assert results_csv(folder)["0"]["status"] == "failed" and not (folder / "1").exists()

    proc, folder = runs["all_failed"].result()
    assert proc.returncode == 1, explain(proc)  # nothing to compare: the sweep failed
    assert [row["status"] for row in results_csv(folder).values()] == ["failed", "failed"]


@needs_optuna
def test_optuna_search_on_digits_reports_the_best_parameters_and_resumes(runs: Runs) -> None:
    (proc, folder), (more, _) = runs["optuna"].result()
    assert proc.returncode == 0, explain(proc)
    best = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optimizer.lr", "optimizer.weight_decay", "width"}
    rows = results_csv(folder)
    assert len(rows) == 2 and {row["status"] for row in rows.values()} == {"completed"}
    assert best["best_value"] == min(float(row["best"]) for row in rows.values())
    winner = min(rows.values(), key=lambda r: float(r["best"]))
    assert int(winner["width"]) == best["best_params"]["width"]
    config = OmegaConf.load(Path(winner["dir"]) / ".hydra" / "config.yaml")  # Hydra's copy keeps ${width}
    assert config.model.hidden == [best["best_params"]["width"]] * 2  # the searched width reached the model
    assert "Best parameters" in proc.stdout + proc.stderr

    # the study is in the sweep folder's SQLite file: a second launch pointed at it goes on with the same study
    assert more.returncode == 0, explain(more)
    assert [t.state.name for t in _study(folder, "digits").trials] == ["COMPLETE"] * 3


@needs_optuna
def test_optuna_survives_a_diverged_trial_and_a_failed_one(runs: Runs) -> None:
    # Not the grid sampler: hydra-optuna-sweeper 1.2 crashes when a grid's last trial fails (see the README).
    proc, folder = runs["optuna_mixed"].result()
    assert proc.returncode == 0, explain(proc)
    trials = _study(folder, "mixed").trials
    assert len(trials) == 6
    kinds = set()
    for trial in trials:
        lr, duration = trial.params["optimizer.lr"], trial.params["trainer.max_duration"]
        if duration == "3x":  # a failed trial is Optuna's FAIL, and the study goes on
            assert trial.state.name == "FAIL", trial
            kinds.add("failed")
        elif lr == 1e30:  # a diverged trial is a result, the worst one (TPE learns to avoid it)
            assert trial.state.name == "COMPLETE" and trial.value == math.inf, trial
            kinds.add("diverged")
        else:
            assert trial.state.name == "COMPLETE" and math.isfinite(trial.value), trial
            kinds.add("completed")
    assert kinds == {"completed", "diverged", "failed"}  # the seed's 6 trials have each kind
    rows = results_csv(folder)
    assert [rows[str(t.number)]["status"] for t in trials] == [
        {"FAIL": "failed"}.get(t.state.name, "diverged" if t.value == math.inf else "completed") for t in trials
    ]
    best = min(t.value for t in trials if t.state.name == "COMPLETE")
    assert yaml.safe_load((folder / "optimization_results.yaml").read_text())["best_value"] == best


@needs_joblib
def test_joblib_runs_2_jobs_at_once_with_the_cores_shared_and_loader_workers(runs: Runs) -> None:
    proc, folder = runs["joblib"].result()
    assert proc.returncode == 0, explain(proc)
    assert [row["status"] for row in results_csv(folder).values()] == ["completed", "completed"]
    runs = [json.loads((folder / job / "run.json").read_text()) for job in ("0", "1")]
    assert runs[0]["pid"] != runs[1]["pid"] != os.getpid()
    assert sorted(p.name for p in (folder.parent / "met").iterdir()) == sorted(f"{run['pid']}.started" for run in runs)
    cores = len(os.sched_getaffinity(0))
    assert [run["threads"] for run in runs] == [max(1, cores // 2)] * 2
