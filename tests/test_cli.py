"""The real CLI, `python -m runner ...`, in subprocesses: files written, exact step counts, reproducibility, errors."""

from __future__ import annotations

import json
import math
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# The digits data: 1797 images; the stratified split rounds each class's 20% share, giving 359 val and 1438 train
# samples, i.e. 45 micro-batches of 32 per epoch (44 full ones and one of 30).
TRAIN_SAMPLES, BATCHES_PER_EPOCH, BATCH = 1438, 45, 32
TIMING_KEYS = {"train/samples_per_s", "sys/peak_memory_mb"}
TRAIN_LOG_KEYS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/param_norm",
    "train/samples_per_s",
    "sys/peak_memory_mb",
}
SUMMARY_KEYS = {"stop_reason", "progress", "metrics", "best", "wall_time_s", "samples_per_s"}

Cli = Callable[..., subprocess.CompletedProcess]


def out(proc: subprocess.CompletedProcess) -> str:
    return f"--- rc={proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, out(proc)
    return proc


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def samples_at(step: int) -> int:
    """Samples seen after `step` optimizer steps without accumulation: each epoch's last micro-batch is short."""
    epochs, rest = divmod(step, BATCHES_PER_EPOCH)
    return epochs * TRAIN_SAMPLES + rest * BATCH


def test_two_epochs_write_every_file_with_exact_counts(run_cli: Cli, tmp_path: Path) -> None:
    ok(run_cli("+experiment=digits", "trainer.max_duration=2ep", "trainer.log_interval=5st"))
    run = tmp_path / "run"

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

    summary = read_json(run / "summary.json")
    assert SUMMARY_KEYS <= set(summary)
    assert summary["stop_reason"] == "max_duration"
    progress = summary["progress"]
    assert (progress["step"], progress["micro_batch"], progress["epoch"]) == (90, 90, 2)
    assert progress["samples"] == 2 * TRAIN_SAMPLES == 2876
    assert summary["wall_time_s"] > 0
    assert summary["samples_per_s"] == pytest.approx(progress["samples"] / summary["wall_time_s"])

    rows = read_rows(run / "metrics.jsonl")
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


def test_gradient_accumulation_counts(run_cli: Cli, tmp_path: Path) -> None:
    ok(run_cli("+experiment=digits", "trainer.accumulate_grad_batches=4", "trainer.max_duration=1ep"))
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stop_reason"] == "max_duration"
    progress = summary["progress"]
    assert progress["step"] == math.ceil(BATCHES_PER_EPOCH / 4) == 12
    assert progress["micro_batch"] == BATCHES_PER_EPOCH
    assert (progress["epoch"], progress["samples"]) == (1, TRAIN_SAMPLES)
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [10, 12]
    assert rows[0]["samples"] == 10 * 4 * BATCH and "val/loss" not in rows[0]
    assert rows[1]["epoch"] == pytest.approx(1.0) and "val/loss" in rows[1]


def run_parallel(
    tmp_path_factory: pytest.TempPathFactory, run_cli_in: Callable[..., Any], cases: dict[str, list[str]]
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Run the CLI once per case, two at a time, each in its own directory: name -> (process, its run dir)."""

    def one(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        directory = tmp_path_factory.mktemp(name)
        return run_cli_in(directory, *cases[name]), directory / "run"

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(one, cases), strict=True))


@pytest.fixture(scope="module")
def seeded_runs(tmp_path_factory: pytest.TempPathFactory, run_cli_in: Callable[..., Any]) -> dict[str, list[dict]]:
    """metrics.jsonl rows of three 30-step runs in separate processes: seed 0 twice, seed 1 once."""
    seeds = {"a": 0, "b": 0, "other": 1}
    cases = {name: ["+experiment=digits", "trainer.max_duration=30st", f"seed={seed}"] for name, seed in seeds.items()}
    rows = {}
    for name, (proc, run_dir) in run_parallel(tmp_path_factory, run_cli_in, cases).items():
        ok(proc)
        rows[name] = read_rows(run_dir / "metrics.jsonl")
    return rows


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def test_same_seed_gives_identical_metrics(seeded_runs: dict[str, list[dict]]) -> None:
    a, b = seeded_runs["a"], seeded_runs["b"]
    assert len(a) >= 3 and [r["step"] for r in a] == [r["step"] for r in b]
    assert {k for row in a for k in row} >= {"train/loss", "train/grad_norm", "val/loss", "val/acc"}
    assert _without_timing(a) == _without_timing(b)


def test_different_seed_gives_different_loss(seeded_runs: dict[str, list[dict]]) -> None:
    loss = [r["train/loss"] for r in seeded_runs["a"] if "train/loss" in r]
    other = [r["train/loss"] for r in seeded_runs["other"] if "train/loss" in r]
    assert len(loss) == len(other) == 3
    assert loss != other


def test_one_metrics_row_per_step_when_run_ends_between_validations(seeded_runs: dict[str, list[dict]]) -> None:
    steps = [r["step"] for r in seeded_runs["a"]]
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), steps


# id: (overrides, exit code (None: any non-zero), fragments the message must contain)
ERROR_CASES: dict[str, tuple[list[str], int | None, list[str]]] = {
    "unknown-experiment": (["+experiment=nope"], None, ["experiment/nope", "digits"]),
    "unknown-model": (["+experiment=digits", "model=nope"], None, ["model/nope", "mlp"]),
    "misspelled-key": (["+experiment=digits", "trainer.max_duraton=3ep"], None, ["max_duraton"]),
    "bad-duration": (
        ["+experiment=digits", "trainer.max_duration='3 epochs'"],
        2,
        ["3 epochs", "st (optimizer steps)", "ep (epochs)", "sa (samples)"],
    ),
    "too-short": (["+experiment=digits", "trainer.max_duration=0.01ep"], 2, ["shorter than one optimizer step"]),
    "accumulate-too-large": (
        ["+experiment=digits", "trainer.accumulate_grad_batches=1000"],
        2,
        ["accumulate_grad_batches=1000", "does not fit", "45 micro-batches"],
    ),
    "plateau-on-train-metric": (
        ["+experiment=digits", "scheduler=plateau", "scheduler.monitor=train/loss"],
        2,
        ["'train/loss'", "val/"],
    ),
}


@pytest.fixture(scope="module")
def error_runs(
    tmp_path_factory: pytest.TempPathFactory, run_cli_in: Callable[..., Any]
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """All error cases (each is mostly interpreter startup): id -> (process, its run dir)."""
    return run_parallel(tmp_path_factory, run_cli_in, {case: spec[0] for case, spec in ERROR_CASES.items()})


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_config_errors_exit_with_a_clear_message(
    case: str, error_runs: dict[str, tuple[subprocess.CompletedProcess, Path]]
) -> None:
    _, code, expected = ERROR_CASES[case]
    proc, run_dir = error_runs[case]
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, out(proc)
    if code is not None:
        assert proc.returncode == code, out(proc)
        assert proc.stderr.startswith("error: "), out(proc)
    for fragment in expected:
        assert fragment in text, out(proc)
    assert "Traceback" not in text, out(proc)
    assert len(text.strip().splitlines()) <= 15, out(proc)
    assert not (run_dir / "summary.json").exists()


def test_help_lists_every_group_and_option(run_cli: Cli) -> None:
    proc = ok(run_cli("--help"))
    assert "== Configuration groups ==" in proc.stdout and "== Config ==" in proc.stdout
    section = proc.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in section.splitlines() if ":" in line}
    groups = sorted(d.name for d in CONF_DIR.iterdir() if d.is_dir() and any(d.glob("*.yaml")))
    assert "scheduler" in groups
    for group in groups:
        options = {f.stem for f in (CONF_DIR / group).glob("*.yaml")}
        assert group in lines, proc.stdout
        assert {o.strip() for o in lines[group].split(",")} == options, lines[group]
    assert "cosine" in lines["scheduler"] and "plateau" in lines["scheduler"]
    assert "Durations" in proc.stdout


def test_default_digits_run_reaches_97_percent(run_cli: Cli, tmp_path: Path) -> None:
    ok(run_cli("+experiment=digits"))
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stop_reason"] in ("early_stopping", "max_duration")
    assert summary["metrics"]["val/acc"] >= 0.97, summary["metrics"]
    # measured on the restored best weights: the final val/loss is the best one
    assert summary["metrics"]["val/loss"] == pytest.approx(summary["best"]["value"], rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(precision: str, run_cli: Cli, tmp_path: Path) -> None:
    proc = ok(run_cli("+experiment=digits", f"precision={precision}", "trainer.max_duration=10st"))
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stop_reason"] == "max_duration" and summary["progress"]["step"] == 10
    assert all(math.isfinite(v) for v in summary["metrics"].values()), summary["metrics"]
    assert summary["nonfinite_steps"] == 0
    config = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert config["precision"]["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert any(line.split() == ["precision", precision] for line in proc.stderr.splitlines()), out(proc)
