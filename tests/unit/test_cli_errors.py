"""The command line's configuration errors, in-process: each is refused with a message that names the problem and the
way out, before any file is written. What a user sees of one (exit code 2, the message alone on stderr):
tests/e2e/test_cli.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CONF_DIRS, config_options
from hydra.errors import CompactHydraException

from runner import ConfigError
from runner.__main__ import run_dir_to_hydra_run_dir
from runner.train import train

# id: (overrides, the error, fragments its message must contain). Hydra's composition errors are compact ones,
# which Hydra prints without a traceback (exit code 1); a ConfigError is printed by runner's CLI (exit code 2).
ERROR_CASES: dict[str, tuple[list[str], type[Exception], list[str]]] = {
    "unknown-experiment": (["+experiment=nope"], CompactHydraException, ["experiment/nope", "digits"]),
    "unknown-model": (["+experiment=digits", "model=nope"], CompactHydraException, ["model/nope", "mlp"]),
    "misspelled-key": (["+experiment=digits", "trainer.max_duraton=3ep"], CompactHydraException, ["max_duraton"]),
    "bad-duration": (
        ["+experiment=digits", "trainer.max_duration='3 epochs'"],
        ConfigError,
        ["3 epochs", "st (optimizer steps)", "ep (epochs)", "sa (samples)"],
    ),
    "too-short": (
        ["+experiment=digits", "trainer.max_duration=0.01ep"],
        ConfigError,
        ["shorter than one optimizer step"],
    ),
    "accumulate-too-large": (
        ["+experiment=digits", "trainer.accumulate_grad_batches=1000"],
        ConfigError,
        ["accumulate_grad_batches=1000", "does not fit", "45 micro-batches"],
    ),
    "negative-lr": (
        ["+experiment=digits", "optimizer.lr=-1"],
        ConfigError,
        ["optimizer.lr", "got -1", "optimizer.lr="],
    ),
    "text-lr": (["+experiment=digits", "optimizer.lr=abc"], ConfigError, ["optimizer.lr", "'abc'"]),
    "nan-lr": (["+experiment=digits", "optimizer.lr=nan"], ConfigError, ["optimizer.lr", "nan"]),
    "text-seed": (["+experiment=digits", "seed=abc"], ConfigError, ["seed must be a whole number", "seed=0"]),
    "huge-steps": (["+experiment=digits", "trainer.max_duration=1e400st"], ConfigError, ["too large", "1e12st"]),
    "huge-samples": (["+experiment=digits", "trainer.max_duration=1e400sa"], ConfigError, ["too large", "1e12sa"]),
    "negative-workers": (["+experiment=digits", "data.num_workers=-1"], ConfigError, ["data.num_workers", "got -1"]),
    "added-optimizer-key": (
        ["+experiment=digits", "+optimizer.learning_rate=0.5"],
        ConfigError,
        ["optimizer.learning_rate is not a parameter of torch.optim.AdamW", "did you mean optimizer.lr?"],
    ),
    "added-trainer-key": (
        ["+experiment=digits", "+trainer.max_duraton=60st"],
        ConfigError,
        ["trainer.max_duraton is not a trainer setting", "did you mean trainer.max_duration?"],
    ),
    "added-model-key": (
        ["+experiment=digits", "+model.widths=[3]"],
        ConfigError,
        ["model.widths is not a parameter of experiments.digits.MLPClassifier"],
    ),
    # a data module's **loader options and an SAE's **kwargs go to their base classes: those keys are checked too
    "added-data-key-through-kwargs": (
        ["+experiment=lm", "data=text_stream", "+data.blcok=3"],
        ConfigError,
        ["data.blcok is not a parameter of experiments.lm.stream.TextStream", "did you mean data.block?"],
    ),
    "added-sae-key-through-kwargs": (
        ["+experiment=sae", "+model.n_latent=64"],
        ConfigError,
        [
            "model.n_latent is not a parameter of experiments.sae.coders.activations.TopKSAE",
            "did you mean model.n_latents?",
        ],
    ),
    "epochs-for-a-stream": (
        ["+experiment=lm", "data=text_stream", "trainer.val_interval=1ep"],
        ConfigError,
        ["trainer.val_interval=1ep counts epochs, but the training data is a stream", "(st)"],
    ),
    "unknown-monitor": (
        ["+experiment=digits", "monitor=val/nosuch"],
        ConfigError,
        ["'val/nosuch' is not produced by validation", "val/acc", "val/loss"],
    ),
    "source-not-given": (["+experiment=sae_digits"], ConfigError, ["source.checkpoint must be set"]),
    "plateau-on-train-metric": (
        ["+experiment=digits", "scheduler=plateau", "scheduler.monitor=train/loss"],
        ConfigError,
        ["'train/loss'", "val/"],
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_config_errors_are_refused_with_a_clear_message_before_any_file_is_written(
    case: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    overrides, kind, fragments = ERROR_CASES[case]
    with pytest.raises(kind) as caught:
        train(compose_cfg(*overrides))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    # a paragraph, not a traceback: a few lines, plus one per option when Hydra lists a group's options, and one per
    # entry of Hydra's search path it lists (its own configs, every conf folder, the structured configs)
    options = max(len(config_options(group)) for group in ("model", "experiment"))
    assert len(message.strip().splitlines()) <= 5 + options + len(CONF_DIRS) + 2, message
    assert not (tmp_path / "run").exists()  # train() refused before making the run folder


def _bad_activation_file(kind: str, folder: Path) -> Path:
    if kind == "zero-byte .npy":
        (folder / "a.npy").write_bytes(b"")
        return folder / "a.npy"
    if kind == "pickled .pt":
        torch.save({"acts": object()}, folder / "a.pt")  # needs unpickling to load
        return folder / "a.pt"
    rows = np.random.default_rng(0).standard_normal((3000, 256)).astype(np.float32)
    rows[2999, 7] = np.nan  # the last row: the sample spreads over the whole file
    np.save(folder / "a.npy", rows)
    return folder / "a.npy"


@pytest.mark.parametrize(
    ("kind", "fragment"),
    [
        ("zero-byte .npy", "cannot be read"),
        ("pickled .pt", "never unpickles"),
        ("NaN rows", "holds NaN or inf values (1 of 3000 sampled rows, the first at row 2999)"),
    ],
)
def test_a_bad_activation_file_is_refused_before_training(
    kind: str, fragment: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    path = _bad_activation_file(kind, tmp_path)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
        train(compose_cfg("+experiment=sae", "data=activations_file", f"data.train_path={path}"))
    assert len(str(caught.value).splitlines()) == 1


def test_a_run_dir_on_the_command_line_is_hydra_s_run_folder_or_refused() -> None:
    # run_dir follows Hydra's output folder (.hydra/, runner.log): given alone it must become that folder, not a second
    assert run_dir_to_hydra_run_dir(["+experiment=digits", "seed=1"]) == ["+experiment=digits", "seed=1"]
    moved = run_dir_to_hydra_run_dir(["+experiment=digits", "run_dir=/x/run", "seed=1"])
    assert moved == ["+experiment=digits", "seed=1", "hydra.run.dir=/x/run"]
    assert run_dir_to_hydra_run_dir(["++run_dir=/x/run"]) == ["hydra.run.dir=/x/run"]
    same = run_dir_to_hydra_run_dir(["run_dir=/x/run", "hydra.run.dir=/x/run"])
    assert same == ["hydra.run.dir=/x/run"]
    with pytest.raises(ConfigError, match=re.escape("run_dir=/x/run and hydra.run.dir=/y name two folders")):
        run_dir_to_hydra_run_dir(["run_dir=/x/run", "hydra.run.dir=/y"])
    with pytest.raises(ConfigError, match=re.escape("each job of a sweep needs its own: give the sweep's folder with")):
        run_dir_to_hydra_run_dir(["-m", "+experiment=digits", "seed=0,1", "run_dir=/x/sweep"])
