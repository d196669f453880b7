"""Sweeps (`-m`): results.csv as jobs finish, failed and diverged jobs, fail_fast, Optuna, joblib in parallel."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import cli
from test_wandb import jsonl, offline_run, same_history

from runner.sweeps.job import objective, parallel_jobs, threads_per_job

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st"]


def sweep(
    tmp_path: Path, *overrides: str, name: str = "sweep", env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / name
    return cli("-m", *overrides, f"hydra.sweep.dir={folder}", cwd=tmp_path, env=env), folder


def results(folder: Path) -> dict[str, dict[str, str]]:
    with (folder / "results.csv").open(newline="") as f:
        return {row["job"]: row for row in csv.DictReader(f)}


def summary(job: Path) -> dict[str, Any]:
    return json.loads((job / "summary.json").read_text())


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_a_2x2_sweep_has_4_job_folders_and_a_results_row_each(tmp_path: Path) -> None:
    proc, folder = sweep(tmp_path, *TINY, "logger=[console,jsonl,wandb]", "optimizer.lr=1e-3,3e-3", "seed=0,1")
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in folder.iterdir()) == ["0", "1", "2", "3", "multirun.yaml", "results.csv"]
    rows = results(folder)
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
    runs = [offline_run(folder / job) for job in "0123"]
    assert len({run["id"] for run in runs}) == 4 and all(run["exit"] == 0 for run in runs)
    assert {(run["group"], run["job_type"]) for run in runs} == {(f"{tmp_path.name}/sweep", "digits")}
    names = [f"{job}: optimizer.lr={lr} seed={seed}" for job, (lr, seed) in expected.items()]
    assert [run["name"] for run in runs] == names
    for run, job in zip(runs, "0123", strict=True):
        assert run["config"]["seed"] == int(rows[job]["seed"])
        same_history(run, jsonl(folder / job))  # each run holds its own job's numbers
        assert f"wandb: logging offline to {run['dir']}; upload it with `wandb sync {run['dir']}`" in proc.stderr


@pytest.mark.slow
def test_a_failed_job_is_a_row_with_its_error_and_the_sweep_goes_on(tmp_path: Path) -> None:
    proc, folder = sweep(tmp_path, "+experiment=digits", "trainer.val_interval=10st", "trainer.max_duration=3x,20st")
    assert proc.returncode == 0, explain(proc)
    rows = results(folder)
    assert rows["0"]["status"] == "failed" and "cannot read duration '3x'" in rows["0"]["error"]
    assert summary(folder / "0")["stop_reason"] == "failed"
    assert rows["1"]["status"] == "completed" and float(rows["1"]["best"]) > 0
    assert "1 job(s) failed" in proc.stderr and "job 0: cannot read duration '3x'" in proc.stdout


@pytest.mark.slow
def test_fail_fast_stops_at_the_first_failed_job_and_all_failed_exits_1(tmp_path: Path) -> None:
    proc, folder = sweep(tmp_path, *TINY, "fail_fast=true", "model.hidden=[-3],[16]")
    assert proc.returncode == 1, explain(proc)
    assert "job 0 failed" in proc.stderr and "stopping the sweep (fail_fast)" in proc.stderr
    assert results(folder)["0"]["status"] == "failed" and not (folder / "1").exists()

    proc, folder = sweep(tmp_path, *TINY, "model.hidden=[-3],[-4]", name="all_failed")
    assert proc.returncode == 1, explain(proc)  # nothing to compare: the sweep failed
    assert [row["status"] for row in results(folder).values()] == ["failed", "failed"]


def _study(folder: Path, name: str) -> Any:
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/optuna.db")


@pytest.mark.slow
def test_optuna_search_on_digits_reports_the_best_parameters_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    args = ["+experiment=digits", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2"]
    args += ["trainer.max_duration=20st", "trainer.val_interval=10st"]
    proc, folder = sweep(tmp_path, *args)
    assert proc.returncode == 0, explain(proc)
    best = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optimizer.lr", "optimizer.weight_decay", "width"}
    rows = results(folder)
    assert len(rows) == 2 and {row["status"] for row in rows.values()} == {"completed"}
    assert best["best_value"] == min(float(row["best"]) for row in rows.values())
    winner = min(rows.values(), key=lambda r: float(r["best"]))
    assert int(winner["width"]) == best["best_params"]["width"]
    config = yaml.safe_load((Path(winner["dir"]) / ".hydra" / "config.yaml").read_text())
    assert config["model"]["hidden"] == [best["best_params"]["width"]] * 2  # the searched width reached the model
    assert "Best parameters" in proc.stdout + proc.stderr

    # the study is in the sweep folder's SQLite file: a second launch pointed at it goes on with the same study
    storage = f"hydra.sweeper.storage=sqlite:///{folder}/optuna.db"
    proc, _ = sweep(tmp_path, *args[:2], "hydra.sweeper.n_trials=1", *args[3:], storage, name="more")
    assert proc.returncode == 0, explain(proc)
    assert [t.state.name for t in _study(folder, "digits").trials] == ["COMPLETE"] * 3


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


@pytest.mark.slow
def test_optuna_survives_a_diverged_trial_and_a_failed_one(tmp_path: Path) -> None:
    # Not the grid sampler: hydra-optuna-sweeper 1.2 crashes when a grid's last trial fails (see the README).
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    (tmp_path / "conf" / "hparams_search").mkdir(parents=True)
    (tmp_path / "conf" / "hparams_search" / "mixed.yaml").write_text(SEARCH)
    proc, folder = sweep(
        tmp_path, f"--config-dir={tmp_path / 'conf'}", "+experiment=digits", "hparams_search=mixed",
        "trainer.val_interval=10st", "trainer.max_nonfinite_steps=2",
    )  # fmt: skip
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
    rows = results(folder)
    assert [rows[str(t.number)]["status"] for t in trials] == [
        {"FAIL": "failed"}.get(t.state.name, "diverged" if t.value == math.inf else "completed") for t in trials
    ]
    best = min(t.value for t in trials if t.state.name == "COMPLETE")
    assert yaml.safe_load((folder / "optimization_results.yaml").read_text())["best_value"] == best


@pytest.mark.slow
def test_joblib_runs_2_jobs_at_once_with_the_cores_shared_and_loader_workers(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    # Both jobs wait at fit start until both have started: they complete only if they ran at the same time.
    rendezvous = ["+callbacks.rendezvous._target_=_tasks.Rendezvous", f"+callbacks.rendezvous.dir={tmp_path}/met"]
    proc, folder = sweep(
        tmp_path, "+experiment=digits", "trainer.max_duration=30st", "data.num_workers=2", *rendezvous,
        "+callbacks.rendezvous.count=2", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=1e-3,3e-3",
        env={"PYTHONPATH": str(Path(__file__).parent)},
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert [row["status"] for row in results(folder).values()] == ["completed", "completed"]
    runs = [json.loads((folder / job / "run.json").read_text()) for job in ("0", "1")]
    assert runs[0]["pid"] != runs[1]["pid"] != os.getpid()
    assert sorted(p.name for p in (tmp_path / "met").iterdir()) == sorted(f"{run['pid']}.started" for run in runs)
    cores = len(os.sched_getaffinity(0))
    assert [run["threads"] for run in runs] == [max(1, cores // 2)] * 2


def test_threads_per_job_shares_the_cores_between_parallel_jobs() -> None:
    assert threads_per_job(None, 1, cores=16) is None  # one job at a time: torch's default
    assert threads_per_job(None, 4, cores=16) == 4
    assert threads_per_job(None, 3, cores=2) == 1
    assert threads_per_job(2, 4, cores=16) == 2  # `threads` set: it wins
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    cores = len(os.sched_getaffinity(0))
    assert parallel_jobs({"_target_": joblib, "n_jobs": 3}) == 3
    assert parallel_jobs({"_target_": joblib, "n_jobs": -1}) == cores
    assert parallel_jobs({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}) == 1


def test_what_a_job_returns_to_the_sweeper() -> None:
    assert objective("max_duration", 0.25, "min") == 0.25
    assert objective("early_stopping", None, "min") is None  # never validated: no value
    assert objective("nonfinite", 0.25, "min") == math.inf and objective("nonfinite", 0.9, "max") == -math.inf
    assert objective("failed", None, "max") is None
