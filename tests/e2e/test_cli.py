"""The real CLI, `python -m runner ...`, in subprocesses: files written, exact step counts, --help, mixed precision,
and what a user sees of a configuration error. The module's runs: jobs() below. A seed's reproducibility is checked in
test_rundir.py, whose two launches in the same second are one seed's run twice."""

from __future__ import annotations

import math
import os
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import yaml
from helpers import cli, config_groups, config_options, explain, jsonl, ok, read_json

# The digits data: 1797 images; the stratified split rounds each class's 20% share, giving 359 held out (val and
# test) and 1438 train samples, i.e. 45 micro-batches of 32 per epoch (44 full ones and one of 30).
TRAIN_SAMPLES, BATCHES_PER_EPOCH, BATCH = 1438, 45, 32
TRAIN_LOG_KEYS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/param_norm",
    "train/samples_per_s",
    "sys/peak_memory_mb",
}
SUMMARY_KEYS = {"stop_reason", "progress", "metrics", "best", "wall_time_s", "samples_per_s"}

# name -> the command line of one run (longest first: they start in this order)
RUNS = {
    "two_epochs": ["+experiment=digits", "trainer.max_duration=2ep", "trainer.log_interval=5st"],
    "accumulate": ["+experiment=digits", "trainer.accumulate_grad_batches=4", "trainer.max_duration=1ep"],
    "bf16": ["+experiment=digits", "precision=bf16", "trainer.max_duration=10st"],
    "fp16": ["+experiment=digits", "precision=fp16", "trainer.max_duration=10st"],
    "help": ["--help"],
    "config_error": ["+experiment=digits", "trainer.accumulate_grad_batches=1000"],
    # Hydra's own composition errors: the CLI turns them into the same one paragraph and exit code 2
    "misspelled_key": ["+experiment=digits", "trainer.max_duraton=3ep"],
    "unknown_option": ["+experiment=digits", "model=nope"],
    "experiment_twice": ["+experiment=digits", "+experiment=sae"],
}
HYDRA_ERRORS = {
    "misspelled_key": ["trainer.max_duraton is not a key", "did you mean trainer.max_duration?"],
    "unknown_option": ["Could not find 'model/nope'", "mlp"],
    "experiment_twice": ["Multiple values for experiment"],
}
Runs = dict[str, Future]


def jobs(root: Path, runs: Runs) -> dict[str, Callable[[], tuple[subprocess.CompletedProcess, Path]]]:
    """The module's runs (helpers.module_runs): each of RUNS, (process, its run folder <root>/<name>)."""

    def job(name: str):
        return lambda: (cli(*RUNS[name], cwd=root, run_dir=root / name), root / name)

    return {name: job(name) for name in RUNS}


def finished(runs: Runs, name: str) -> Path:
    """The folder of run `name`, which must have exited 0."""
    proc, run_dir = runs[name].result()
    ok(proc)
    return run_dir


def samples_at(step: int) -> int:
    """Samples seen after `step` optimizer steps without accumulation: each epoch's last micro-batch is short."""
    epochs, rest = divmod(step, BATCHES_PER_EPOCH)
    return epochs * TRAIN_SAMPLES + rest * BATCH


def test_two_epochs_write_every_file_with_exact_counts(runs: Runs) -> None:
    run = finished(runs, "two_epochs")

    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert config["trainer"]["max_duration"] == "2ep" and config["trainer"]["log_interval"] == "5st"
    hydra_cfg = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra_cfg["runtime"]["output_dir"] == str(run)

    meta = read_json(run / "run.json")
    assert {"command", "git", "versions", "hostname", "device", "world_size"} <= set(meta)
    assert "+experiment=digits" in meta["command"] and "trainer.max_duration=2ep" in meta["command"]
    assert isinstance(meta["git"], dict) and "commit" in meta["git"]
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["hostname"] == socket.gethostname()
    assert meta["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert meta["world_size"] == 1
    # python -m runner chose OpenMP's wait policy before torch loaded it, and says why (or that it was the user's)
    chosen = meta["openmp_wait_policy"]
    assert chosen["policy"] == os.environ.get("OMP_WAIT_POLICY", chosen["policy"]) and chosen["why"], chosen

    summary = read_json(run / "summary.json")
    assert SUMMARY_KEYS <= set(summary)
    assert summary["stop_reason"] == "max_duration"
    progress = summary["progress"]
    assert (progress["step"], progress["micro_batch"], progress["epoch"]) == (90, 90, 2)
    assert progress["samples"] == 2 * TRAIN_SAMPLES == 2876
    assert summary["wall_time_s"] > 0
    assert summary["samples_per_s"] == pytest.approx(progress["samples"] / summary["wall_time_s"])

    rows = jsonl(run)
    assert all({"step", "epoch", "samples"} <= set(row) for row in rows)
    steps = [row["step"] for row in rows]
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), steps
    assert steps == list(range(5, 91, 5))  # one row per logged step, validations folded into their step's row
    for row in rows:
        assert TRAIN_LOG_KEYS <= set(row), row
        assert all(math.isfinite(row[k]) for k in TRAIN_LOG_KEYS)
        assert row["samples"] == samples_at(row["step"])
        assert row["epoch"] == pytest.approx(row["step"] / BATCHES_PER_EPOCH)
        assert row["train/lr"] == pytest.approx(1e-3)  # plateau cannot drop the LR within two validations
        has_val = {"val/loss", "val/acc"} <= set(row)
        assert has_val == (row["step"] in (45, 90)), row
    val_rows = [row for row in rows if "val/loss" in row]
    assert val_rows[1]["val/acc"] > val_rows[0]["val/acc"] - 0.05 and val_rows[1]["val/acc"] > 0.8

    best = summary["best"]
    assert best["monitor"] == "val/loss"
    assert best["value"] == pytest.approx(min(r["val/loss"] for r in val_rows))
    assert best["step"] in (45, 90)
    # early stopping restores the best weights; the final metrics are measured on them
    assert summary["metrics"]["val/loss"] == pytest.approx(best["value"], rel=1e-5)
    assert summary["metrics"]["train/loss"] == rows[-1]["train/loss"]

    # runner.log holds what the console printed: the startup table, each validation, the final table
    log = (run / "runner.log").read_text()
    assert "MLPClassifier" in log and "step 45  epoch 1.00" in log and "done: max_duration" in log
    assert "\x1b[" not in log  # no terminal control codes


def test_gradient_accumulation_counts(runs: Runs) -> None:
    run = finished(runs, "accumulate")
    summary = read_json(run / "summary.json")
    assert summary["stop_reason"] == "max_duration"
    progress = summary["progress"]
    assert progress["step"] == math.ceil(BATCHES_PER_EPOCH / 4) == 12
    assert progress["micro_batch"] == BATCHES_PER_EPOCH
    assert (progress["epoch"], progress["samples"]) == (1, TRAIN_SAMPLES)
    rows = jsonl(run)
    assert [row["step"] for row in rows] == [10, 12]
    assert rows[0]["samples"] == 10 * 4 * BATCH and "val/loss" not in rows[0]
    assert rows[1]["epoch"] == pytest.approx(1.0) and "val/loss" in rows[1]


def test_a_config_error_is_one_line_on_stderr_exit_code_2_and_no_files(runs: Runs) -> None:
    # Every configuration error, in-process: tests/unit/test_cli_errors.py. Here, what a user sees of one.
    proc, run_dir = runs["config_error"].result()
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: "), explain(proc)
    for fragment in ("accumulate_grad_batches=1000", "does not fit", "45 micro-batches"):
        assert fragment in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, explain(proc)
    assert len((proc.stdout + proc.stderr).strip().splitlines()) <= 15, explain(proc)
    # refused before it trained: the run folder this launch made (Hydra's .hydra/, runner.log) is removed again
    # (runner.rundir.refused; a resume's folder is kept: tests/unit/test_bad_inputs.py)
    assert not run_dir.exists(), sorted(run_dir.iterdir())


@pytest.mark.parametrize("name", list(HYDRA_ERRORS))
def test_hydra_composition_errors_are_one_paragraph_and_exit_code_2(name: str, runs: Runs) -> None:
    proc, _ = runs[name].result()
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, explain(proc)
    assert "Traceback" not in proc.stderr and "+trainer.max_duraton=3ep" not in proc.stderr, explain(proc)
    for fragment in HYDRA_ERRORS[name]:
        assert fragment in proc.stderr, explain(proc)


def test_help_lists_every_group_and_option(runs: Runs) -> None:
    proc = ok(runs["help"].result()[0])
    assert "== Configuration groups ==" in proc.stdout and "== Config ==" in proc.stdout
    section = proc.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in section.splitlines() if ":" in line}
    groups = config_groups()  # runner/conf's and the task packages' conf folders', merged by Hydra
    assert "scheduler" in groups
    for group in groups:
        options = set(config_options(group))
        assert group in lines, proc.stdout
        assert {o.strip() for o in lines[group].split(",")} == options, lines[group]
    assert "cosine" in lines["scheduler"] and "plateau" in lines["scheduler"]
    assert "Durations" in proc.stdout


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(precision: str, runs: Runs) -> None:
    proc, run = runs[precision].result()
    ok(proc)
    summary = read_json(run / "summary.json")
    assert summary["stop_reason"] == "max_duration" and summary["progress"]["step"] == 10
    assert all(math.isfinite(v) for v in summary["metrics"].values()), summary["metrics"]
    assert summary["nonfinite_steps"] == 0
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert config["precision"]["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert any(line.split() == ["precision", precision] for line in proc.stderr.splitlines()), explain(proc)
