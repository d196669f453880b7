"""HSDP (distributed=hsdp) for real on 4 gloo ranks as a 2 x 2 mesh: the same training as 4-rank FSDP and one process
(losses, validation, the clipped gradient norm, the weights); its distributed checkpoints resume bit for bit on the
same mesh and resharded between FSDP(4), HSDP(2x2), FSDP(2) and one process. And the final model.safetensors,
streamed tensor by tensor, is byte for byte the file gathered whole on rank 0 (under fsdp on 2 ranks, and under
hsdp)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    DIGITS_DDP,
    TORCHRUN,
    assert_close_weights,
    assert_same_weights,
    cli,
    metric_rows,
    ok,
    python,
    read_json,
    split_at_first_checkpoint,
    weights,
)
from safetensors.torch import load_file

from runner.ckpt.files import checkpoints

# 20 SGD steps of a global batch of 32 (inside the first epoch), clipped at every step: a norm computed over one mesh
# dimension only would scale each rank's step differently and show in the weights. A checkpoint every 10, all kept.
TRAINED = [*DIGITS_DDP, "optimizer=sgd", "trainer.gradient_clip_val=0.05", "trainer.max_duration=20st"]
STEPS = [*TRAINED, "checkpoint.interval=10st", "checkpoint.keep_last=10"]
HSDP = ["distributed=hsdp", "distributed.replicate=2", "data.batch_size=8"]
FSDP4 = ["distributed=fsdp", "data.batch_size=8"]
GATHERED = ["+callbacks.gathered._target_=_hsdp_ranks.GatheredWeights"]  # RUN_DIR/gathered.safetensors
# RUN_DIR/initial.safetensors: the weights before the first step, gathered
INITIAL = [f"+callbacks.initial.{k}" for k in ("_target_=_hsdp_ranks.GatheredWeights", "name=initial.safetensors")]
INITIAL.append("+callbacks.initial.at=start")
CHANGED = "resume_allow_changes=true"  # another distributed option: the same training on another mesh
ATOL = 1e-5  # as tests/e2e/test_fsdp.py: the same gradients summed in another order


def ranks(root: Path, name: str, n: int, *overrides: str) -> Path:
    args = [*TORCHRUN[:-1], f"--nproc_per_node={n}", "-m", "runner", *overrides, f"hydra.run.dir={root / name}"]
    ok(python(*args, cwd=root))
    return root / name


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*STEPS, "data.batch_size=32", *overrides, cwd=root, run_dir=root / name))
    return root / name


def step_10(run: Future) -> str:
    return f"resume={checkpoints(run.result() / 'checkpoints')[-1]}"


def init_from(one: Future) -> list[str]:
    """init_from the one-process run's final weights: every rank builds the task empty and reads its own block."""
    return ["checkpoint=none", f"init_from={one.result() / 'model.safetensors'}"]


def initialised_in_one_process(root: Path, one: Future) -> Path:
    """TRAINED from the one-process run's final weights in one process, at the same global batch."""
    ok(cli(*TRAINED, "data.batch_size=32", *init_from(one), cwd=root, run_dir=root / "one_init"))
    return root / "one_init"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs); the resumes wait for the runs they resume."""
    fsdp2 = [*STEPS, "distributed=fsdp", "data.batch_size=16"]  # the uninterrupted run on 2 ranks
    return {
        "hsdp": lambda: ranks(root, "hsdp", 4, *STEPS, *HSDP, *GATHERED),
        "fsdp4": lambda: ranks(root, "fsdp4", 4, *STEPS, *FSDP4),
        "one": lambda: single(root, "one"),
        "fsdp2": lambda: ranks(root, "fsdp2", 2, *fsdp2, *GATHERED),
        "resumed": lambda: ranks(
            root,
            split_at_first_checkpoint(runs["hsdp"].result(), root / "resumed").name,
            4,
            *STEPS,
            *HSDP,
            *GATHERED,
            "resume=auto",
        ),
        "fsdp_to_hsdp": lambda: ranks(root, "fsdp_to_hsdp", 4, *STEPS, *HSDP, CHANGED, step_10(runs["fsdp4"])),
        "hsdp_to_fsdp": lambda: ranks(root, "hsdp_to_fsdp", 4, *STEPS, *FSDP4, CHANGED, step_10(runs["hsdp"])),
        "hsdp_to_one": lambda: single(root, "hsdp_to_one", CHANGED, step_10(runs["hsdp"])),
        "fsdp4_to_fsdp2": lambda: ranks(root, "fsdp4_to_fsdp2", 2, *fsdp2, CHANGED, step_10(runs["fsdp4"])),
        "hsdp_init": lambda: ranks(root, "hsdp_init", 4, *TRAINED, *HSDP, *init_from(runs["one"]), *INITIAL),
        "one_init": lambda: initialised_in_one_process(root, runs["one"]),
    }


def column(run_dir: Path, key: str) -> list[float]:
    return [row[key] for row in metric_rows(run_dir) if key in row]


def test_hsdp_trains_like_fsdp_and_one_process(runs: dict[str, Future]) -> None:
    hsdp, fsdp4, one = (runs[name].result() for name in ("hsdp", "fsdp4", "one"))
    assert "hsdp (2 replicas x 2 shards, full shard)" in (hsdp / "runner.log").read_text()
    assert read_json(hsdp / "summary.json")["progress"]["samples"] == 20 * 32
    assert min(column(one, "train/grad_norm")) > 0.05  # clipping was active at every step
    for other in (fsdp4, one):
        for key in ("train/grad_norm", "train/param_norm", "train/loss"):
            assert column(hsdp, key) == pytest.approx(column(other, key), rel=1e-5), key
        assert column(hsdp, "val/loss") == pytest.approx(column(other, "val/loss"), abs=1e-5)
        assert_close_weights(hsdp, other, atol=ATOL)


def test_an_hsdp_checkpoint_resumes_bit_for_bit_on_the_same_mesh(runs: dict[str, Future]) -> None:
    folder = checkpoints(runs["hsdp"].result() / "checkpoints")[-1]
    manifest = read_json(folder / "manifest.json")
    assert manifest["format"] == "dcp" and manifest["world_size"] == 4
    assert_same_weights(runs["resumed"].result(), runs["hsdp"].result())
    assert metric_rows(runs["resumed"].result()) == metric_rows(runs["hsdp"].result())


def test_checkpoints_reshard_between_fsdp_hsdp_and_one_process(runs: dict[str, Future]) -> None:
    assert_close_weights(runs["fsdp_to_hsdp"].result(), runs["hsdp"].result(), atol=ATOL)
    assert_close_weights(runs["hsdp_to_fsdp"].result(), runs["fsdp4"].result(), atol=ATOL)
    assert_close_weights(runs["hsdp_to_one"].result(), runs["one"].result(), atol=ATOL)
    # 4 FSDP ranks to 2: each rank takes back other slices of the weights and of SGD's momentum
    assert_close_weights(runs["fsdp4_to_fsdp2"].result(), runs["fsdp2"].result(), atol=ATOL)


def test_streamed_final_weights_are_the_bytes_of_the_gathered_file(runs: dict[str, Future]) -> None:
    for name in ("fsdp2", "hsdp", "resumed"):
        run_dir = runs[name].result()
        streamed = (run_dir / "model.safetensors").read_bytes()
        assert streamed == (run_dir / "gathered.safetensors").read_bytes(), name
        assert (run_dir / "model.safetensors.sha256").read_text().split()[1] == "model.safetensors"
    assert weights(runs["fsdp2"].result()).keys() == weights(runs["one"].result()).keys()


def test_an_hsdp_init_from_reads_the_file_s_weights_and_trains_as_one_process(runs: dict[str, Future]) -> None:
    # each rank of the 2 x 2 mesh builds the task's parameters on the meta device and reads only its block of the
    # file: gathered before the first step, the weights are the file's exactly; trained, they follow one process
    # reading the file whole (HSDP trains as FSDP(4) and one process: the first test)
    hsdp, one = runs["hsdp_init"].result(), runs["one_init"].result()
    file, initial = weights(runs["one"].result()), load_file(hsdp / "initial.safetensors")
    assert initial.keys() == file.keys() and all(initial[k].equal(file[k]) for k in file)
    assert "hsdp (2 replicas x 2 shards, full shard)" in (hsdp / "runner.log").read_text()
    for key in ("train/grad_norm", "train/loss"):
        assert column(hsdp, key) == pytest.approx(column(one, key), rel=1e-5), key
    assert_close_weights(hsdp, one, atol=ATOL)
