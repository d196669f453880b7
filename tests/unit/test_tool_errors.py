"""Bad input to runner.tools.evaluate and runner init (merge and report: test_run_file_errors.py): exit 2 and one
paragraph that names the argument or file and what to give instead; never a traceback, never a silent wrong answer."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import finished_run, read_json, refused

from runner.tools import evaluate
from runner.tools import scaffold as init

DIGITS = ["+experiment=digits", "trainer.max_duration=10st", "logger=none", "callbacks=none"]


# ---- python -m runner.evaluate ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished digits run with a checkpoint at step 10."""
    directory = tmp_path_factory.mktemp("digits")
    finished_run(directory, *DIGITS, "checkpoint=default", "checkpoint.interval=10st")
    return directory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["device=cuda"], "device=cuda: this machine has no CUDA device; give device=cpu"),
        (["device=cuda:1"], "device=cuda:1: this machine has no CUDA device"),
        (["device=tpu"], "device=tpu: give device=cpu, device=cuda \\(or cuda:N\\) or device=mps"),
        (["device=mps"], "device=mps: this machine has no MPS"),
        (["data.batch_size=0"], "data.batch_size must be a whole number >= 1, got 0"),
        (["data.val_batch_size=-1"], "data.val_batch_size must be a whole number >= 1, got -1"),
        (["data.val_batch_size=0"], "data.val_batch_size must be a whole number >= 1, got 0"),  # not batch_size's
        (["split=[a"], "split=\\[a: cannot read the value '\\[a' .*quote text: 'split=\"\\[a\"'"),
        (["split=[a,b]"], "split=\\['a', 'b'\\]: give one name"),
        (["trusted_targets=x"], "trusted_targets='x': give a list of module paths"),
        (["data.splits.val_fraction=abc"], "cannot build the data of .*digits_splits"),
    ],
)
def test_evaluate_refuses_a_bad_option(digits_run: Path, capsys, monkeypatch, args: list[str], message: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    refused(evaluate.main, [str(digits_run), *args], capsys, message)


def test_evaluate_refuses_a_run_that_is_a_file_or_missing(digits_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("x")
    refused(evaluate.main, [str(tmp_path / "notes.txt")], capsys, "notes.txt is a file, not a run folder: give the")
    refused(evaluate.main, [str(tmp_path / "nowhere")], capsys, "nowhere does not exist: give the folder of a finished")
    refused(evaluate.main, [str(tmp_path)], capsys, "is not a run folder \\(it has no .hydra/config.yaml\\)")
    (tmp_path / "w.safetensors").write_bytes((digits_run / "model.safetensors").read_bytes())
    refused(evaluate.main, [str(tmp_path / "w.safetensors")], capsys, "is not inside a run folder")
    weights = digits_run / "model.safetensors"
    refused(evaluate.main, [str(weights), f"weights={weights}"], capsys, "give the run folder .* and weights=")
    (tmp_path / "unfinished" / ".hydra").mkdir(parents=True)
    (tmp_path / "unfinished" / ".hydra" / "config.yaml").write_bytes((digits_run / ".hydra/config.yaml").read_bytes())
    refused(evaluate.main, [str(tmp_path / "unfinished")], capsys, "has no model.safetensors .* weights=CHECKPOINT")


def test_evaluate_given_weights_in_a_run_folder_evaluates_them_as_weights_would(digits_run: Path, capsys) -> None:
    # RUN/model.safetensors, a checkpoint folder or its file: the run is the folder above, results written there
    step10 = digits_run / "checkpoints" / "step-00000010"
    assert evaluate.main([str(digits_run), "split=test", f"weights={step10}"]) == 0
    expected = read_json(digits_run / "eval-test.json")
    for given in (step10, step10 / "model.safetensors", digits_run / "model.safetensors"):
        assert evaluate.main([str(given), "split=test"]) == 0, capsys.readouterr().err
        got = read_json(digits_run / "eval-test.json")
        assert got["weights"] == str(given) and got["metrics"] == expected["metrics"]
        assert got["weights_sha256"] == expected["weights_sha256"]  # a folder's weights file, hashed
        assert f"wrote {digits_run / 'eval-test.json'}" in capsys.readouterr().out
    assert not (digits_run / "model.safetensors").is_dir()


def test_evaluate_on_a_full_disk_says_to_run_it_again(digits_run: Path, capsys, monkeypatch) -> None:
    # Its advice was training's: "continue the run with resume=auto", which evaluate does not take
    earlier = digits_run / "eval-test.json"
    before = earlier.read_bytes() if earlier.exists() else None

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # write_atomic's rename into place: the disk filled as it wrote
    message = refused(
        evaluate.main,
        [str(digits_run), "split=test"],
        capsys,
        "disk full: writing .*eval-test.json failed .*nothing was written .*run the same command again",
    )
    monkeypatch.undo()
    assert "resume=auto" not in message
    assert (earlier.read_bytes() if earlier.exists() else None) == before  # nothing lost, nothing half-written
    assert not list(digits_run.glob(".eval-test.json.*"))


# ---- runner init --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("numpy", "--name numpy: numpy is already importable here .* give another name, e.g. --name my_numpy"),
        ("json", "--name json: json is already importable"),  # the standard library
        ("sys", "--name sys: sys is already importable"),  # built in
        ("runner", "--name runner: runner is already importable"),
        ("experiments", "--name experiments: experiments is already importable"),
        ("class", "--name 'class' is not a Python package name"),
        ("my-task", "--name 'my-task' is not a Python package name"),
        ("conf", "--name conf: the project already has a folder conf/"),
    ],
)
def test_init_refuses_a_name_that_cannot_be_the_project_s_package(tmp_path: Path, capsys, name: str, message) -> None:
    refused(init.main, [str(tmp_path / "proj"), "--name", name], capsys, message)
    assert not (tmp_path / "proj").exists()


def test_init_refuses_a_file_where_its_folder_goes(tmp_path: Path, capsys) -> None:
    (tmp_path / "taken").write_text("mine")
    refused(init.main, [str(tmp_path / "taken")], capsys, "taken is a file, not a folder; give a new or empty folder")
    refused(init.main, [str(tmp_path / "taken" / "sub")], capsys, "taken is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "mine"


def test_init_keeps_valid_names_working(tmp_path: Path, monkeypatch, capsys) -> None:
    # a project made before in the working folder is not "importable": the next project may take another name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    assert init.main(["first", "--name", "mytask"]) == 0
    (tmp_path / "mytask").mkdir()
    assert init.main(["second", "--name", "mytask"]) == 0
    assert init.main(["third"]) == 0 and (tmp_path / "third" / "project" / "model.py").is_file()
    assert "+experiment=mytask" in capsys.readouterr().out


def test_init_into_a_project_again_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    assert init.main([str(tmp_path / "proj"), "--name", "mytask"]) == 0
    model = tmp_path / "proj" / "mytask" / "model.py"
    model.write_text("# my edits\n")
    message = refused(init.main, [str(tmp_path / "proj"), "--name", "mytask"], capsys, "would overwrite")
    assert str(model) in message and "runner.yaml" in message
    assert model.read_text() == "# my edits\n"
