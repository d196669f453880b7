"""Run folders written before experiments/sae was grouped into coders/, sources/, pages/ name their classes by the old
modules (experiments.sae.model.TopKSAE): they still load, as the same model (runner.rundir.MOVED)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch
from helpers import finished_run

from runner.ckpt.state import ABSENT, config_changes
from runner.rundir import CONFIG, MOVED, moved
from runner.trained import load_trained


def test_every_moved_module_exists_under_its_new_name() -> None:
    for old, new in MOVED.items():
        assert old.startswith("experiments.sae.") and importlib.util.find_spec(old) is None, old
        importlib.import_module(new)


def test_only_targets_of_moved_modules_are_renamed() -> None:
    text = "model:\n  _target_: experiments.sae.model.TopKSAE\n  note: experiments.sae.model.TopKSAE\n"
    text += "cb:\n  - _target_: 'experiments.sae.hooked.SpliceEval'\n  - _target_: experiments.sae.callbacks.X\n"
    assert moved(text) == (
        "model:\n  _target_: experiments.sae.coders.activations.TopKSAE\n  note: experiments.sae.model.TopKSAE\n"
        "cb:\n  - _target_: 'experiments.sae.sources.hooked.SpliceEval'\n  - _target_: experiments.sae.callbacks.X\n"
    )


def test_a_run_folder_that_names_the_old_modules_loads_as_the_same_model(tmp_path: Path) -> None:
    small = ["data.splits.n_train=2048", "data.splits.n_val=256", "data.batch_size=256", "trainer.max_duration=4st"]
    finished_run(
        tmp_path,
        "+experiment=sae",
        "data=transcoder_synthetic",
        "data.splits.d=32",
        "data.splits.d_out=24",
        "model.n_latents=64",
        "model.skip=true",
        *small,
        "logger=none",
        "checkpoint=none",
    )
    now, _ = load_trained(tmp_path)
    config = tmp_path / CONFIG
    text = config.read_text()
    for old, new in MOVED.items():
        text = text.replace(f"{new}.", f"{old}.")
    assert "experiments.sae.model.TopKSAE" in text and "experiments.sae.data.SyntheticData" in text
    config.write_text(text)
    before, cfg = load_trained(tmp_path)
    assert cfg.model._target_ == "experiments.sae.coders.activations.TopKSAE"
    for (name, a), (_, b) in zip(now.state_dict().items(), before.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_from_before_the_move_resumes_without_config_changes() -> None:
    # its config names the old modules and lacks the keys added since (model.d_out, model.skip, data.target: off)
    saved = {"model": {"_target_": "experiments.sae.model.TopKSAE", "k": 32}, "data": {"module": "blocks.2"}}
    now = {
        "model": {"_target_": "experiments.sae.coders.activations.TopKSAE", "k": 32, "d_out": None, "skip": False},
        "data": {"module": "blocks.2", "target": None},
    }
    assert config_changes(saved, now) == {}
    # a new key set on, or a real change, still counts
    on = {**now, "model": {**now["model"], "skip": True, "k": 16}, "data": {"module": "blocks.2", "target": 0}}
    assert config_changes(saved, on) == {"data.target": (ABSENT, 0), "model.k": (32, 16), "model.skip": (ABSENT, True)}
