"""Distributed checkpoints (checkpoint.format=dcp) in one process: an exact resume through the callback (written at
once or in the background), a sealed manifest over every file, torn folders ignored, damaged or forged files refused
in one paragraph that names the file and the rank that wrote it."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_resume_is_exact, weights

from runner.ckpt.callback import Checkpoint
from runner.ckpt.dcp import open_checkpoint
from runner.ckpt.files import CheckpointError, checkpoints, manifest_checksum, newest_valid, read_manifest, verify
from runner.ckpt.weights import read_weights
from runner.distributed.strategies import Single
from runner.run import Callback, Run
from runner.train import train

DIGITS = ("+experiment=digits", "trainer.max_duration=12st", "trainer.val_interval=4st", "logger=jsonl")
DCP = (*DIGITS, "checkpoint.format=dcp", "checkpoint.interval=4st", "checkpoint.keep_last=5", "callbacks=none")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-step digits run with a distributed checkpoint every 4 steps (its run folder; tests copy what they break)."""
    from helpers import compose_job
    from hydra.core.hydra_config import HydraConfig

    run_dir = tmp_path_factory.mktemp("dcp") / "run"
    train(compose_job(run_dir, *DCP))
    HydraConfig.instance().cfg = None
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_dcp_checkpoint_resumes_bit_for_bit(background: bool, compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*DCP, f"checkpoint.async={str(background).lower()}"]
    _, resumed = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=4)
    (saver,) = [cb for cb in resumed.callbacks if isinstance(cb, Checkpoint)]
    assert saver.format_of(resumed) == "dcp"
    newest = checkpoints(tmp_path / "split" / "checkpoints")[0]
    assert read_manifest(newest)["format"] == "dcp"


def test_the_manifest_seals_every_file_and_the_weights_read_whole(finished: Path) -> None:
    folder = checkpoints(finished / "checkpoints")[0]
    manifest = verify(folder)
    assert manifest["format"] == "dcp" and manifest["world_size"] == 1 and manifest["step"] == 12
    on_disk = {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk == {".metadata", "__0_0.distcp", "shared.pt", "rank-0.pt"}
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == entry["sha256"], name
    # tools read a distributed checkpoint's weights whole, as the final model.safetensors holds them
    whole, final = read_weights(folder), weights(finished)
    assert whole.keys() == final.keys() and all(torch.equal(whole[k], final[k]) for k in final)
    assert (finished / "checkpoints" / "last").resolve() == folder


def test_a_torn_folder_is_never_taken_for_a_checkpoint(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    directory = run_dir / "checkpoints"
    newest = checkpoints(directory)[0]
    # a kill before the rename: a staging folder; a kill of rank 0 before the manifest: no manifest
    staged = directory / ".step-00000016.partial-999999"
    staged.mkdir()
    (staged / "__0_0.distcp").write_bytes(b"half")
    torn = directory / "step-00000016"
    torn.mkdir()
    for name in (".metadata", "__0_0.distcp", "shared.pt", "rank-0.pt"):
        (torn / name).write_bytes((newest / name).read_bytes())
    folder, _ = newest_valid(directory, load=lambda f: open_checkpoint(f, Single("cpu")))
    assert folder == newest


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank-0.pt", "shared.pt", ".metadata"])
def test_a_damaged_or_missing_file_names_itself_and_its_rank(name: str, finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    folder = checkpoints(run_dir / "checkpoints")[0]
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(data))
    rank = " (written by rank 0)" if name.startswith(("__", "rank-")) else ""
    with pytest.raises(CheckpointError, match=re.escape(f"{name}{rank} does not match its sha256")):
        open_checkpoint(folder, Single("cpu"))
    (folder / name).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"cannot read {name}{rank}")):
        open_checkpoint(folder, Single("cpu"))
    # resume=auto falls back to the previous checkpoint
    found, _ = newest_valid(run_dir / "checkpoints", load=lambda f: open_checkpoint(f, Single("cpu")))
    assert found.name == "step-00000008"


class _Payload:
    def __reduce__(self) -> tuple:
        return (exec, ("raise SystemExit('unpickled')",))


def test_a_forged_metadata_with_a_matching_manifest_is_never_unpickled(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    folder = checkpoints(run_dir / "checkpoints")[0]
    forged = pickle.dumps(_Payload())
    (folder / ".metadata").write_bytes(forged)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(forged), "sha256": hashlib.sha256(forged).hexdigest()}
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read \(builtins\.exec has no place"):
        read_weights(folder)


def test_an_unknown_format_or_option_is_a_config_error(tmp_path: Path) -> None:
    from runner import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.format=torch"):
        Checkpoint(str(tmp_path), format="torch")
    with pytest.raises(ConfigError, match="no option asynch"):
        Checkpoint(str(tmp_path), asynch=True)


class _KeepAt(Callback):
    """The task's state dict (weights and buffers) as it is at the end of step `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.state = step, {}

    def on_step_end(self, run: Run) -> None:
        if run.progress.step == self.step:
            self.state = {k: v.detach().clone() for k, v in run.task.state_dict().items()}


def test_an_async_save_holds_its_own_step_while_the_next_steps_train(
    compose_cfg: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the background copy slowed past the next steps' forward and backward: the optimizer step waits for it, and the
    # buffers that the forward changes (the SAE's firing counts) were copied at the save
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def slow(self: DefaultStager, state: dict, **kwargs: object) -> dict:
        time.sleep(0.5)
        return stage(self, state, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow)
    overrides = ["+experiment=sae", "trainer.max_duration=8st", "trainer.val_interval=8st", "data.batch_size=256"]
    overrides += ["data.splits.n_val=256", "model.dead_window=2st", "checkpoint.format=dcp", "checkpoint.async=true"]
    overrides += ["checkpoint.interval=4st", "checkpoint.keep_last=5", "callbacks=none", "logger=none"]
    kept = _KeepAt(4)
    run = train(compose_cfg(*overrides, run_dir=tmp_path / "run"), extra_callbacks=[kept])
    saved = read_weights(tmp_path / "run" / "checkpoints" / "step-00000004")
    assert saved.keys() == kept.state.keys() and "since_fired" in "".join(saved)
    assert all(torch.equal(saved[k], kept.state[k]) for k in saved), [
        k for k in saved if not torch.equal(saved[k], kept.state[k])
    ]
    final = {k: v for k, v in run.task.state_dict().items()}
    assert any(not torch.equal(final[k], kept.state[k]) for k in saved)  # the steps after the save did change them
