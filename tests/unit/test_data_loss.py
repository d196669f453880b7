"""Data lost or silently wrong: rotation keeps the newest checkpoint that verifies, a run whose checkpoints are all
corrupt is refused rather than retrained over, final weights carry a checksum checked on every load, unreadable
metrics.jsonl rows are kept, and a full disk stops a checkpoint cleanly."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import DIGITS_12, StopAt

from runner import ConfigError
from runner.ckpt import callback as ckpt_callback
from runner.ckpt.callback import Checkpoint
from runner.ckpt.files import CheckpointError, checkpoints, newest_valid, write_checkpoint
from runner.ckpt.weights import load_weights, read_weights, save_weights
from runner.rundir import METRICS, MODEL, read_jsonl
from runner.train import train

DIGITS = DIGITS_12


def _train(compose_cfg: Callable, run_dir: Path, *overrides: str, stop_at: int | None = None):
    extra = [StopAt(stop_at)] if stop_at is not None else []
    return train(compose_cfg(*DIGITS, *overrides, run_dir=run_dir), extra_callbacks=extra)


def _flip(path: Path, at: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# ---- 1: rotation counts only checkpoints that verify -----------------------------------------------------------
WEIGHTS, STATE = {"w": torch.arange(4.0)}, {"x": torch.ones(1)}


def _corrupt_copy(source: Path, step: int) -> Path:
    """A checkpoint folder at `step` whose manifest reads but whose model.safetensors fails its sha256."""
    folder = source.parent / f"step-{step:08d}"
    write_checkpoint(folder, WEIGHTS, STATE, {"step": step, "monitor_value": None})
    _flip(folder / "model.safetensors")
    return folder


def test_rotation_keeps_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    for step in (10, 20):
        write_checkpoint(tmp_path / f"step-{step:08d}", WEIGHTS, STATE, {"step": step, "monitor_value": None})
    corrupt = _corrupt_copy(tmp_path / "step-00000020", 41)
    saver = Checkpoint(str(tmp_path), keep_last=1, keep_best=0)
    saver.write(tmp_path / "step-00000030", WEIGHTS, STATE, {"step": 30, "monitor_value": None})
    assert saver.error is None
    # the corrupt folder neither counts toward keep_last nor is deleted (it may be looked at); step 30 survives
    assert [p.name for p in checkpoints(tmp_path)] == [corrupt.name, "step-00000030"]
    assert newest_valid(tmp_path)[0].name == "step-00000030"


def test_rotation_verifies_each_older_checkpoint_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (10, 20):
        write_checkpoint(tmp_path / f"step-{step:08d}", WEIGHTS, STATE, {"step": step, "monitor_value": None})
    verified: list[str] = []
    real = ckpt_callback.verify
    monkeypatch.setattr(ckpt_callback, "verify", lambda folder: verified.append(folder.name) or real(folder))
    saver = Checkpoint(str(tmp_path), keep_last=3, keep_best=0)
    for step in (30, 40, 50):
        saver.write(tmp_path / f"step-{step:08d}", WEIGHTS, STATE, {"step": step, "monitor_value": None})
        assert saver.error is None
    # the folders found on disk are hashed once each; the ones this saver wrote are not hashed again
    assert sorted(verified) == ["step-00000010", "step-00000020"]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000050", "step-00000040", "step-00000030"]


# ---- 2: every checkpoint corrupt ---------------------------------------------------------------------------------
def test_resume_auto_refuses_a_run_whose_checkpoints_all_fail(compose_cfg: Callable, tmp_path: Path) -> None:
    _train(compose_cfg, tmp_path, stop_at=8)
    folders = checkpoints(tmp_path / "checkpoints")
    assert len(folders) == 2
    for folder in folders:
        _flip(folder / "model.safetensors")
    metrics = (tmp_path / METRICS).read_bytes()
    with pytest.raises(ConfigError) as refused:
        _train(compose_cfg, tmp_path, "resume=auto")
    message = str(refused.value)
    assert all(folder.name in message for folder in folders) and "sha256" in message
    assert "resume=scratch" in message and "\n" not in message
    assert (tmp_path / METRICS).read_bytes() == metrics  # nothing retrained over
    assert checkpoints(tmp_path / "checkpoints") == folders

    # resume=scratch trains again from step 0; the earlier files are set aside, not deleted
    again = _train(compose_cfg, tmp_path, "resume=scratch")
    assert again.progress.step == 12
    (aside,) = tmp_path.glob("before-scratch-*")
    assert (aside / METRICS).read_bytes() == metrics
    assert sorted(p.name for p in checkpoints(aside / "checkpoints")) == sorted(f.name for f in folders)
    assert json.loads((tmp_path / METRICS).read_text().splitlines()[0])["step"] == 1


def test_resume_auto_without_any_checkpoint_still_starts_from_scratch(compose_cfg: Callable, tmp_path: Path) -> None:
    run = _train(compose_cfg, tmp_path, "resume=auto")
    assert run.progress.step == 12


# ---- 3: final weights carry a checksum checked on every load --------------------------------------------------
def test_a_bit_flip_in_the_final_weights_is_refused_on_every_load(compose_cfg: Callable, tmp_path: Path) -> None:
    run = _train(compose_cfg, tmp_path)
    model = tmp_path / MODEL
    assert read_weights(tmp_path).keys() == read_weights(model).keys()  # intact: loads
    _flip(model)
    for path in (tmp_path, model):
        with pytest.raises(CheckpointError) as refused:
            read_weights(path)
        assert str(model) in str(refused.value) and "expected" in str(refused.value)
    with pytest.raises(CheckpointError, match="sha256"):
        load_weights(run.task, tmp_path, what="weights")


def test_weights_without_a_record_still_load(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(WEIGHTS, str(tmp_path / "given.safetensors"))  # a user's file, or an older run's: no record
    assert torch.equal(read_weights(tmp_path / "given.safetensors")["w"], WEIGHTS["w"])
    save_weights(WEIGHTS, tmp_path / "ours.safetensors")
    assert torch.equal(read_weights(tmp_path / "ours.safetensors")["w"], WEIGHTS["w"])


def test_a_checkpoint_folders_weights_file_is_checked_against_its_manifest(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000001"
    write_checkpoint(folder, WEIGHTS, STATE, {"step": 1, "monitor_value": None})
    _flip(folder / "model.safetensors")
    for path in (folder, folder / "model.safetensors"):
        with pytest.raises(CheckpointError, match="sha256"):
            read_weights(path)


# ---- 4: unreadable metrics.jsonl rows are kept ----------------------------------------------------------------
BAD_ROWS = {
    "not JSON": b'{"step": 3, "train/loss": 0.5\n',
    "not UTF-8": b'{"step": 3, "train/loss": 0.\xff\xfe}\n',
}


@pytest.mark.parametrize("variant", list(BAD_ROWS))
def test_resume_keeps_an_unreadable_metrics_row(variant: str, compose_cfg: Callable, tmp_path: Path, capsys) -> None:
    _train(compose_cfg, tmp_path, stop_at=6)
    lines = (tmp_path / METRICS).read_bytes().splitlines(keepends=True)
    bad = BAD_ROWS[variant]
    (tmp_path / METRICS).write_bytes(b"".join(lines[:3] + [bad] + lines[3:]))
    assert len(read_jsonl(tmp_path / METRICS)) == len(lines)  # readers skip it (and do not crash)
    resumed = _train(compose_cfg, tmp_path, "resume=auto")
    assert resumed.progress.step == 12
    assert [row["step"] for row in read_jsonl(tmp_path / METRICS)] == list(range(1, 13))
    assert (tmp_path / f"{METRICS}.unreadable").read_bytes() == bad  # the row's bytes, as they were
    assert f"{METRICS}.unreadable" in capsys.readouterr().err


# ---- 5: disk full during a checkpoint -------------------------------------------------------------------------
def test_a_full_disk_removes_the_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner import rundir

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.files.os, "fsync", full)
    with pytest.raises(ConfigError, match="disk full"):
        rundir.write_atomic(tmp_path / "x.json", b"{}", fsync=True)
    assert list(tmp_path.iterdir()) == []
