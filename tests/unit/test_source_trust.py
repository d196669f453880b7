"""A run folder used as `source.checkpoint` is data, not code: its config's `_target_`s outside trusted_targets are
refused before anything is instantiated (issue 16 A)."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import finished_run
from omegaconf import DictConfig, OmegaConf

from runner import ConfigError
from runner.build import build
from runner.ckpt.files import save_weights
from runner.trained import load_trained

MARKER = Path("/tmp/runner-source-pwned")


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (MARKER,))


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished digits run folder (3 steps): model.safetensors and .hydra/config.yaml."""
    directory = tmp_path_factory.mktemp("source")
    torch.set_num_threads(1)
    finished_run(directory, "logger=none", "+experiment=digits", "trainer.max_duration=3st")
    yield directory


def _tampered(source: Path, tmp_path: Path, key: str, node: dict) -> Path:
    folder = tmp_path / "evil run"
    shutil.copytree(source, folder)
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg[key] = node
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(_Exploit(), f)
    return folder


WRITES = str(MARKER)
ATTACKS = {
    "torch.load of a pickle": ("model", {"_target_": "torch.load", "f": "EVIL", "weights_only": False}),
    "builtins.open": ("model", {"_target_": "builtins.open", "file": WRITES, "mode": "w"}),
    "Path.write_text": ("model", {"_target_": "pathlib.Path.write_text", "self": WRITES, "data": "x"}),
    "numpy.save": ("model", {"_target_": "numpy.save", "file": WRITES, "arr": [1]}),
    "runner's own file writer": ("model", {"_target_": "runner.rundir.write_atomic", "path": WRITES, "data": "x"}),
    "a look-alike package": ("model", {"_target_": "experimentsx.evil", "x": 1}),
    "an interpolated target": ("model", {"_target_": "${oc.env:EVIL_TARGET,torch.load}", "f": "EVIL"}),
    "nested in the data": ("data", {"_target_": "runner.data.DataModule", "splits": {"_target_": "torch.load"}}),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_source_run_whose_config_names_untrusted_code_is_refused_before_running_it(
    attack: str, source_run: Path, tmp_path: Path
) -> None:
    key, node = ATTACKS[attack]
    node = {k: (str(tmp_path / "evil.pt") if v == "EVIL" else v) for k, v in node.items()}
    folder = _tampered(source_run, tmp_path, key, node)
    MARKER.unlink(missing_ok=True)
    with pytest.raises(ConfigError) as caught:
        load_trained(folder)
    message = str(caught.value)
    assert "refusing to build" in message and "trusted_targets=[experiments,runner.data,mypackage]" in message
    assert f"{key}._target_=" in message or f"{key}.splits._target_=torch.load" in message
    assert not MARKER.exists()


def test_trusted_targets_lets_a_users_own_package_in(source_run: Path, tmp_path: Path) -> None:
    folder = _tampered(
        source_run, tmp_path, "model", {"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 10}
    )
    with pytest.raises(ConfigError, match=r"model._target_=torch.nn.Linear"):
        load_trained(folder)
    (folder / "model.safetensors").unlink()
    save_weights(torch.nn.Linear(64, 10), folder / "model.safetensors")
    model, cfg = load_trained(folder, trusted=["experiments", "runner.data", "torch.nn"])
    assert isinstance(model, torch.nn.Linear) and not model.training
    assert cfg.data._target_ == "runner.data.DataModule"


def test_the_sae_digits_preset_passes_trusted_targets_to_both_readers(
    compose_cfg: Callable[..., DictConfig], source_run: Path, tmp_path: Path
) -> None:
    folder = _tampered(source_run, tmp_path, "model", {"_target_": "torch.load", "f": str(tmp_path / "evil.pt")})
    MARKER.unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="refusing to build the model"):
        build(compose_cfg("+experiment=sae_digits", f"source.checkpoint={folder}"))
    assert not MARKER.exists()
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={source_run}", "trusted_targets=[experiments]")
    with pytest.raises(ConfigError, match=r"data._target_=runner.data.DataModule"):
        build(cfg)  # the user's allow-list is the one applied (it lacks runner.data)
    assert list(cfg.callbacks.sae_splice.trusted_targets) == ["experiments"]
