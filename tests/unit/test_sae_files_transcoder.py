"""A transcoder on activation files (data=activations_file data.d_out=N): each row is the input's columns, then the
target's last N; the data decides the model's d_in and d_out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from experiments.sae.sources.files import ActivationFiles
from runner import ConfigError
from runner.build import build
from runner.loop import fit


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """300 rows [x | y], 12 input columns then 8 target columns (y a linear map of x, plus noise)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 12), dtype=np.float32)
    y = x @ rng.standard_normal((12, 8), dtype=np.float32) + 0.1 * rng.standard_normal((300, 8), dtype=np.float32)
    np.save(tmp_path / "rows.npy", np.concatenate([x, y], axis=1))
    return tmp_path / "rows.npy"


def test_d_out_splits_the_columns_into_the_models_widths(rows: Path) -> None:
    assert ActivationFiles(str(rows), batch_size=64).model_args == {"d_in": 20}  # null: an SAE's rows, as before
    assert ActivationFiles(str(rows), batch_size=64, d_out=8).model_args == {"d_in": 12, "d_out": 8}
    # d is the model's input width, checked against the file's columns less the target's
    assert ActivationFiles(str(rows), batch_size=64, d=12, d_out=8).model_args == {"d_in": 12, "d_out": 8}
    with pytest.raises(ConfigError, match=r"shape \[300, 20\].*\[N, 18\]"):
        ActivationFiles(str(rows), batch_size=64, d=10, d_out=8)


@pytest.mark.parametrize("d_out", [20, 21, 0, -1, True, 2.5])
def test_a_target_as_wide_as_the_rows_or_not_a_width_is_refused(rows: Path, d_out: object) -> None:
    with pytest.raises(ConfigError, match="data.d_out"):
        ActivationFiles(str(rows), batch_size=64, d_out=d_out)


@pytest.mark.parametrize("given", ["data.d_out=8", "model.d_out=8"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_transcoder_trains_on_a_file(
    compose_cfg: Callable[..., DictConfig], rows: Path, given: str, skip: bool
) -> None:
    small = ["model.n_latents=32", "model.k=4", "data.batch_size=64", "callbacks=none", "trainer.max_duration=4st"]
    cfg = compose_cfg("+experiment=sae", "data=activations_file", f"data.train_path={rows}", given, *small)
    cfg.model.skip = skip
    run = fit(build(cfg))
    task = run.task
    assert (task.d_in, task.d_out, task.transcoder, task.skip) == (12, 8, True, skip)
    assert task.W_enc.shape == (12, 32) and task.W_dec.shape == (32, 8) and run.progress.step == 4
    # validation scores the predicted target on the held-out rows (the last 5%): FVE about the target's own mean
    held = torch.from_numpy(np.load(rows)[-15:])
    with torch.no_grad():
        sse = (task(held[:, :12]) - held[:, 12:]).double().pow(2).sum()
    sst = (held[:, 12:] - held[:, 12:].mean(0)).double().pow(2).sum()
    assert run.state.metrics["val/fve"] == pytest.approx(float(1 - sse / sst), rel=1e-4)


def test_a_model_width_that_disagrees_with_the_files_is_refused(compose_cfg: Callable[..., DictConfig], rows: Path):
    cfg = compose_cfg("+experiment=sae", "data=activations_file", f"data.train_path={rows}", "data.d_out=8")
    cfg.model.d_out = 6  # the data says 8: model.d_out follows the data (runner.build.decided_by_data)
    with pytest.raises(ConfigError, match=r"model.d_out=6, but the data gives 8"):
        build(cfg)
