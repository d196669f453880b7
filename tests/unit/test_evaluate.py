"""python -m runner.evaluate: a finished run's weights (or a checkpoint's) on a named split, with the run's config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import finished_run, read_json
from omegaconf import OmegaConf

from experiments.digits import digits_splits
from runner.tools.evaluate import main

DIGITS = ["+experiment=digits", "trainer.max_duration=40st", "logger=none", "callbacks=none"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """A finished digits run with checkpoints at steps 20 and 40, and its final validation metrics."""
    directory = tmp_path_factory.mktemp("digits")
    run = finished_run(directory, *DIGITS, "checkpoint=default", "checkpoint.interval=20st", "checkpoint.keep_last=2")
    yield directory, run.state.metrics


@pytest.fixture
def digits_run(trained: tuple[Path, dict]) -> Path:
    """The finished digits run's folder."""
    return trained[0]


def test_digits_has_a_test_split_carved_from_the_held_out_images() -> None:
    before = digits_splits(val_fraction=0.2, seed=0)
    splits = digits_splits(val_fraction=0.2, test_fraction=0.1, seed=0)
    assert torch.equal(splits["train"].tensors[0], before["train"].tensors[0])  # training is unchanged
    held = {tuple(row.tolist()) for row in before["val"].tensors[0]}
    val, test = ({tuple(r.tolist()) for r in splits[s].tensors[0]} for s in ("val", "test"))
    assert val | test <= held and len(test) == pytest.approx(0.1 * 1797, abs=10)
    assert torch.bincount(splits["test"].tensors[1]).min() >= 15  # every class is in it (stratified)


def test_evaluate_writes_the_split_s_metrics_equal_to_validation(trained: tuple[Path, dict], capsys) -> None:
    digits_run, metrics = trained
    sizes = {name: len(split) for name, split in digits_splits(0.2, 0, test_fraction=0.1).items()}
    assert main([str(digits_run), "split=val"]) == 0
    val = read_json(digits_run / "eval-val.json")
    assert val["split"] == "val" and val["samples"] == sizes["val"] and len(val["weights_sha256"]) == 64
    for key in ("val/loss", "val/acc"):  # the run's own final validation, computed again from its weights file
        assert val["metrics"][key] == pytest.approx(metrics[key], rel=1e-12), key
    assert main([str(digits_run), "split=test", "data.val_batch_size=7"]) == 0
    test = read_json(digits_run / "eval-test.json")
    assert test["samples"] == sizes["test"] and set(test["metrics"]) == {"test/loss", "test/acc"}
    assert 0.5 < test["metrics"]["test/acc"] <= 1
    assert "test/acc" in capsys.readouterr().out


def test_evaluate_a_checkpoint_s_weights(digits_run: Path) -> None:
    step20 = digits_run / "checkpoints" / "step-00000020"
    assert main([str(digits_run), "split=test", f"weights={step20}"]) == 0
    early = read_json(digits_run / "eval-test.json")
    assert early["weights"] == str(step20)
    assert main([str(digits_run), "split=test"]) == 0
    assert read_json(digits_run / "eval-test.json")["metrics"] != early["metrics"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["split=train2"], "split=train2: the data of .* has the splits \\['test', 'train', 'val'\\]"),
        (["data.batch_sise=3"], "data.batch_sise: the data config of .* has no such key"),
        (["spilt=test"], "unknown argument 'spilt'"),
        (["weights=nowhere.safetensors"], "nowhere.safetensors does not exist"),
    ],
)
def test_evaluate_refuses_bad_arguments_with_exit_2(digits_run: Path, capsys, args: list[str], message: str) -> None:
    assert main([str(digits_run), *args]) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_evaluate_adds_the_run_s_metric_callbacks_on_the_validation_split(tmp_path: Path, capsys) -> None:
    # An SAE on synthetic features: sae_ground_truth's val/mmcs comes back as the run validated it. The health
    # callback writes under ${run_dir}, Hydra's output folder when it ran: resolved here as the run's folder.
    run = finished_run(
        tmp_path,
        "+experiment=sae",
        "callbacks=[sae_ground_truth,health]",
        *("model.n_latents=64", "data.splits.d=16", "data.splits.n_features=32", "data.splits.mean_active=2"),
        *("data.splits.n_train=2048", "data.splits.n_val=512", "data.batch_size=128", "trainer.max_duration=20st"),
        "checkpoint=none",
    )
    assert main([str(tmp_path)]) == 0
    metrics = read_json(tmp_path / "eval-val.json")["metrics"]
    for key in ("val/mmcs", "val/recovered_0.9", "val/fve"):
        assert metrics[key] == pytest.approx(run.state.metrics[key], rel=1e-9), key
    assert main([str(tmp_path), "split=train"]) == 0
    assert "train/mmcs" not in read_json(tmp_path / "eval-train.json")["metrics"]  # measured on other data: val only
    # A callback of a package that is not trusted is not built (its config could name any code): said, not fatal.
    config = tmp_path / ".hydra" / "config.yaml"
    saved = OmegaConf.load(config)
    saved.callbacks.evil = {"_target_": "os.system", "command": "touch pwned"}
    OmegaConf.save(saved, config)
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    assert (
        "callbacks.evil not run: callbacks.evil._target_=os.system is not under the trusted" in capsys.readouterr().err
    )
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
