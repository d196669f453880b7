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


def _torchrun(cwd: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "runner",
            *overrides,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _single(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-m", "runner", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


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
