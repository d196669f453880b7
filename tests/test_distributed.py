"""Distributed training for real on the CPU: torchrun, 2 processes, the gloo backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.distributed import _first_host, environment

DIGITS = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.val_interval=10st",
    "logger=[console,jsonl]",
    "callbacks=none",
]


def _run(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _torchrun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return _run(cwd, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner", *overrides)


def _single(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return _run(cwd, "-m", "runner", *overrides)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


@pytest.mark.slow
def test_torchrun_ddp_one_folder_exact_counts_and_the_same_training_as_one_process(tmp_path: Path) -> None:
    # 2 processes x batch 16, 1 process x batch 32, 1 process x batch 16 x accumulation 2: the same 32 samples in
    # every optimizer step (20 steps stay inside the first epoch of 1438 samples, where no window is short).
    (tmp_path / "ddp").mkdir()
    ddp = _torchrun(tmp_path / "ddp", *DIGITS, "distributed=ddp", "data.batch_size=16", "trainer.max_duration=20st")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    folders = list((tmp_path / "ddp" / "outputs").glob("*/*"))
    assert len(folders) == 1, folders  # one run folder for the job, not one per rank
    run_dir = folders[0]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and not list(run_dir.glob(".hydra/resume-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["progress"]["step"] == 20 and summary["progress"]["samples"] == 20 * 32
    assert "ddp, backend gloo, 2 rank(s) per node" in ddp.stderr  # the startup table, printed once (rank 0)
    assert ddp.stderr.count("global batch") == 1
    assert ddp.stderr.count("has settings but its option is not selected") == 1  # rank 1 stays quiet

    one = _single(tmp_path, *DIGITS, "data.batch_size=32", "trainer.max_duration=20st", f"hydra.run.dir={tmp_path}/one")
    acc = _single(
        tmp_path,
        *DIGITS,
        "data.batch_size=16",
        "trainer.accumulate_grad_batches=2",
        "trainer.max_duration=20st",
        f"hydra.run.dir={tmp_path}/acc",
    )
    assert one.returncode == 0 and acc.returncode == 0, one.stderr[-2000:] + acc.stderr[-2000:]
    reference = _weights(tmp_path / "one")
    # Tolerance: the three sum the same 32 per-sample gradients in a different order (all-reduce of two means of 16,
    # two accumulated halves, one mean of 32), so they differ by float32 rounding, which AdamW's division by
    # sqrt(v) amplifies for near-zero gradients over 20 steps; 1e-5 absolute is far below one step's change (~1e-3).
    for other in (_weights(run_dir), _weights(tmp_path / "acc")):
        for name, tensor in reference.items():
            torch.testing.assert_close(other[name], tensor, rtol=0, atol=1e-5, msg=name)
    val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    # validation metrics are reduced exactly over the two ranks' shards: sums and counts, no padding
    assert [r["val/loss"] for r in val if "val/loss" in r] == pytest.approx(
        [r["val/loss"] for r in val_one if "val/loss" in r], abs=1e-5
    )


def test_environment_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    assert environment()["world_size"] == 1
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[07-08]")
    info = environment()
    assert (info["launcher"], info["rank"], info["world_size"], info["local_rank"]) == ("slurm", 3, 8, 1)
    assert (info["local_world_size"], info["master"]) == (4, "gpu07")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert environment()["launcher"] == "torchrun"  # torchrun inside a SLURM allocation wins


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node07", "node07"), ("node[07-09,12]", "node07"), ("gpu-a[1-2],gpu-b3", "gpu-a1"), ("a1,b2", "a1")],
)
def test_first_host_of_a_slurm_nodelist(nodelist: str, host: str) -> None:
    assert _first_host(nodelist) == host


def _rows(run_dir: Path) -> list[dict]:
    timing = {"train/samples_per_s", "sys/peak_memory_mb"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in timing} for row in rows]


@pytest.mark.slow
def test_ddp_preempted_and_resumed_on_every_rank_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    import signal
    import time

    args = [
        *DIGITS,
        "distributed=ddp",
        "data.batch_size=16",
        "trainer.max_duration=40st",
        "callbacks=checkpoint",
        "callbacks.checkpoint.interval=10st",
    ]
    whole = _torchrun(tmp_path, *args, f"hydra.run.dir={tmp_path}/whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    # The second job trains slowly (tests/_launch.py sleeps in training_step) and is sent SIGTERM, as SLURM does,
    # once its first checkpoint exists; torchrun forwards it to both workers.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUNNER_TEST_STEP_SLEEP": "0.05"}
    split = tmp_path / "split"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(Path(__file__).parent / "_launch.py"),
            *args,
            f"hydra.run.dir={split}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (split / "checkpoints" / "step-00000010").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    summary = json.loads((split / "summary.json").read_text())
    assert summary["stop_reason"] == "preempted" and 10 <= summary["progress"]["step"] < 40, err[-3000:]
    resumed = _torchrun(tmp_path, *args, f"hydra.run.dir={split}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("resuming from") == 1  # said once, by rank 0
    for name, tensor in _weights(tmp_path / "whole").items():
        assert torch.equal(tensor, _weights(split)[name]), name
    assert _rows(split) == _rows(tmp_path / "whole")
