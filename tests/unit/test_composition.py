"""The tests' composition (tests/composition.py: the option-choosing stage done once a process for each choice) gives
what Hydra's own composition gives: the same config, hydra node and flags included, and the same errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from composition import composed
from helpers import CONF_DIR
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

SAE = ["+experiment=sae", "trainer.max_duration=3st"]
CASES = [
    SAE,
    [*SAE, "trainer.max_duration=5st", "model.n_latents=64", "hydra.run.dir=/tmp/elsewhere"],
    ["+experiment=sae", "model=sae_relu", "model.l1_coeff=0.2", "++trainer.max_duration=4st", "+model.extra=[1,2]"],
    ["model=sae_relu", "+experiment=sae", "~trainer.short_run_tolerance", "optimizer.lr=1e-3"],
    ["+experiment=digits", "~logger", "trainer.max_duration=2st", "scheduler=cosine", "seed=7"],
    ["+experiment=digits", "trainer.max_duration=2st", "model={hidden: 8}"],
    ["+experiment=lm", "model.n_layer=1", "data.val_windows=4", "trainer=default"],
    [*SAE, "+model@spare=sae_relu", "spare.n_latents=8"],  # a group under another package, then its value
    [],
]
REFUSED = [
    [*SAE, "trainer.nope=1"],  # not in struct: the value stage
    [*SAE, "+trainer.max_duration=3st"],  # adding a key that is there
    [*SAE, "~trainer.gradient_clip_val"],  # deleting a value that is null
    [*SAE, "model=nope"],  # no such option: the choosing stage
    [*SAE, "trainer.max_duration=1st,2st"],  # a sweep in a single run
    [*SAE, "trainer.max_duration=[1"],  # does not parse
    [*SAE, "+nope@pkg=1"],  # a package on what is not a group
    [*SAE, "hydra.job.env_copy=nope"],  # the hydra node's own values take Hydra's whole path
]


def _both(overrides: list[str], run: Callable[[list[str]], DictConfig]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run(overrides)


def _hydra(overrides: list[str]) -> DictConfig:
    return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def _ours(overrides: list[str]) -> DictConfig:
    return composed("config", overrides)


def _same(ours: DictConfig, hydras: DictConfig) -> None:
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydras)
    assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(hydras)
    assert OmegaConf.is_readonly(ours.hydra) == OmegaConf.is_readonly(hydras.hydra)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "none")
def test_a_composition_equals_hydras_whole_one_the_first_time_and_when_its_choices_were_composed_before(
    overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _same(_both(overrides, _ours), _both(overrides, _hydra))
    monkeypatch.chdir(tmp_path)  # the hydra node records the folder of each composition, not of the first
    again = _both(overrides, _ours)
    assert again.hydra.runtime.cwd == str(tmp_path)
    _same(again, _both(overrides, _hydra))


def test_a_copy_taken_and_changed_leaves_the_next_composition_of_its_choices_untouched() -> None:
    first = _both([*SAE, "model.n_latents=64"], _ours)
    first.model.n_latents = 3
    second = _both(SAE, _ours)
    assert second.model.n_latents == _both(SAE, _hydra).model.n_latents != 3
    assert second.hydra.overrides.task == SAE and first.hydra.overrides.task == [*SAE, "model.n_latents=64"]


@pytest.mark.parametrize("overrides", REFUSED, ids=lambda o: o[-1])
def test_a_refused_composition_raises_what_hydra_raises(overrides: list[str]) -> None:
    _both(SAE, _ours)  # its choices composed before: a refusal in the value stage comes from the shared path
    with pytest.raises(Exception) as hydras:
        _both(overrides, _hydra)
    with pytest.raises(Exception) as ours:
        _both(overrides, _ours)
    assert type(ours.value) is type(hydras.value)
    assert str(ours.value) == str(hydras.value)
    assert type(ours.value.__cause__) is type(hydras.value.__cause__)
    assert str(ours.value.__cause__) == str(hydras.value.__cause__)


def test_a_file_loaded_for_one_choice_is_loaded_again_for_the_next_once_it_changed(tmp_path: Path) -> None:
    # option files are loaded once a process and copied after (composition._loads_shared): an edited one is not stale
    (tmp_path / "model").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - model: a\n  - _self_\nshared: 1\n")
    for name in "abc":
        (tmp_path / "model" / f"{name}.yaml").write_text(f"name: {name}\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        first, again = composed("config", ["model=a"]), composed("config", ["model=b"])
        assert (first.shared, first.model.name, again.model.name) == (1, "a", "b")
        (tmp_path / "config.yaml").write_text("defaults:\n  - model: a\n  - _self_\nshared: 22\n")
        edited = composed("config", ["model=c"])  # choices not composed before, with config.yaml loaded before
        assert (edited.shared, edited.model.name) == (22, "c") == (compose("config", ["model=c"]).shared, "c")
