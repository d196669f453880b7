"""+experiment=sae_lm: an SAE on a trained GPT's residual stream, activations from the second position on, its width
from the source, and the GPT's loss with the SAE spliced in against zero and mean ablation."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import finished_run

from experiments.sae.hooked import SourceModel
from runner import ConfigError
from runner.build import build
from runner.loop import fit

JSON_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")  # 5 real files, ~50 kB
TINY_LM = [
    "+experiment=lm",
    f"data.paths=[{JSON_PACKAGE}]",
    "data.val_every=2",
    "data.val_windows=16",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "logger=none",
    "callbacks=none",
    "checkpoint=none",
    "trainer.max_duration=20st",
]
SAE_LM_SMALL = [
    "model.n_latents=128",
    "model.k=8",
    "data.batch_size=128",
    "data.buffer_size=1024",
    "data.samples_per_epoch=4096",
    "trainer.max_duration=12st",
    "trainer.val_interval=12st",
    "trainer.log_interval=6st",
    "logger=none",
    "checkpoint=none",
]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished tiny GPT run folder, as load_trained reads it: model.safetensors and .hydra/config.yaml."""
    directory = tmp_path_factory.mktemp("lm")
    finished_run(directory, *TINY_LM)
    yield directory


def test_sae_lm_trains_on_the_residual_stream_and_reports_loss_recovered(compose_cfg: Callable, lm_run: Path) -> None:
    cfg = compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SAE_LM_SMALL)
    run = build(cfg)
    assert run.task.d_in == 32  # the GPT's d_model, with no model.d_in
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    windows = sum(len(batch["tokens"]) for batch in source.data.val_loader())
    assert len(run.val_loader.dataset) == windows * 31  # 32 positions a window, the first left out
    fit(run)
    m = run.state.metrics
    assert m["val/ce_clean"] < m["val/ce_mean_ablated"] < m["val/ce_zero_ablated"], m
    assert m["val/loss_recovered"] == pytest.approx(
        (m["val/ce_zero_ablated"] - m["val/ce_spliced"]) / (m["val/ce_zero_ablated"] - m["val/ce_clean"])
    )
    assert 0 < m["val/fve"] <= 1 and 0 < m["val/l0"] <= 8


def test_splicing_keeps_the_skipped_positions_and_replaces_the_others(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    out = torch.randn(2, 5, 32)
    spliced = source._spliced(out, torch.zeros_like)
    assert torch.equal(spliced[:, :1], out[:, :1]) and not spliced[:, 1:].any()
    assert source.activations(next(iter(source.data.val_loader()))).shape[1] == 32


def test_skipping_positions_of_a_module_without_positions_is_refused(compose_cfg: Callable, lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0.mlp.down", skip_positions=0)
    assert source._kept(torch.ones(4, 32)).shape == (4, 32)
    source.skip = 1
    with pytest.raises(ConfigError, match=r"source.skip_positions=1, but blocks.0.mlp.down outputs \[4, 32\]"):
        source._kept(torch.ones(4, 32))
