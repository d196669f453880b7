"""Checkpoints: exact resume, atomic and verified files, rotation, safe loading, init_from."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runner.ckpt.files import CheckpointError, checkpoints, load_checkpoint, load_weights, newest_valid, read_manifest
from runner.run import Callback, Run
from runner.train import train

TIMING = {"train/samples_per_s", "sys/peak_memory_mb"}  # wall-clock figures: the only ones a resume may change


class StopAt(Callback):
    """Asks the loop to stop at `step` as a preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step == self.step:
            run.request_stop("preempted")


class CountSteps(Callback):
    """Counts the optimizer steps this process trained."""

    def __init__(self) -> None:
        self.steps = 0

    def on_optimizer_step(self, run: Run) -> None:
        self.steps += 1


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _same_state(a: Run, b: Run) -> None:
    for (name, x), (_, y) in zip(a.task.state_dict().items(), b.task.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for key in sa["state"]:
        for field, value in sa["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][key][field])), (key, field)
    assert [g["lr"] for g in a.optimizer.param_groups] == [g["lr"] for g in b.optimizer.param_groups]


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
        "callbacks=[early_stopping,checkpoint]",
        "callbacks.checkpoint.interval=1000st",
    ]
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"))
    first = train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(n)])
    assert first.stop_reason == "preempted" and first.progress.step == n
    assert checkpoints(tmp_path / "split" / "checkpoints")[0].name == f"step-{n:08d}"  # newest; best ones beside
    counter = CountSteps()
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"), extra_callbacks=[counter])
    assert second.progress.step == 2 * n and second.stop_reason == "max_duration"
    assert counter.steps == n  # it did resume: only the second half was trained here
    _same_state(whole, second)
    assert _rows(tmp_path / "split") == _rows(tmp_path / "whole")  # no duplicate or orphaned rows either


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
        "callbacks.checkpoint.interval=1000st",
    ]
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"))
    assert whole.task.n_dead > 0
    train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(5)])
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"))
    _same_state(whole, second)
    assert _rows(tmp_path / "split") == _rows(tmp_path / "whole")


def _trained(compose_cfg: Callable, run_dir: Path, *overrides: str) -> Run:
    return train(
        compose_cfg(
            "+experiment=digits",
            "trainer.max_duration=12st",
            "trainer.val_interval=3st",
            "logger=none",
            "callbacks=checkpoint",
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
        "callbacks.checkpoint.interval=2st",
        "callbacks.checkpoint.keep_last=2",
        "callbacks.checkpoint.keep_best=2",
        "monitor=val/acc",
        "mode=max",
    )
    validations = {r["step"]: r["val/acc"] for r in _rows(tmp_path) if "val/acc" in r}
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
    _trained(compose_cfg, tmp_path, "callbacks.checkpoint.interval=4st", "callbacks.checkpoint.keep_last=3")
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

    _trained(compose_cfg, tmp_path, "callbacks.checkpoint.interval=12st")
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
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing"):
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
            "+experiment=digits", "trainer.max_duration=12st", "logger=none", "callbacks=checkpoint", run_dir=tmp_path
        ),
        extra_callbacks=[StopAt(6)],
    )
    assert first.progress.step == 6
    with pytest.raises(CheckpointError, match="batch_size 32 -> 16"):
        _trained(compose_cfg, tmp_path, "resume=auto", "data.batch_size=16")
    resumed = _trained(compose_cfg, tmp_path, "resume=auto", "data.batch_size=16", "resume_allow_changes=true")
    assert resumed.stop_reason == "max_duration"


def test_init_from_loads_weights_and_reports_mismatches(compose_cfg: Callable, tmp_path: Path) -> None:
    source = _trained(compose_cfg, tmp_path / "a", "callbacks.checkpoint.interval=12st")
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


def _launch(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The CLI (through tests/_launch.py and its test-only slowdowns) on digits with checkpoints every 10 steps."""
    args = [
        "+experiment=digits",
        "trainer.max_duration=60st",
        "trainer.val_interval=10st",
        "logger=jsonl",
        "callbacks.checkpoint.interval=10st",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_launch.py"), *args],
        env={**os.environ, "WANDB_MODE": "offline", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = _launch(run_dir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return run_dir


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(uninterrupted: Path, tmp_path: Path) -> None:
    proc = _launch(tmp_path, env={"RUNNER_TEST_SLOW_SAVE": "step-00000020:60"})
    _wait_for(tmp_path / "checkpoints" / ".tmp-step-00000020", proc)
    proc.kill()  # SIGKILL while the checkpoint of step 20 is being written
    proc.wait()
    assert [p.name for p in checkpoints(tmp_path / "checkpoints")] == ["step-00000010"]
    resumed = _launch(tmp_path, "resume=auto")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "resuming from" in err and "step-00000010" in err
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written folder was cleaned up
    for name, tensor in _weights(uninterrupted).items():
        assert torch.equal(tensor, _weights(tmp_path)[name]), name
    assert _rows(tmp_path) == _rows(uninterrupted)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes(uninterrupted: Path, tmp_path: Path) -> None:
    proc = _launch(tmp_path, env={"RUNNER_TEST_STEP_SLEEP": "0.03"})
    _wait_for(tmp_path / "checkpoints" / "step-00000010", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "preempted" and 10 <= summary["progress"]["step"] < 60
    stopped_at = summary["progress"]["step"]
    assert checkpoints(tmp_path / "checkpoints")[0].name == f"step-{stopped_at:08d}"
    assert "resume=auto" in err
    resumed = _launch(tmp_path, "resume=auto")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["stop_reason"] == "max_duration"
    assert (tmp_path / ".hydra" / "config.yaml").is_file()  # the first launch's config is kept
    assert list((tmp_path / ".hydra").glob("resume-*/overrides.yaml"))
    for name, tensor in _weights(uninterrupted).items():
        assert torch.equal(tensor, _weights(tmp_path)[name]), name
    assert _rows(tmp_path) == _rows(uninterrupted)


def test_a_failed_background_save_stops_training_at_the_next_step(tmp_path: Path) -> None:
    from test_loop import make_run

    from runner.ckpt.callback import Checkpoint
    from runner.loop import fit

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the checkpoint folder would have to live inside a file: the writer thread fails
    steps = CountSteps()
    run = make_run(max_duration="20st", callbacks=[Checkpoint(dir=str(blocker / "ckpt"), interval="5st"), steps])
    with pytest.raises(RuntimeError, match="saving a checkpoint in .*not-a-folder/ckpt failed"):
        fit(run)
    # raised at the step after the failed save at step 5, or at the latest when the next save (step 10) begins
    assert 5 <= steps.steps <= 10
