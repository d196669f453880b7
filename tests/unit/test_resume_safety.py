"""Resume never loses or silently changes a run: a finished checkpoint completes the final outputs, a changed config is
refused or applied and recorded, a broken manifest falls back, checkpoints sort by step."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import StopAt, read_json, summary, values

from runner.ckpt.callback import Checkpoint
from runner.ckpt.files import (
    CheckpointError,
    checkpoints,
    load_checkpoint,
    manifest_checksum,
    newest_valid,
    write_checkpoint,
)
from runner.run import Run
from runner.rundir import MODEL, SUMMARY
from runner.train import train

DIGITS = ("+experiment=digits", "trainer.max_duration=12st", "trainer.val_interval=3st", "logger=jsonl")


def _train(compose_cfg: Callable, run_dir: Path, *overrides: str, stop_at: int | None = None) -> Run:
    extra = [StopAt(stop_at)] if stop_at is not None else []
    return train(compose_cfg(*DIGITS, *overrides, run_dir=run_dir), extra_callbacks=extra)


# ---- a kill right after the final checkpoint ---------------------------------------------------------------------
def test_a_finished_checkpoint_lets_resume_write_the_final_outputs_again(compose_cfg: Callable, tmp_path: Path) -> None:
    # Early stopping with restore_best: the final weights are the best validation's, not the last step's.
    stopping = (
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=10",
        "trainer.val_interval=2st",
    )
    first = _train(compose_cfg, tmp_path, *stopping)
    assert first.stop_reason == "early_stopping" and first.progress.step == 4
    model, written = (tmp_path / MODEL).read_bytes(), summary(tmp_path)
    # What a SIGKILL between the final checkpoint and the outputs leaves: the checkpoint, no outputs.
    (tmp_path / MODEL).unlink()
    (tmp_path / SUMMARY).unlink()
    again = _train(compose_cfg, tmp_path, *stopping, "resume=auto")
    assert again.stop_reason == "early_stopping" and again.progress.step == 4
    assert (tmp_path / MODEL).read_bytes() == model  # the restored best weights, bit for bit
    rewritten = summary(tmp_path)
    for key in ("stop_reason", "progress", "metrics", "best", "nonfinite_steps"):
        assert rewritten[key] == written[key], key
    last_step_weights, _, _ = load_checkpoint(checkpoints(tmp_path / "checkpoints")[0])
    assert any(not torch.equal(last_step_weights[k], v) for k, v in again.task.state_dict().items())


# ---- a changed config on resume ------------------------------------------------------------------------------------
def test_a_resume_with_another_seed_is_refused_naming_the_change(compose_cfg: Callable, tmp_path: Path) -> None:
    _train(compose_cfg, tmp_path, stop_at=6)
    with pytest.raises(CheckpointError) as caught:
        _train(compose_cfg, tmp_path, "resume=auto", "seed=7")
    message = str(caught.value)
    assert "seed: 0 -> 7" in message and "data.seed: 0 -> 7" in message and "resume_allow_changes=true" in message
    assert not (tmp_path / "run-resumed-at-6.json").exists()


def test_settings_that_do_not_change_training_may_change_on_resume(compose_cfg: Callable, tmp_path: Path) -> None:
    _train(compose_cfg, tmp_path, stop_at=6)
    resumed = _train(compose_cfg, tmp_path, "resume=auto", "trainer.log_interval=3st", "logger=[jsonl,console]")
    assert resumed.progress.step == 12
    assert read_json(tmp_path / "run-resumed-at-6.json")["config_changes"] == {}


def test_an_allowed_new_learning_rate_is_applied_and_recorded(compose_cfg: Callable, tmp_path: Path) -> None:
    # A cosine schedule: from the resume on, every step's LR is the one a run started at the new LR has there.
    cosine = ("scheduler=cosine", "trainer.log_interval=1st", "callbacks.early_stopping.patience=100")
    _train(compose_cfg, tmp_path / "new", *cosine, "optimizer.lr=1e-2")
    _train(compose_cfg, tmp_path / "split", *cosine, stop_at=6)
    with pytest.raises(CheckpointError, match=r"optimizer.lr: 0.001 -> 0.01"):
        _train(compose_cfg, tmp_path / "split", *cosine, "resume=auto", "optimizer.lr=1e-2")
    _train(compose_cfg, tmp_path / "split", *cosine, "resume=auto", "optimizer.lr=1e-2", "resume_allow_changes=true")
    after = [(s, lr) for s, lr in values(tmp_path / "split", "train/lr") if s > 6]
    expected = [(s, lr) for s, lr in values(tmp_path / "new", "train/lr") if s > 6]
    assert [s for s, _ in after] == list(range(7, 13))
    assert [lr for _, lr in after] == pytest.approx([lr for _, lr in expected], rel=1e-12)
    changes = read_json(tmp_path / "split" / "run-resumed-at-6.json")["config_changes"]
    assert changes == {"optimizer.lr": [0.001, 0.01]}


# ---- a manifest that is not what it should be ---------------------------------------------------------------------
def _flip_files(text: str) -> str:
    return text.replace('"files"', '"filgs"', 1)


def _edit_step(text: str) -> str:
    manifest = json.loads(text)
    manifest["step"] += 1
    return json.dumps(manifest)


def _resealed_without_sizes(text: str) -> str:
    # consistent with its checksum, but its files lack sizes: only the structural check catches it
    manifest = json.loads(text)
    manifest["files"]["state.pt"] = {}
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    return json.dumps(manifest)


MANIFESTS = {
    "{}": lambda _: "{}",
    "[]": lambda _: "[]",
    "flipped files": _flip_files,
    "edited step": _edit_step,
    "resealed without sizes": _resealed_without_sizes,
}


@pytest.mark.parametrize("variant", list(MANIFESTS))
def test_a_broken_manifest_falls_back_to_the_previous_checkpoint(
    variant: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    _train(compose_cfg, tmp_path, "checkpoint.interval=4st", stop_at=8)
    newest, previous = checkpoints(tmp_path / "checkpoints")[:2]
    assert newest.name == "step-00000008"
    manifest = newest / "manifest.json"
    manifest.write_text(MANIFESTS[variant](manifest.read_text()))
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_checkpoint(newest)
    assert newest_valid(tmp_path / "checkpoints")[0] == previous
    if variant == "{}":  # and the real resume goes on from there, without a traceback
        resumed = _train(compose_cfg, tmp_path, "checkpoint.interval=4st", "resume=auto")
        assert resumed.progress.step == 12
        assert (tmp_path / f"run-resumed-at-{int(previous.name.split('-')[1])}.json").exists()


# ---- step numbers past eight digits --------------------------------------------------------------------------------
def test_checkpoints_sort_and_rotate_by_step_number_past_eight_digits(tmp_path: Path) -> None:
    weights, state = {"w": torch.zeros(2)}, {"x": torch.ones(1)}
    for step in (99_999_998, 99_999_999, 100_000_000):
        write_checkpoint(tmp_path / f"step-{step:08d}", weights, state, {"step": step, "monitor_value": None})
    assert [p.name for p in checkpoints(tmp_path)] == ["step-100000000", "step-99999999", "step-99999998"]
    saver = Checkpoint(str(tmp_path), keep_last=2, keep_best=0)
    saver.write(tmp_path / "step-100000001", weights, state, {"step": 100_000_001, "monitor_value": None})
    assert saver.error is None
    assert [p.name for p in checkpoints(tmp_path)] == ["step-100000001", "step-100000000"]  # the newest two survive
    assert (tmp_path / "last").resolve().name == "step-100000001"


def test_a_truncated_state_with_a_matching_manifest_is_reported_as_truncated(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    _train(compose_cfg, tmp_path, "checkpoint.interval=12st")
    folder = checkpoints(tmp_path / "checkpoints")[0]
    state = (folder / "state.pt").read_bytes()[:-200]
    (folder / "state.pt").write_bytes(state)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": len(state), "sha256": hashlib.sha256(state).hexdigest()}
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="state.pt cannot be read: truncated or not written by torch.save"):
        load_checkpoint(folder)


# ---- a resumed launch's rate is its own ---------------------------------------------------------------------------
def test_a_resumed_launch_reports_its_own_rate_and_the_total_wall_time(compose_cfg: Callable, tmp_path: Path) -> None:
    first = _train(compose_cfg, tmp_path, stop_at=6)
    samples_at_6 = first.progress.samples
    resumed = _train(compose_cfg, tmp_path, "resume=auto")
    written = summary(tmp_path)
    trained_here = resumed.progress.samples - samples_at_6
    assert written["samples_per_s"] * written["wall_time_s"] == pytest.approx(trained_here)
    assert written["total_wall_time_s"] > written["wall_time_s"]  # plus the first launch's, from its checkpoint
