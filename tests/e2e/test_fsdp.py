"""FSDP2 (`fully_shard`) for real on the CPU: torchrun, 2 processes, gloo. The same training as one process, the global
gradient norm for clipping, `init_from` read into shards, and distributed checkpoints (checkpoint.format=dcp, the
default under fsdp): each rank writes its own shards; a resume on the same ranks is bit for bit; a checkpoint of 2
ranks resumes in one process as the uninterrupted run there (4 -> 2 and across meshes: test_hsdp); a rank killed
mid-save, the whole job SIGKILLed while an async save is in flight, or a full disk on rank 1 alone leaves the previous
checkpoint whole and nothing half-visible, and resume=auto continues from it to the uninterrupted run's weights; a
damaged shard is one paragraph naming it and its rank, exit 2. The trials share one uninterrupted 2-rank run (`fsdp`)
and its one-process twin (`one`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
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
    child_env,
    cli,
    error_lines,
    explain,
    metric_rows,
    ok,
    read_json,
    split_at_first_checkpoint,
    summary,
    torchrun,
    worker_exit_codes,
)

from runner.ckpt.files import checkpoints

# 20 steps of 2 x 16 samples stay inside the first epoch (1438 samples), where 1 x 32 sees the same batches; a
# checkpoint every 10 steps, all kept
STEPS = [*DIGITS_DDP, "trainer.max_duration=20st", "checkpoint.interval=10st", "checkpoint.keep_last=10"]
FSDP = [*STEPS, "distributed=fsdp", "data.batch_size=16"]
ONE = [*STEPS, "data.batch_size=32"]
# SGD: its step is proportional to the clipped gradient, so a per-shard norm (a different factor on each rank) would
# show in the weights; AdamW would nearly cancel a constant factor. Accumulation: FSDP's no-sync path. Affine
# (tests/_tasks.py): every parameter in the root, used outside forward(), so validation must gather them itself.
CLIPPED = [*DIGITS_DDP, "model._target_=_tasks.Affine", "optimizer=sgd", "trainer.gradient_clip_val=0.05"]
CLIPPED += ["trainer.max_duration=20st"]
# the kill trials' callbacks (tests/_dcp_ranks.py)
KILL = ["checkpoint._target_=_dcp_ranks.KillMidSave", "+checkpoint.kill_folder=step-00000020"]
HOLD = ["checkpoint._target_=_dcp_ranks.HoldSeal", "+checkpoint.hold_folder=step-00000020", "checkpoint.async=true"]
FULL = ["+callbacks.full._target_=_dcp_ranks.FullDiskOnRank", "+callbacks.full.step=12", "+callbacks.full.rank=1"]
# Tolerance: as in the DDP test, the runs sum the same 32 per-sample gradients in another order (a reduce-scatter of
# two means of 16 vs one mean of 32): float32 rounding, amplified by AdamW for near-zero gradients; 1e-5 is far below
# one step's change (~1e-3).
ATOL = 1e-5
CHANGED = "resume_allow_changes=true"


def fsdp_run(root: Path) -> dict[str, Any]:
    """20 FSDP steps of 2 x 16 samples with an async checkpoint every 10 steps (all kept), in a folder of its own
    choosing."""
    (root / "fsdp").mkdir()
    done = ok(torchrun(*FSDP, "checkpoint.async=true", cwd=root / "fsdp"))
    return {"stderr": done.stderr, "run_dir": list((root / "fsdp" / "outputs").glob("*/*"))}


def fsdp_dir(fsdp: Future) -> Path:
    """The FSDP run's folder."""
    (run_dir,) = fsdp.result()["run_dir"]
    return run_dir


def ranks(root: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    """2 ranks of torchrun in the run folder `name`."""
    return torchrun(*overrides, f"hydra.run.dir={root / name}", cwd=root)


def trained(root: Path, name: str, *overrides: str) -> Path:
    ok(ranks(root, name, *overrides))
    return root / name


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*overrides, cwd=root, run_dir=root / name))
    return root / name


def first_checkpoint(run_dir: Path) -> str:
    return f"resume={checkpoints(run_dir / 'checkpoints')[-1]}"


def resumed_under_fsdp(root: Path, fsdp: Future) -> dict[str, Any]:
    """The FSDP run as it stood when its step-10 checkpoint was written, resumed on 2 ranks."""
    run_dir = split_at_first_checkpoint(fsdp_dir(fsdp), root / "resumed")
    return {"stderr": ok(ranks(root, run_dir.name, *FSDP, "resume=auto")).stderr, "run_dir": run_dir}


def initialised(root: Path, name: str, weights: Callable[[], Path], *overrides: str) -> Path:
    """10 steps from `weights` (init_from: a run's model.safetensors or an FSDP run's distributed checkpoint), in one
    process or on 2 FSDP ranks."""
    init = [*DIGITS_DDP, "trainer.max_duration=10st", "checkpoint=none", f"init_from={weights()}"]
    return (trained if "distributed=fsdp" in overrides else single)(root, name, *init, *overrides)


def _staged(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name != "last")


def rank_killed(root: Path) -> dict[str, Any]:
    """Rank 1 SIGKILLed in the middle of the step-20 save, then the run resumed on 2 ranks."""
    folder = root / "rank_killed"
    done = ranks(root, folder.name, *FSDP, *KILL)
    left = sorted(p.name for p in (folder / "checkpoints").iterdir())
    resumed = ranks(root, folder.name, *FSDP, "resume=auto")
    return {"rc": done.returncode, "left": left, "resumed": resumed, "dir": folder}


def job_killed(root: Path) -> dict[str, Any]:
    """The job (launcher and both workers) SIGKILLed while both ranks' async save of step 20 is in flight; resumed."""
    folder = root / "job_killed"
    args = [sys.executable, *TORCHRUN, "-m", "runner", *FSDP, *HOLD, f"hydra.run.dir={folder}"]
    job = subprocess.Popen(args, cwd=root, env=child_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not all((folder / f"held-rank-{r}").exists() for r in range(2)):
            assert job.poll() is None, f"exited ({job.returncode}) before the save:\n{job.communicate()[1][-3000:]}"
            time.sleep(0.2)
        # torchrun starts each worker in a session of its own: the launcher's group, then each worker's
        workers = [int(pid) for pid in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
        for group in [job.pid, *workers]:
            os.killpg(group, signal.SIGKILL)
    finally:
        job.kill()
        job.communicate()
    left = _staged(folder)
    resumed = ranks(root, folder.name, *FSDP, "resume=auto")
    return {"rc": job.returncode, "left": left, "resumed": resumed, "dir": folder}


def disk_full(root: Path) -> dict[str, Any]:
    """Rank 1's disk full from step 12 (a sync DCP save at step 20), then resumed with room again."""
    failed = ranks(root, "full", *FSDP, *FULL)
    stopped, left = summary(root / "full"), _staged(root / "full")
    resumed = ranks(root, "full", *FSDP, *FULL, "resume=auto")
    return {"failed": failed, "summary": stopped, "left": left, "resumed": resumed, "dir": root / "full"}


def corrupt(root: Path, fsdp: Future) -> subprocess.CompletedProcess:
    folder = root / "corrupt"
    shutil.copytree(fsdp_dir(fsdp) / "checkpoints" / "step-00000010", folder)
    shard = bytearray((folder / "__1_0.distcp").read_bytes())
    shard[100] ^= 0xFF
    (folder / "__1_0.distcp").write_bytes(bytes(shard))
    return cli(*ONE, f"resume={folder}", CHANGED, cwd=root, run_dir=root / "corrupt_run")


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs): those that wait for another run (a resume, init_from) come last."""
    clipped_fsdp = [*CLIPPED, "distributed=fsdp", "data.batch_size=8", "trainer.accumulate_grad_batches=2"]
    resume = [*FSDP, "resume=auto"]

    def final() -> Path:
        return runs["one"].result() / "model.safetensors"

    def dcp() -> Path:
        """The FSDP run's step-20 checkpoint: each rank's shards, DCP's files."""
        return fsdp_dir(runs["fsdp"]) / "checkpoints" / "step-00000020"

    return {
        "fsdp": lambda: fsdp_run(root),
        "one": lambda: single(root, "one", *ONE),
        "clipped_fsdp": lambda: trained(root, "clipped_fsdp", *clipped_fsdp),
        "clipped_one": lambda: single(root, "clipped_one", *CLIPPED, "data.batch_size=32"),
        "rank_killed": lambda: rank_killed(root),
        "job_killed": lambda: job_killed(root),
        "disk_full": lambda: disk_full(root),
        # a checkpoint in the gathered format (an older run's), resumed under the dcp default
        "files": lambda: trained(root, "files", *FSDP, "checkpoint.format=files"),
        "resumed": lambda: resumed_under_fsdp(root, runs["fsdp"]),
        "two_to_one": lambda: single(root, "two_to_one", *ONE, CHANGED, first_checkpoint(fsdp_dir(runs["fsdp"]))),
        "corrupt": lambda: corrupt(root, runs["fsdp"]),
        "files_to_dcp": lambda: trained(
            root, split_at_first_checkpoint(runs["files"].result(), root / "files_to_dcp").name, *resume
        ),
        "init_fsdp": lambda: initialised(root, "init_fsdp", final, "distributed=fsdp", "data.batch_size=16"),
        "init_one": lambda: initialised(root, "init_one", final, "data.batch_size=32"),
        "dcp_fsdp": lambda: initialised(root, "dcp_fsdp", dcp, "distributed=fsdp", "data.batch_size=16"),
        "dcp_one": lambda: initialised(root, "dcp_one", dcp, "data.batch_size=32"),
    }


# ---- training -----------------------------------------------------------------------------------------------------
def test_fsdp_trains_like_one_process_with_exact_counts(runs: dict[str, Future]) -> None:
    fsdp = runs["fsdp"].result()
    assert "fsdp (full shard), backend gloo, 2 rank(s) per node" in fsdp["stderr"]  # the startup table, once
    assert fsdp["stderr"].count("global batch") == 1
    (run_dir,) = fsdp["run_dir"]  # one run folder for the job, not one per rank
    progress = summary(run_dir)["progress"]
    assert progress["step"] == 20 and progress["samples"] == 20 * 32 and progress["micro_batch"] == 20
    one = runs["one"].result()
    assert_close_weights(run_dir, one, atol=ATOL)  # gathered to full tensors, under the bare model's names
    # validation goes through the sharded root (its parameters gathered), reduced over both ranks' shards of data
    val, val_one = ([r["val/loss"] for r in metric_rows(d) if "val/loss" in r] for d in (run_dir, one))
    assert len(val) == 2 and val == pytest.approx(val_one, abs=1e-5)
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


# ---- distributed checkpoints --------------------------------------------------------------------------------------
def test_each_rank_writes_its_own_shards_and_the_manifest_seals_them(runs: dict[str, Future]) -> None:
    run_dir = fsdp_dir(runs["fsdp"])
    folder = checkpoints(run_dir / "checkpoints")[0]
    manifest = read_json(folder / "manifest.json")
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    expected = {".metadata", "__0_0.distcp", "__1_0.distcp", "shared.pt", "rank-0.pt", "rank-1.pt"}
    assert set(manifest["files"]) == expected == {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert (run_dir / "model.safetensors").is_file()  # the final weights, gathered into one file


def test_fsdp_resumed_from_a_checkpoint_equals_the_uninterrupted_run(runs: dict[str, Future]) -> None:
    run_dir = fsdp_dir(runs["fsdp"])
    resumed = runs["resumed"].result()
    assert resumed["stderr"].count("resuming from") == 1 and "step-00000010" in resumed["stderr"]
    # Bit-identical: the checkpoint holds the exact float32 weights and Adam moments, each rank takes back the same
    # shards, the same RNG states and data positions, and gloo's reductions run in a fixed order.
    assert_same_weights(resumed["run_dir"], run_dir)
    assert metric_rows(resumed["run_dir"]) == metric_rows(run_dir)


def test_an_fsdp_checkpoint_resumes_in_one_process(runs: dict[str, Future]) -> None:
    # The files are full tensors in one process's format (the optimizer's states by parameter index): one process with
    # the same global batch continues the FSDP run from step 10 to the same weights (rounding aside: see ATOL).
    assert_close_weights(runs["two_to_one"].result(), fsdp_dir(runs["fsdp"]), atol=ATOL)


def test_a_checkpoint_of_2_ranks_resumes_in_one_process_as_the_one_process_run(runs: dict[str, Future]) -> None:
    assert_close_weights(runs["two_to_one"].result(), runs["one"].result(), atol=ATOL)


def test_a_damaged_shard_is_one_paragraph_naming_it_and_its_rank(runs: dict[str, Future]) -> None:
    done = runs["corrupt"].result()
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "__1_0.distcp (written by rank 1) does not match its sha256" in errors[0]


def test_a_checkpoint_in_the_gathered_format_resumes_under_the_dcp_default(runs: dict[str, Future]) -> None:
    whole, resumed = runs["files"].result(), runs["files_to_dcp"].result()
    assert_same_weights(resumed, whole)
    assert metric_rows(resumed) == metric_rows(whole)
    formats = [read_json(folder / "manifest.json").get("format") for folder in checkpoints(resumed / "checkpoints")]
    assert formats[0] == "dcp" and formats[-1] != "dcp", formats  # newest first: written here; step 10: the old one


# ---- kill trials: each resumes from step 10 to the uninterrupted run's weights ------------------------------------
def _resumed_from_step_10(outcome: dict[str, Any], reference: Path) -> None:
    resumed = ok(outcome["resumed"])
    assert resumed.stderr.count("resuming from") == 1 and "step-00000010" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_weights(outcome["dir"], reference)
    assert not [n for n in _staged(outcome["dir"]) if ".partial-" in n]  # the resume cleared the staging folder
    assert [n for n in _staged(outcome["dir"]) if n.startswith("step-")] == ["step-00000010", "step-00000020"]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_to_resume_from(runs: dict[str, Future]) -> None:
    outcome = runs["rank_killed"].result()
    assert outcome["rc"] != 0
    # the step-20 save never became a checkpoint: a staging folder at most, which the resume clears
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    resumed = ok(outcome["resumed"])
    assert "resuming from" in resumed.stderr and "step-00000010" in resumed.stderr
    run_dir = outcome["dir"]
    assert_same_weights(run_dir, fsdp_dir(runs["fsdp"]))
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".partial-" in p.name]


def test_the_whole_job_killed_mid_async_save_leaves_the_previous_checkpoint_to_resume_from(
    runs: dict[str, Future],
) -> None:
    outcome = runs["job_killed"].result()
    assert outcome["rc"] != 0
    # step 20 was being written (its staging folder) and never became a checkpoint
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    assert [n for n in outcome["left"] if n.startswith(".step-00000020.partial-")], outcome["left"]
    _resumed_from_step_10(outcome, fsdp_dir(runs["fsdp"]))


def test_a_full_disk_on_rank_1_alone_exits_2_with_one_paragraph_naming_its_file(runs: dict[str, Future]) -> None:
    outcome = runs["disk_full"].result()
    failed = outcome["failed"]
    assert failed.returncode != 0 and worker_exit_codes(failed.stderr) == [2, 2], explain(failed)
    errors = error_lines(failed.stderr)
    assert len(errors) == 2, failed.stderr[-4000:]
    for said in ("[rank0]:", "[rank1]:", "runner/__main__.py"):  # torchrun's own traceback only, no worker's
        assert said not in failed.stderr, failed.stderr[-4000:]
    assert "error: stopped because rank 1 stopped (exit 2; its message says why)" in errors, errors
    paragraph = next(e for e in errors if "disk full" in e)
    assert "step-00000020" in paragraph and "__1_0.distcp" in paragraph and "rank 1" in paragraph, paragraph
    assert "resume=auto" in paragraph, paragraph
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    assert outcome["summary"]["stop_reason"] == "failed"


def test_the_run_stopped_by_one_rank_s_full_disk_resumes_bit_exact(runs: dict[str, Future]) -> None:
    _resumed_from_step_10(runs["disk_full"].result(), fsdp_dir(runs["fsdp"]))
