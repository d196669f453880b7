"""Run folders whose config names a class by an old dotted name (experiments.sae.model.TopKSAE, from before the SAE
workbench was grouped into coders/, sources/, pages/; runner.refused.NewRunFolder) still load, as the same model: the
framework's own table and each task's, registered through the `runner.renamed` entry point group
(runner.rundir.renamed)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch
from helpers import finished_run

from runner.ckpt.state import ABSENT, config_changes
from runner.load import load_trained
from runner.rundir import CONFIG, RENAMED, moved, renamed


def _exists(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    if importlib.util.find_spec(dotted.split(".")[0]) and _module(dotted):
        return True
    return bool(module) and _module(module) and hasattr(importlib.import_module(module), name)


def _module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


def test_every_renamed_name_exists_under_its_new_name_and_not_under_its_old() -> None:
    table = renamed()
    assert set(RENAMED) <= set(table) and "experiments.sae.model" in table  # the framework's and the SAE task's
    for old, new in table.items():
        assert not _exists(old), f"{old} still exists: a config naming it would not be renamed"
        assert _exists(new), f"{old} -> {new}, which does not exist"


def test_only_targets_of_moved_modules_are_renamed() -> None:
    text = "model:\n  _target_: experiments.sae.model.TopKSAE\n  note: experiments.sae.model.TopKSAE\n"
    text += "cb:\n  - _target_: 'experiments.sae.hooked.SpliceEval'\n  - _target_: experiments.sae.callbacks.X\n"
    assert moved(text) == (
        "model:\n  _target_: experiments.sae.coders.activations.TopKSAE\n  note: experiments.sae.model.TopKSAE\n"
        "cb:\n  - _target_: 'experiments.sae.evals.splice.SpliceEval'\n  - _target_: experiments.sae.callbacks.X\n"
    )
    assert (
        moved("x:\n  _target_: runner.refused.NewRunFolder\n") == "x:\n  _target_: runner.rundir.refused.NewRunFolder\n"
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
    for old, new in renamed().items():
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
