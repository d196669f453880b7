"""+experiment=transcoder_file: a transcoder on rows of the user's own file, each an MLP's input then its output (the
last data.d_out columns), on +experiment=sae_file's recipe; validation scores the target without a source model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig

from runner import ConfigError
from runner.build import build
from runner.loop import fit

D_IN, D_OUT = 16, 12


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24,000 rows [x | relu(x W)]: 16 Gaussian input columns, then 12 target columns, each a ReLU of a unit-norm
    projection of the input (a known MLP of 12 units a transcoder's latents can copy)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24_000, D_IN)).astype(np.float32)
    w = rng.standard_normal((D_IN, D_OUT)).astype(np.float32)
    w /= np.linalg.norm(w, axis=0)
    path = tmp_path_factory.mktemp("rows") / "mlp_rows.npy"
    np.save(path, np.concatenate([x, np.maximum(x @ w, 0)], axis=1))
    return path


# 32 latents, k 8, batch 64: one epoch is 357 steps. lr 2e-2, not the preset's 2e-3: Muon's update is scaled to the
# matrices' size (match_rms_adamw), so at 16 x 32 the preset's lr learns too slowly for a test (FVE 0.42 after an epoch
# with 128 latents, 0.998 at 2e-2); the test is of the preset's wiring, not its lr.
SMALL = ["model.n_latents=32", "data.batch_size=64", "optimizer.lr=2e-2", "checkpoint=none", "threads=1"]


def _run(compose_cfg: Callable[..., DictConfig], rows: Path, *overrides: str):
    cfg = compose_cfg("+experiment=transcoder_file", f"data.train_path={rows}", f"data.d_out={D_OUT}", *overrides)
    return cfg, fit(build(cfg))


def test_the_preset_is_sae_files_recipe_with_a_transcoders_start(compose_cfg: Callable[..., DictConfig], rows: Path):
    cfg = compose_cfg("+experiment=transcoder_file", f"data.train_path={rows}", f"data.d_out={D_OUT}")
    assert cfg.model._target_.endswith("TopKSAE") and cfg.optimizer._target_ == "runner.optimizers.Muon"
    assert (cfg.optimizer.lr, cfg.scheduler._target_.rsplit(".", 1)[-1], cfg.trainer.max_duration) == (
        2e-3,
        compose_cfg("+experiment=sae_file", f"data.train_path={rows}").scheduler._target_.rsplit(".", 1)[-1],
        "1ep",
    )
    assert (cfg.model.tied_init, cfg.model.encoder_init, cfg.model.dead_window) == (False, 0.6, "1e6tok")
    assert (cfg.monitor, cfg.mode) == ("val/fve", "max")


@pytest.mark.parametrize("skip", [False, True])
def test_a_transcoder_learns_a_known_mlp_from_a_file(
    compose_cfg: Callable[..., DictConfig], rows: Path, skip: bool
) -> None:
    _, run = _run(compose_cfg, rows, *SMALL, "model.k=8", f"model.skip={skip}")
    task, metrics = run.task, run.state.metrics
    assert (task.d_in, task.d_out, task.transcoder, task.skip) == (D_IN, D_OUT, True, skip)
    assert run.progress.step == 357  # one epoch of the 95% of rows that train
    # measured: FVE 0.987 (skip: 0.995), with 22% (skip: 19%) of the 32 latents never firing on the held-out rows
    # (12 target units need fewer than 32 latents)
    assert metrics["val/fve"] > 0.95
    assert 0 <= metrics["val/dead_fraction"] <= 0.5


@pytest.mark.parametrize("model", ["sae_relu", "sae_batchtopk", "sae_jumprelu", "sae_gated", "sae_matryoshka"])
def test_every_code_type_trains_as_a_transcoder_on_a_file(
    compose_cfg: Callable[..., DictConfig], rows: Path, model: str
) -> None:
    _, run = _run(compose_cfg, rows, f"model={model}", *SMALL, "trainer.max_duration=20st", "trainer.val_interval=20st")
    assert (run.task.d_in, run.task.d_out, run.task.transcoder) == (D_IN, D_OUT, True)
    assert np.isfinite(run.state.metrics["val/fve"]) and "val/dead_fraction" in run.state.metrics


def test_without_the_targets_width_it_is_refused(compose_cfg: Callable[..., DictConfig], rows: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.d_out must be set .* add data.d_out=\.\.\. to the command line"):
        build(compose_cfg("+experiment=transcoder_file", f"data.train_path={rows}"))


def test_a_file_whose_width_is_not_d_in_plus_d_out_is_refused(
    compose_cfg: Callable[..., DictConfig], rows: Path
) -> None:
    # model.d_in=20 and d_out=12 want 32 columns; the file has 28: refused before training, in one paragraph
    with pytest.raises(ConfigError, match=r"shape \[24000, 28\].*\[N, 32\]") as refused:
        _run(compose_cfg, rows, *SMALL, "model.d_in=20")
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"data.d_out=28, but the rows of .* have 28 columns"):
        build(compose_cfg("+experiment=transcoder_file", f"data.train_path={rows}", "data.d_out=28"))
