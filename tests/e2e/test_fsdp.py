"""FSDP2 (`fully_shard`) for real on the CPU: torchrun, 2 processes, gloo. The same training as one process, the global
gradient norm for clipping, and full checkpoints: resumable under FSDP, loadable by one process."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    DIGITS_DDP,
    assert_close_weights,
    assert_same_weights,
    cli,
    metric_rows,
    ok,
    summary,
    torchrun,
)

# 40 steps of 2 x 16 samples stay inside the first epoch (1438 samples), where 1 x 32 sees the same batches.
CHECKPOINTED = [
    *DIGITS_DDP,
    "trainer.max_duration=40st",
    "callbacks=none",
    "checkpoint.interval=10st",
    "checkpoint.keep_last=10",
]
# SGD: its step is proportional to the clipped gradient, so a per-shard norm (a different factor on each rank) would
# show in the weights; AdamW would nearly cancel a constant factor. Accumulation: FSDP's no-sync path. Affine
# (tests/_tasks.py): every parameter in the root, used outside forward(), so validation must gather them itself.
CLIPPED = [*DIGITS_DDP, "model._target_=_tasks.Affine", "optimizer=sgd", "trainer.gradient_clip_val=0.05"]
CLIPPED += ["trainer.max_duration=20st"]
# Tolerance: as in the DDP test, the runs sum the same 32 per-sample gradients in another order (a reduce-scatter of
# two means of 16 vs one mean of 32): float32 rounding, amplified by AdamW for near-zero gradients; 1e-5 is far below
# one step's change (~1e-3).
ATOL = 1e-5


def fsdp_run(root: Path) -> dict[str, Any]:
    """40 FSDP steps of 2 x 16 samples with a checkpoint every 10 steps (all kept), in a folder of its own choosing."""
    (root / "fsdp").mkdir()
    done = ok(torchrun(*CHECKPOINTED, "distributed=fsdp", "data.batch_size=16", cwd=root / "fsdp"))
    return {"stderr": done.stderr, "run_dir": list((root / "fsdp" / "outputs").glob("*/*"))}


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*overrides, cwd=root, run_dir=root / name))
    return root / name


def two_ranks(root: Path, name: str, *overrides: str) -> Path:
    ok(torchrun(*overrides, f"hydra.run.dir={root / name}", cwd=root))
    return root / name


def resumed_under_fsdp(root: Path, fsdp: Future) -> dict[str, Any]:
    """The FSDP run as it stood when its step-20 checkpoint was written (a crash right after it), resumed."""
    (run_dir,) = fsdp.result()["run_dir"]
    split = root / "split"
    shutil.copytree(run_dir, split, symlinks=True)
    for later in ("step-00000030", "step-00000040"):
        shutil.rmtree(split / "checkpoints" / later)
    args = [*CHECKPOINTED, "distributed=fsdp", "data.batch_size=16", f"hydra.run.dir={split}", "resume=auto"]
    return {"stderr": ok(torchrun(*args, cwd=root)).stderr, "run_dir": split}


def resumed_in_one_process(root: Path, fsdp: Future) -> Path:
    (run_dir,) = fsdp.result()["run_dir"]
    checkpoint = run_dir / "checkpoints" / "step-00000020"
    args = [*CHECKPOINTED, "data.batch_size=32", f"resume={checkpoint}", "resume_allow_changes=true"]
    return single(root, "resumed_one", *args)


def initialised(root: Path, name: str, weights: Callable[[], Path], *overrides: str) -> Path:
    """10 steps from `weights` (init_from: a run's model.safetensors or an FSDP run's distributed checkpoint), in one
    process or on 2 FSDP ranks."""
    init = [*DIGITS_DDP, "trainer.max_duration=10st", "checkpoint=none", f"init_from={weights()}"]
    return (two_ranks if "distributed=fsdp" in overrides else single)(root, name, *init, *overrides)


def step_20(fsdp: Future) -> Path:
    """The FSDP run's step-20 checkpoint: each rank's shards, DCP's files."""
    (run_dir,) = fsdp.result()["run_dir"]
    return run_dir / "checkpoints" / "step-00000020"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs); the resumes wait for the FSDP run, init_from for the one-process run."""
    clipped_fsdp = [*CLIPPED, "distributed=fsdp", "data.batch_size=8", "trainer.accumulate_grad_batches=2"]

    def final() -> Path:
        return runs["one"].result() / "model.safetensors"

    def dcp() -> Path:
        return step_20(runs["fsdp"])

    return {
        "fsdp": lambda: fsdp_run(root),
        "clipped_fsdp": lambda: two_ranks(root, "clipped_fsdp", *clipped_fsdp),
        "one": lambda: single(root, "one", *DIGITS_DDP, "data.batch_size=32", "trainer.max_duration=40st"),
        "clipped_one": lambda: single(root, "clipped_one", *CLIPPED, "data.batch_size=32"),
        "resumed": lambda: resumed_under_fsdp(root, runs["fsdp"]),
        "resumed_one": lambda: resumed_in_one_process(root, runs["fsdp"]),
        "init_fsdp": lambda: initialised(root, "init_fsdp", final, "distributed=fsdp", "data.batch_size=16"),
        "init_one": lambda: initialised(root, "init_one", final, "data.batch_size=32"),
        "dcp_fsdp": lambda: initialised(root, "dcp_fsdp", dcp, "distributed=fsdp", "data.batch_size=16"),
        "dcp_one": lambda: initialised(root, "dcp_one", dcp, "data.batch_size=32"),
    }


def test_fsdp_trains_like_one_process_with_exact_counts(runs: dict[str, Future]) -> None:
    fsdp = runs["fsdp"].result()
    assert "fsdp (full shard), backend gloo, 2 rank(s) per node" in fsdp["stderr"]  # the startup table, once
    assert fsdp["stderr"].count("global batch") == 1
    (run_dir,) = fsdp["run_dir"]  # one run folder for the job, not one per rank
    progress = summary(run_dir)["progress"]
    assert progress["step"] == 40 and progress["samples"] == 40 * 32 and progress["micro_batch"] == 40
    one = runs["one"].result()
    assert_close_weights(run_dir, one, atol=ATOL)  # gathered to full tensors, under the bare model's names
    # validation goes through the sharded root (its parameters gathered), reduced over both ranks' shards of data
    val, val_one = ([r["val/loss"] for r in metric_rows(d) if "val/loss" in r] for d in (run_dir, one))
    assert len(val) == 4 and val == pytest.approx(val_one, abs=1e-5)
    norms = [[r["train/param_norm"] for r in metric_rows(d) if "train/param_norm" in r] for d in (run_dir, one)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # over both ranks' shards, not this rank's


def test_fsdp_clips_on_the_global_gradient_norm(runs: dict[str, Future]) -> None:
    fsdp, one = runs["clipped_fsdp"].result(), runs["clipped_one"].result()
    rows = [metric_rows(d) for d in (fsdp, one)]
    norms = [[r["train/grad_norm"] for r in run if "train/grad_norm" in r] for run in rows]
    assert min(norms[1]) > 0.05  # clipping was active at every step
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert_close_weights(fsdp, one, atol=ATOL)
    val = [[r["val/loss"] for r in run if "val/loss" in r] for run in rows]
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], abs=1e-5)


def test_fsdp_resumed_from_a_checkpoint_equals_the_uninterrupted_run(runs: dict[str, Future]) -> None:
    (run_dir,) = runs["fsdp"].result()["run_dir"]
    resumed = runs["resumed"].result()
    assert resumed["stderr"].count("resuming from") == 1 and "step-00000020" in resumed["stderr"]
    # Bit-identical: the checkpoint holds the exact float32 weights and Adam moments, each rank takes back the same
    # shards, the same RNG states and data positions, and gloo's reductions run in a fixed order.
    assert_same_weights(resumed["run_dir"], run_dir)
    assert metric_rows(resumed["run_dir"]) == metric_rows(run_dir)


def test_an_fsdp_checkpoint_resumes_in_one_process(runs: dict[str, Future]) -> None:
    # The files are full tensors in one process's format (the optimizer's states by parameter index): one process with
    # the same global batch continues the FSDP run from step 20 to the same weights (rounding aside: see ATOL).
    (run_dir,) = runs["fsdp"].result()["run_dir"]
    assert_close_weights(runs["resumed_one"].result(), run_dir, atol=ATOL)


def test_an_fsdp_init_from_built_without_storage_trains_as_one_process(runs: dict[str, Future]) -> None:
    # each rank builds the task's parameters on the meta device and reads only its shards' slices of the file
    # (tests/unit/test_meta_build.py): the same start, hence the same training, as one process reading it whole
    fsdp, one = runs["init_fsdp"].result(), runs["init_one"].result()
    assert "init_from: loaded" in (fsdp / "runner.log").read_text()
    assert_close_weights(fsdp, one, atol=ATOL)
    val, val_one = ([r["val/loss"] for r in metric_rows(d) if "val/loss" in r] for d in (fsdp, one))
    assert len(val) == 1 and val == pytest.approx(val_one, abs=1e-5)


def test_an_fsdp_init_from_a_distributed_checkpoint_trains_as_one_process(runs: dict[str, Future]) -> None:
    # the 2 ranks read the checkpoint's model through DCP's own load, each into its shards (one process: whole)
    fsdp, one = runs["dcp_fsdp"].result(), runs["dcp_one"].result()
    assert "init_from: loaded" in (fsdp / "runner.log").read_text()
    assert_close_weights(fsdp, one, atol=ATOL)
