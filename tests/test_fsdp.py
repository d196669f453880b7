"""FSDP2 (`fully_shard`) for real on the CPU: torchrun, 2 processes, gloo. The same training as one process, the global
gradient norm for clipping, and full checkpoints: resumable under FSDP, loadable by one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DIGITS = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.val_interval=10st",
    "logger=[console,jsonl]",
    "callbacks=none",
]
# 40 steps of 2 x 16 samples stay inside the first epoch (1438 samples), where 1 x 32 sees the same batches.
CHECKPOINTED = [
    *DIGITS,
    "trainer.max_duration=40st",
    "callbacks=checkpoint",
    "callbacks.checkpoint.interval=10st",
    "callbacks.checkpoint.keep_last=10",
]


class Affine(nn.Module):
    """Digits by one affine map whose parameters sit on the task itself and are used without forward() (as an SAE's
    are): under FSDP only the registered step methods gather them. (Run as `model._target_=test_fsdp.Affine`.)"""

    def __init__(self, in_features: int = 64, num_classes: int = 10, **unused: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, num_classes) * 0.1)
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy of x @ weight + bias."""
        x, y = batch
        return {"loss": F.cross_entropy(x @ self.weight + self.bias, y)}

    validation_step = training_step  # the class's function, not the instance's FSDP-wrapped training_step


def _run(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])  # test_fsdp.Affine
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": path}
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _torchrun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = _run(cwd, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _single(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = _run(cwd, "-m", "runner", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


def _rows(run_dir: Path) -> list[dict]:
    timing = {"train/samples_per_s", "sys/peak_memory_mb"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in timing} for row in rows]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    # Tolerance: as in the DDP test, the runs sum the same 32 per-sample gradients in another order (a reduce-scatter
    # of two means of 16 vs one mean of 32): float32 rounding, amplified by AdamW for near-zero gradients; 1e-5 is
    # far below one step's change (~1e-3).
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 FSDP steps of 2 x 16 samples with a checkpoint every 10 steps (all kept)."""
    cwd = tmp_path_factory.mktemp("fsdp")
    done = _torchrun(cwd, *CHECKPOINTED, "distributed=fsdp", "data.batch_size=16")
    assert "fsdp (full shard), backend gloo, 2 rank(s) per node" in done.stderr  # the startup table, once
    assert done.stderr.count("global batch") == 1
    (run_dir,) = list((cwd / "outputs").glob("*/*"))  # one run folder for the job, not one per rank
    return run_dir


@pytest.mark.slow
def test_fsdp_trains_like_one_process_with_exact_counts(fsdp_run: Path, tmp_path: Path) -> None:
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert summary["progress"]["step"] == 40 and summary["progress"]["samples"] == 40 * 32
    assert summary["progress"]["micro_batch"] == 40
    one = tmp_path / "one"
    _single(tmp_path, *DIGITS, "data.batch_size=32", "trainer.max_duration=40st", f"hydra.run.dir={one}")
    _close(_weights(fsdp_run), _weights(one))  # gathered to full tensors, under the bare model's names
    # validation goes through the sharded root (its parameters gathered), reduced over both ranks' shards of data
    val, val_one = ([r["val/loss"] for r in _rows(d) if "val/loss" in r] for d in (fsdp_run, one))
    assert len(val) == 4 and val == pytest.approx(val_one, abs=1e-5)
    norms = [[r["train/param_norm"] for r in _rows(d) if "train/param_norm" in r] for d in (fsdp_run, one)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # over both ranks' shards, not this rank's


@pytest.mark.slow
def test_fsdp_clips_on_the_global_gradient_norm(tmp_path: Path) -> None:
    # SGD: its step is proportional to the clipped gradient, so a per-shard norm (a different factor on each rank)
    # would show in the weights; AdamW would nearly cancel a constant factor. Accumulation: FSDP's no-sync path.
    # Affine: every parameter in the root, used outside forward(), so validation must gather them itself.
    args = [
        *DIGITS,
        "model._target_=test_fsdp.Affine",
        "optimizer=sgd",
        "trainer.gradient_clip_val=0.05",
        "trainer.max_duration=20st",
    ]
    _torchrun(
        tmp_path,
        *args,
        "distributed=fsdp",
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=2",
        f"hydra.run.dir={tmp_path}/fsdp",
    )
    _single(tmp_path, *args, "data.batch_size=32", f"hydra.run.dir={tmp_path}/one")
    rows = [_rows(tmp_path / d) for d in ("fsdp", "one")]
    norms = [[r["train/grad_norm"] for r in run if "train/grad_norm" in r] for run in rows]
    assert min(norms[1]) > 0.05  # clipping was active at every step
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    _close(_weights(tmp_path / "fsdp"), _weights(tmp_path / "one"))
    val = [[r["val/loss"] for r in run if "val/loss" in r] for run in rows]
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], abs=1e-5)


@pytest.mark.slow
def test_fsdp_resumed_from_a_checkpoint_equals_the_uninterrupted_run(fsdp_run: Path, tmp_path: Path) -> None:
    # The run as it stood when its step-20 checkpoint was written (a crash right after it): later checkpoints gone.
    split = tmp_path / "split"
    shutil.copytree(fsdp_run, split, symlinks=True)
    for later in ("step-00000030", "step-00000040"):
        shutil.rmtree(split / "checkpoints" / later)
    resumed = _torchrun(
        tmp_path, *CHECKPOINTED, "distributed=fsdp", "data.batch_size=16", f"hydra.run.dir={split}", "resume=auto"
    )
    assert resumed.stderr.count("resuming from") == 1 and "step-00000020" in resumed.stderr
    # Bit-identical: the checkpoint holds the exact float32 weights and Adam moments, each rank takes back the same
    # shards, the same RNG states and data positions, and gloo's reductions run in a fixed order.
    for name, tensor in _weights(fsdp_run).items():
        assert torch.equal(tensor, _weights(split)[name]), name
    assert _rows(split) == _rows(fsdp_run)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_in_one_process(fsdp_run: Path, tmp_path: Path) -> None:
    # The files are full tensors in one process's format (the optimizer's states by parameter index): one process with
    # the same global batch continues the FSDP run from step 20 to the same weights (rounding aside: see _close).
    checkpoint = fsdp_run / "checkpoints" / "step-00000020"
    _single(
        tmp_path,
        *CHECKPOINTED,
        "data.batch_size=32",
        f"resume={checkpoint}",
        "resume_allow_changes=true",
        f"hydra.run.dir={tmp_path}/one",
    )
    _close(_weights(tmp_path / "one"), _weights(fsdp_run))
