"""Checkpoints in-process: exact resume, verified files, rotation, safe loading, init_from, a failed background save.
Killed and signalled CLI runs: tests/e2e/test_checkpoint_cli.py."""

from __future__ import annotations

import io
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CountSteps, CrashAt, StopAt, assert_same_state, make_run, metric_rows

from runner.ckpt.callback import Checkpoint
from runner.ckpt.files import (
    CheckpointError,
    checkpoints,
    load_checkpoint,
    manifest_checksum,
    newest_valid,
    read_manifest,
)
from runner.ckpt.weights import load_weights
from runner.loop import fit
from runner.run import Callback, Run
from runner.train import train

EXACT_CASES = [  # every value of each factor at least once: accumulation, loader workers, scheduler
    pytest.param(1, 0, "cosine", 30, id="acc1-workers0-cosine"),
    pytest.param(3, 0, "plateau", 20, id="acc3-workers0-plateau"),
    pytest.param(1, 2, "plateau", 30, id="acc1-workers2-plateau"),
    pytest.param(3, 2, "cosine", 20, id="acc3-workers2-cosine"),
]


@pytest.mark.parametrize(("accumulate", "workers", "scheduler", "n"), EXACT_CASES)
def test_stop_and_resume_equals_the_uninterrupted_run(
    compose_cfg: Callable, tmp_path: Path, accumulate: int, workers: int, scheduler: str, n: int
) -> None:
    # digits: 45 batches an epoch, so step n stops mid-epoch (15 steps an epoch with accumulation 3: n=20 is in the
    # second). Dropout, early stopping (state, not a stop), validations every 7 steps, AdamW state, logs every 4.
    overrides = [
        "+experiment=digits",
        f"scheduler={scheduler}",
        f"trainer.max_duration={2 * n}st",
        f"trainer.accumulate_grad_batches={accumulate}",
        f"data.num_workers={workers}",
        "trainer.val_interval=7st",
        "trainer.log_interval=4st",
        "logger=jsonl",
        "callbacks=early_stopping",
        "checkpoint.interval=1000st",
    ]
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"))
    first = train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(n)])
    assert first.stop_reason == "preempted" and first.progress.step == n
    assert checkpoints(tmp_path / "split" / "checkpoints")[0].name == f"step-{n:08d}"  # newest; best ones beside
    counter = CountSteps()
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"), extra_callbacks=[counter])
    assert second.progress.step == 2 * n and second.stop_reason == "max_duration"
    assert counter.steps == n  # it did resume: only the second half was trained here
    assert_same_state(whole, second)
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")  # no duplicate or orphaned rows either


def test_sae_resume_is_exact(compose_cfg: Callable, tmp_path: Path) -> None:
    # AuxK with a 2-step dead window: the dead latents the first resumed step uses are restored from the buffers.
    overrides = [
        "+experiment=sae",
        "trainer.max_duration=12st",
        "trainer.val_interval=4st",
        "trainer.log_interval=2st",
        "data.batch_size=256",
        "data.splits.n_val=512",
        "model.dead_window=2st",
        "logger=jsonl",
        "checkpoint.interval=1000st",
    ]
    whole_flags, second_flags = AuxKFlags(), AuxKFlags()
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"), extra_callbacks=[whole_flags])
    assert whole.task.n_dead > 0
    train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(5)])
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"), extra_callbacks=[second_flags])
    assert_same_state(whole, second)
    # the SAE's AuxK switch (what a GPU step computes) follows the last log row: resumed, it decides as before
    assert any(whole_flags.seen.values()) and not all(whole_flags.seen.values())
    assert second_flags.seen == {s: on for s, on in whole_flags.seen.items() if s > 5}
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")


class AuxKFlags(Callback):
    """The SAE's AuxK switch as each optimizer step found it."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_optimizer_step(self, run: Run) -> None:
        self.seen[run.progress.step] = run.task.auxk_active


def _trained(compose_cfg: Callable, run_dir: Path, *overrides: str) -> Run:
    return train(
        compose_cfg(
            "+experiment=digits",
            "trainer.max_duration=12st",
            "trainer.val_interval=3st",
            "logger=none",
            "callbacks=none",
            *overrides,
            run_dir=run_dir,
        )
    )


def test_rotation_keeps_the_last_k_and_the_best_k(compose_cfg: Callable, tmp_path: Path) -> None:
    # Validation every 3 steps (4 validations), interval saves every 2: 12 steps make up to 9 checkpoints.
    run = _trained(
        compose_cfg,
        tmp_path,
        "logger=jsonl",
        "checkpoint.interval=2st",
        "checkpoint.keep_last=2",
        "checkpoint.keep_best=2",
        "monitor=val/acc",
        "mode=max",
    )
    validations = {r["step"]: r["val/acc"] for r in metric_rows(tmp_path) if "val/acc" in r}
    assert sorted(validations) == [3, 6, 9, 12]
    # ties broken towards the later step, as a rotation that sorts by value and keeps the newest first would
    best_two = sorted(validations, key=lambda s: (validations[s], s), reverse=True)[:2]
    kept = {read_manifest(p)["step"] for p in checkpoints(tmp_path / "checkpoints")}
    assert kept == {12, 10} | set(best_two)
    for folder in checkpoints(tmp_path / "checkpoints"):
        manifest = read_manifest(folder)
        if manifest["step"] in validations:  # a validation step's checkpoint records its fresh monitored value
            assert manifest["monitor_value"] == validations[manifest["step"]]
    assert run.state.best.value == max(validations.values())
    assert (tmp_path / "checkpoints" / "last").resolve().name == "step-00000012"


def test_truncated_and_flipped_checkpoints_are_skipped(compose_cfg: Callable, tmp_path: Path) -> None:
    _trained(compose_cfg, tmp_path, "checkpoint.interval=4st", "checkpoint.keep_last=3")
    newest, middle, oldest = checkpoints(tmp_path / "checkpoints")
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    weights = middle / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(newest)
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(middle)
    found, _ = newest_valid(tmp_path / "checkpoints")
    assert found == oldest


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/runner-pwned"),))


def test_a_pickled_object_is_refused_without_running_it(compose_cfg: Callable, tmp_path: Path) -> None:
    import hashlib

    _trained(compose_cfg, tmp_path, "checkpoint.interval=12st")
    folder = checkpoints(tmp_path / "checkpoints")[0]
    marker = Path("/tmp/runner-pwned")
    marker.unlink(missing_ok=True)
    buffer = io.BytesIO()
    torch.save({"optimizer": _Exploit()}, buffer, pickle_module=pickle)
    (folder / "state.pt").write_bytes(buffer.getvalue())
    manifest = read_manifest(folder)  # a consistent manifest: only the loader's refusal protects the user
    manifest["files"]["state.pt"] = {
        "bytes": len(buffer.getvalue()),
        "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
    }
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_a_finished_run_resumed_says_so(compose_cfg: Callable, tmp_path: Path, capsys) -> None:
    _trained(compose_cfg, tmp_path)
    again = _trained(compose_cfg, tmp_path, "resume=auto")
    assert again.stop_reason == "max_duration" and again.progress.step == 12
    assert "already finished" in capsys.readouterr().err


def test_resume_refuses_a_different_batch_size_unless_allowed(compose_cfg: Callable, tmp_path: Path) -> None:
    first = train(
        compose_cfg(
            "+experiment=digits", "trainer.max_duration=12st", "logger=none", "callbacks=none", run_dir=tmp_path
        ),
        extra_callbacks=[StopAt(6)],
    )
    assert first.progress.step == 6
    with pytest.raises(CheckpointError, match="batch_size 32 -> 16"):
        _trained(compose_cfg, tmp_path, "resume=auto", "data.batch_size=16")
    resumed = _trained(compose_cfg, tmp_path, "resume=auto", "data.batch_size=16", "resume_allow_changes=true")
    assert resumed.stop_reason == "max_duration"


def test_init_from_loads_weights_and_reports_mismatches(compose_cfg: Callable, tmp_path: Path) -> None:
    source = _trained(compose_cfg, tmp_path / "a", "checkpoint.interval=12st")
    folder = checkpoints(tmp_path / "a" / "checkpoints")[0]
    target = _trained(
        compose_cfg, tmp_path / "b", "trainer.max_duration=1st", f"init_from={folder}", "trainer.val_interval=1st"
    )
    assert target.progress.step == 1  # trained one step from the loaded weights: close to, not equal to, the source
    other = _trained(compose_cfg, tmp_path / "c", "trainer.max_duration=1st", "trainer.val_interval=1st")
    narrow = _trained(
        compose_cfg, tmp_path / "d", "trainer.max_duration=1st", "trainer.val_interval=1st", "model.hidden=[512,64]"
    ).task
    with pytest.raises(CheckpointError, match="shape_mismatch"):
        load_weights(narrow, folder)
    first_layer = narrow.net[0].weight.detach().clone()
    loose = load_weights(narrow, folder, strict=False)
    assert loose["shape_mismatch"] and not loose["missing"] and not loose["unexpected"]
    assert not torch.equal(narrow.net[0].weight, first_layer)  # 64 -> 512 fits and was loaded
    report = load_weights(other.task, tmp_path / "a" / "model.safetensors")
    assert report == {"missing": [], "unexpected": [], "shape_mismatch": []}
    for (name, x), y in zip(other.task.state_dict().items(), source.task.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_a_failed_background_save_stops_training_at_the_next_step(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the checkpoint folder would have to live inside a file: the writer thread fails
    steps = CountSteps()
    run = make_run(max_duration="20st", callbacks=[Checkpoint(dir=str(blocker / "ckpt"), interval="5st"), steps])
    with pytest.raises(RuntimeError, match="saving a checkpoint in .*not-a-folder/ckpt failed"):
        fit(run)
    # raised at the step after the failed save at step 5, or at the latest when the next save (step 10) begins
    assert 5 <= steps.steps <= 10


def test_a_crash_while_a_save_is_writing_leaves_that_checkpoint_for_the_next_launch(
    compose_cfg: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runner.ckpt.callback as callback

    write = callback.write_checkpoint

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # a loaded disk: the training thread reaches the crash while the writer is still at work
        return write(*args, **kwargs)

    monkeypatch.setattr(callback, "write_checkpoint", slow_write)
    overrides = ["+experiment=digits", "trainer.max_duration=12st", "callbacks=none", "checkpoint.interval=10st"]
    with pytest.raises(RuntimeError, match="the node died"):
        train(compose_cfg(*overrides), extra_callbacks=[CrashAt(11)])
    assert [f.name for f in checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000010"]
    train(compose_cfg(*overrides, "resume=auto"))
    assert (tmp_path / "run" / "run-resumed-at-10.json").is_file()
