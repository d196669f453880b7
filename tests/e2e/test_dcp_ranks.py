"""Distributed checkpoints (checkpoint.format=dcp, the default under fsdp and spread) for real on gloo ranks: each rank
writes its own shards; a resume on the same ranks is bit for bit; a checkpoint of N ranks resumes on M (4 -> 2, 2 -> 1)
as the uninterrupted run on M; a rank killed mid-save leaves the previous checkpoint to resume from; a damaged shard is
one paragraph naming it and its rank, exit 2."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

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
)

from runner.ckpt.files import checkpoints

# 20 steps of a global batch of 32 (inside the first epoch), a checkpoint every 10, all kept
STEPS = [*DIGITS_DDP, "trainer.max_duration=20st", "checkpoint.interval=10st", "checkpoint.keep_last=10"]
# a family of SAEs spread over the ranks (tests/e2e/test_spread.py's synthetic preset), with checkpoints
SPREAD = [
    "+experiment=sae",
    "model=sae_multi",
    "model.ks=[2,4]",
    "model.base.n_latents=64",
    "data.splits.d=16",
    "data.splits.n_features=32",
    "data.splits.n_val=257",
    "data.val_batch_size=128",
    "data.batch_size=64",
    "trainer.max_duration=20st",
    "trainer.val_interval=10st",
    "checkpoint.interval=10st",
    "checkpoint.keep_last=10",
    "logger=jsonl",
    "distributed=spread",
]
ATOL = 1e-5  # as tests/e2e/test_fsdp.py: the same gradients summed in another order


def ranks(root: Path, name: str, n: int, *overrides: str, check: bool = True) -> Any:
    args = [*TORCHRUN[:-1], f"--nproc_per_node={n}", "-m", "runner", *overrides, f"hydra.run.dir={root / name}"]
    done = python(*args, cwd=root)
    return (ok(done) and root / name) if check else done


def split(root: Path, source: Future, name: str) -> Path:
    """A copy of a finished run as it stood after its step-10 checkpoint (a crash right after it)."""
    shutil.copytree(source.result(), root / name, symlinks=True)
    for later in checkpoints(root / name / "checkpoints")[:-1]:
        shutil.rmtree(later)
    (root / name / "model.safetensors").unlink()
    return root / name


def killed(root: Path) -> dict[str, Any]:
    """Rank 1 SIGKILLed in the middle of the step-20 save, then the run resumed on 2 ranks."""
    kill = ["checkpoint._target_=_dcp_ranks.KillMidSave", "+checkpoint.kill_folder=step-00000020"]
    fsdp = [*STEPS, "distributed=fsdp", "data.batch_size=16"]
    done = ranks(root, "killed", 2, *fsdp, *kill, check=False)
    left = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    resumed = ranks(root, "killed", 2, *fsdp, "resume=auto", check=False)
    return {"rc": done.returncode, "left": left, "resumed": resumed}


def corrupt(root: Path, fsdp: Future) -> Any:
    folder = root / "corrupt"
    shutil.copytree(fsdp.result() / "checkpoints" / "step-00000010", folder)
    shard = bytearray((folder / "__1_0.distcp").read_bytes())
    shard[100] ^= 0xFF
    (folder / "__1_0.distcp").write_bytes(bytes(shard))
    args = [*STEPS, "data.batch_size=32", f"resume={folder}", "resume_allow_changes=true"]
    return cli(*args, cwd=root, run_dir=root / "corrupt_run")


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*STEPS, "data.batch_size=32", *overrides, cwd=root, run_dir=root / name))
    return root / name


def first_checkpoint(run: Future) -> str:
    return f"resume={checkpoints(run.result() / 'checkpoints')[-1]}"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs); the resumes wait for the runs they resume."""
    two = [*STEPS, "distributed=fsdp", "data.batch_size=16"]
    changed = "resume_allow_changes=true"
    return {
        "fsdp": lambda: ranks(root, "fsdp", 2, *two, "checkpoint.async=true"),
        "fsdp4": lambda: ranks(root, "fsdp4", 4, *STEPS, "distributed=fsdp", "data.batch_size=8"),
        "one": lambda: single(root, "one"),
        "spread": lambda: ranks(root, "spread", 2, *SPREAD),
        "resumed": lambda: ranks(root, split(root, runs["fsdp"], "resumed").name, 2, *two, "resume=auto"),
        "four_to_two": lambda: ranks(root, "four_to_two", 2, *two, changed, first_checkpoint(runs["fsdp4"])),
        "two_to_one": lambda: single(root, "two_to_one", changed, first_checkpoint(runs["fsdp"])),
        "spread_resumed": lambda: ranks(
            root, split(root, runs["spread"], "spread_resumed").name, 2, *SPREAD, "resume=auto"
        ),
        "killed": lambda: killed(root),
        "corrupt": lambda: corrupt(root, runs["fsdp"]),
        # a checkpoint in the gathered format (an older run's), resumed under the dcp default
        "files": lambda: ranks(root, "files", 2, *two, "checkpoint.format=files"),
        "files_to_dcp": lambda: ranks(root, split(root, runs["files"], "files_to_dcp").name, 2, *two, "resume=auto"),
    }


def test_each_rank_writes_its_own_shards_and_the_manifest_seals_them(runs: dict[str, Future]) -> None:
    folder = checkpoints(runs["fsdp"].result() / "checkpoints")[0]
    manifest = read_json(folder / "manifest.json")
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    expected = {".metadata", "__0_0.distcp", "__1_0.distcp", "shared.pt", "rank-0.pt", "rank-1.pt"}
    assert set(manifest["files"]) == expected == {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert (runs["fsdp"].result() / "model.safetensors").is_file()  # the final weights, gathered as before


def test_a_same_world_resume_is_bit_for_bit_under_fsdp_and_spread(runs: dict[str, Future]) -> None:
    for whole, resumed in (("fsdp", "resumed"), ("spread", "spread_resumed")):
        assert_same_weights(runs[resumed].result(), runs[whole].result())
        assert metric_rows(runs[resumed].result()) == metric_rows(runs[whole].result()), resumed


def test_a_checkpoint_of_n_ranks_resumes_on_m_as_the_uninterrupted_run_on_m(runs: dict[str, Future]) -> None:
    assert_close_weights(runs["four_to_two"].result(), runs["fsdp"].result(), atol=ATOL)
    assert_close_weights(runs["two_to_one"].result(), runs["one"].result(), atol=ATOL)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_to_resume_from(runs: dict[str, Future]) -> None:
    outcome = runs["killed"].result()
    assert outcome["rc"] != 0
    # the step-20 save never became a checkpoint: a staging folder at most, which the resume clears
    assert [n for n in outcome["left"] if n.startswith("step-")] == ["step-00000010"], outcome["left"]
    resumed = ok(outcome["resumed"])
    assert "resuming from" in resumed.stderr and "step-00000010" in resumed.stderr
    run_dir = runs["fsdp"].result().parent / "killed"
    assert_same_weights(run_dir, runs["fsdp"].result())
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".partial-" in p.name]


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
