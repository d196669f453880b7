"""Synthetic transcoder data with a known sparse map (data=transcoder_synthetic), the ground-truth scores of a
transcoder, resampling a transcoder's dead latents, and real runs that must recover the truth.

Everything runs on one CPU thread; each training test takes a few seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F
from helpers import compose_job
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.sae.callbacks import GroundTruthRecovery, ResampleDead
from experiments.sae.coders.activations import TopKSAE
from experiments.sae.metrics import feature_recovery
from experiments.sae.sources.synthetic import SyntheticData, SyntheticFeatures, synthetic_splits
from runner import ConfigError
from runner.build import build
from runner.loop import fit

SMALL = {"d": 8, "n_features": 6, "mean_active": 2.0, "magnitude": (0.5, 1.5), "seed": 3}


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Callable[..., DictConfig]]:
    yield lambda *overrides: compose_job(tmp_path / "run", "logger=none", *overrides)
    HydraConfig.instance().cfg = None


def _codes(source: SyntheticFeatures, n: int, seed: int) -> torch.Tensor:
    """The codes c [n, K] that source.sample_sparse(n, Generator().manual_seed(seed)) draws, drawn again by hand."""
    g = torch.Generator().manual_seed(seed)
    active = torch.rand(n, len(source.probs), generator=g) < source.probs
    rows, cols = active.nonzero(as_tuple=True)
    c = torch.zeros(n, len(source.probs), dtype=torch.float64)
    c[rows, cols] = (source.low + (source.high - source.low) * torch.rand(len(rows), generator=g)).double()
    return c


# ---- 1. The data --------------------------------------------------------------------------------------------------


def test_rows_are_the_input_then_the_target_made_from_the_same_codes() -> None:
    source = SyntheticFeatures(**SMALL, d_out=5, linear=0.7)
    E, D, L = source.features.double(), source.targets.double(), source.linear_map.double()
    assert E.shape == (6, 8) and D.shape == (6, 5) and L.shape == (8, 5)
    torch.testing.assert_close(D.norm(dim=1), torch.ones(6, dtype=torch.float64))
    assert torch.equal(source.features, SyntheticFeatures(**SMALL).features)  # E is the SAE data's E
    rows = source.sample(300, torch.Generator().manual_seed(0))
    assert rows.shape == (300, 13)
    c = _codes(source, 300, 0)
    x = c @ E
    torch.testing.assert_close(rows[:, :8].double(), x, atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[:, 8:].double(), c @ D + x @ L, atol=1e-6, rtol=0)
    # with unit magnitudes the dense way (a GPU's) draws the same codes: the same rows
    unit = SyntheticFeatures(**{**SMALL, "magnitude": (1.0, 1.0)}, d_out=5, linear=0.7)
    sparse = unit.sample_sparse(300, torch.Generator().manual_seed(1))
    torch.testing.assert_close(unit.sample_dense(300, torch.Generator().manual_seed(1)), sparse)
    # noise is drawn after the codes: the same codes, x moved by the noise, y the noisy x's
    noisy = SyntheticFeatures(**SMALL, d_out=5, linear=0.7, noise=0.1).sample(300, torch.Generator().manual_seed(0))
    torch.testing.assert_close(noisy[:, 8:].double(), c @ D + noisy[:, :8].double() @ L, atol=1e-6, rtol=0)
    assert float((noisy[:, :8].double() - x).std()) == pytest.approx(0.1, rel=0.1)
    # L's entries are N(0, 1/d), times `linear`
    big = SyntheticFeatures(d=64, n_features=8, d_out=64, linear=2.0)
    assert float(big.linear_map.std()) == pytest.approx(2.0 / 64**0.5, rel=0.05)


def test_sae_data_is_unchanged_by_the_transcoder_options() -> None:
    kwargs = {"d": 16, "n_features": 32, "mean_active": 3.0, "seed": 5}
    source = SyntheticFeatures(**kwargs)
    x = source.sample(64, torch.Generator().manual_seed(0))
    explicit = SyntheticFeatures(**kwargs, d_out=None, linear=0.0, noise=0.0)
    assert torch.equal(explicit.sample(64, torch.Generator().manual_seed(0)), x)
    # the code path as it was before transcoders: one embedding_bag over the features
    g = torch.Generator().manual_seed(0)
    active = torch.rand(64, 32, generator=g) < source.probs
    rows, cols = active.nonzero(as_tuple=True)
    mags = source.low + (source.high - source.low) * torch.rand(len(rows), generator=g)
    offsets = torch.zeros(64, dtype=torch.long)
    offsets[1:] = active.sum(1).cumsum(0)[:-1]
    assert torch.equal(x, F.embedding_bag(cols, source.features, offsets, per_sample_weights=mags, mode="sum"))
    assert x[0, :3].tolist() == pytest.approx([-0.03703, -0.0147801, 0.1946077], abs=1e-6)  # seeded, pinned
    # the transcoder data of the same seed: the same features, codes and inputs
    rows = SyntheticFeatures(**kwargs, d_out=12).sample(64, torch.Generator().manual_seed(0))
    torch.testing.assert_close(rows[:, :16], x, atol=1e-6, rtol=0)
    splits = synthetic_splits(n_train=256, n_val=128, **kwargs)
    same = synthetic_splits(n_train=256, n_val=128, **kwargs, d_out=None, linear=0.0, noise=0.0)
    assert torch.equal(splits["val"].tensors[0], same["val"].tensors[0])
    data = SyntheticData(splits, batch_size=64)
    assert data.model_args == {"d_in": 16}
    assert splits["val"].true_targets is None and splits["val"].true_linear is None


def test_transcoder_data_tells_the_model_both_widths() -> None:
    splits = synthetic_splits(d=16, n_features=32, n_train=256, n_val=128, d_out=12, linear=0.5)
    assert SyntheticData(splits, batch_size=64).model_args == {"d_in": 16, "d_out": 12}
    val = splits["val"]
    assert val[0][0].shape == (28,)
    assert val.true_features.shape == (32, 16) and val.true_targets.shape == (32, 12)
    assert val.true_linear.shape == (16, 12) and splits["train"].true_linear is val.true_linear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transcoder_rows_are_made_on_the_gpu_from_the_same_codes() -> None:
    splits = synthetic_splits(d=32, n_features=16, mean_active=3.0, n_train=4096, n_val=64, d_out=24, linear=0.5)
    data = SyntheticData(splits, batch_size=512, shuffle=False, seed=0)
    rows = torch.cat([b for (b,) in data.train_loader(device=torch.device("cuda"))])
    val = data.splits["val"]
    assert rows.is_cuda and rows.shape == (4096, 56)
    assert val.true_features.is_cuda and val.true_targets.is_cuda and val.true_linear.is_cuda
    E, D, L = (t.cpu().double() for t in (val.true_features, val.true_targets, val.true_linear))
    x, y = rows[:, :32].cpu().double(), rows[:, 32:].cpu().double()
    c = torch.linalg.lstsq(E.t(), x.t()).solution.t()  # 16 features in 32 dims: each row's codes, exactly
    torch.testing.assert_close(y, c @ D + x @ L, rtol=0, atol=5e-3)  # (TF32 products where the user allows them)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"d_out": 0}, r"data.splits.d_out .*whole number >= 1, got 0"),
        ({"d_out": 2.5}, r"data.splits.d_out .*got 2.5"),
        ({"d_out": True}, r"data.splits.d_out .*got True"),
        ({"d_out": 4, "linear": -0.5}, r"data.splits.linear=-0.5 must be a finite number >= 0"),
        ({"d_out": 4, "linear": float("nan")}, r"data.splits.linear=nan must be a finite number"),
        ({"d_out": 4, "linear": float("inf")}, r"data.splits.linear=inf must be a finite number"),
        ({"linear": 0.5}, r"data.splits.linear=0.5 maps inputs to a target: set data.splits.d_out"),
        ({"noise": -1.0}, r"data.splits.noise=-1.0 must be a finite number >= 0"),
    ],
)
def test_bad_transcoder_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        synthetic_splits(d=8, n_features=6, n_train=16, n_val=0, **settings)


# ---- 2. Scores and resampling --------------------------------------------------------------------------------------


def _transcoder(**kwargs) -> TopKSAE:
    torch.manual_seed(kwargs.pop("seed", 0))
    return TopKSAE(**{"d_in": 8, "d_out": 5, "n_latents": 6, "k": 2, **kwargs})


def test_ground_truth_scores_a_transcoder_against_its_target_input_and_linear_truth() -> None:
    val = synthetic_splits(**SMALL, n_train=16, n_val=32, d_out=5, linear=0.7)["val"]
    sae = _transcoder(skip=True)
    with torch.no_grad():  # the truth itself, in a transcoder whose inputs and targets are scaled differently
        sae.W_dec.copy_(val.true_targets)
        sae.W_enc.copy_(val.true_features.t() * 3.0)  # the encoder's scale is no part of its directions
        sae.input_scale.fill_(2.0)
        sae.target_scale.fill_(0.5)
        sae.W_skip.copy_(val.true_linear * 0.5 / 2.0)  # raw y = (x * 2) @ W_skip / 0.5
    callback, metrics = GroundTruthRecovery(), {}
    assert {"val/mmcs", "val/recovered_0.9", "val/encoder_mmcs", "val/skip_error"} <= set(callback.provides)
    run = SimpleNamespace(task=sae, val_loader=SimpleNamespace(dataset=val))
    callback.on_validation_end(run, metrics)
    assert metrics["val/mmcs"] == pytest.approx(1.0, abs=1e-5) and metrics["val/recovered_0.95"] == 1.0
    assert metrics["val/encoder_mmcs"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["val/skip_error"] == pytest.approx(0.0, abs=1e-5)
    with torch.no_grad():  # the skip map in the model's own units is not the raw map: 4x too large here
        sae.W_skip.copy_(val.true_linear)
        sae.W_enc.copy_(torch.randn(8, 6))
    callback.on_validation_end(run, metrics)
    assert metrics["val/skip_error"] == pytest.approx(3.0, rel=1e-4)
    assert metrics["val/encoder_mmcs"] < 0.9 and metrics["val/mmcs"] == pytest.approx(1.0, abs=1e-5)
    # an SAE on SAE data: its decoder against the features, as before transcoders
    sae_val = synthetic_splits(**SMALL, n_train=16, n_val=32)["val"]
    metrics = {}
    callback.on_validation_end(
        SimpleNamespace(task=_transcoder(d_out=None), val_loader=SimpleNamespace(dataset=sae_val)), metrics
    )
    assert set(metrics) == {"val/mmcs", "val/true_features", *(f"val/recovered_{t:g}" for t in callback.thresholds)}
    assert metrics["val/true_features"] == SMALL["n_features"]


def _resampled(task: torch.nn.Module, rows: torch.Tensor, dead: torch.Tensor) -> tuple[ResampleDead, dict]:
    """Train `task` one step on `rows`, mark `dead` dead in each of its SAEs and resample them from `rows`: the
    callback, and the task's state just before resampling."""
    from experiments.sae.coders.multi import members
    from runner.data import DataModule, TensorData
    from runner.distributed.strategies import Single
    from runner.progress import TrainingProgress

    opt = torch.optim.Adam(task.parameters(), lr=1e-3)
    task.training_step((rows,))["loss"].backward()
    opt.step()
    for _, sae in members(task):
        sae.since_fired[dead] = 10
    before = {name: value.clone() for name, value in task.state_dict().items()}
    loader = DataModule({"train": TensorData(rows)}, batch_size=64, shuffle=False).train_loader()
    progress = TrainingProgress("100st", batch_size=64, batches_per_epoch=4, samples_per_epoch=256)
    progress.count_micro_batch(64)
    progress.count_optimizer_step()
    run = SimpleNamespace(
        task=task, progress=progress, train_loader=loader, optimizer=opt, strategy=Single("cpu"), world_size=1
    )
    callback = ResampleDead(every="1st", until="1.0dur", samples=256)
    callback.on_optimizer_step(run)
    return callback, before


def test_resampling_a_transcoder_points_decoder_rows_at_targets_and_encoder_columns_at_their_inputs() -> None:
    source = SyntheticFeatures(d=8, n_features=12, mean_active=2.0, d_out=6, linear=0.5, noise=0.05)
    rows = source.sample(256, torch.Generator().manual_seed(0))
    sae = _transcoder(d_out=6, n_latents=32, skip=True, dead_window="5st")
    dead = torch.tensor([3, 7, 11])
    callback, before = _resampled(sae, rows, dead)
    before_dec, before_enc = before["W_dec"], before["W_enc"]
    assert float(sae.W_skip.detach().abs().max()) > 0  # the skip map was part of the prediction whose error picks
    assert callback.resampled == 3
    live = torch.ones(32, dtype=torch.bool)
    live[dead] = False
    assert torch.equal(sae.W_dec[live], before_dec[live]) and torch.equal(sae.W_enc[:, live], before_enc[:, live])
    x, y = sae.split(rows)
    xn, yn = x * sae.input_scale, y * sae.target_scale
    # each decoder row is a target (less b_dec), each encoder column the input of that same row
    dec_cos = F.normalize(sae.W_dec[dead], dim=1) @ F.normalize(yn - sae.b_dec, dim=1).t()
    enc_cos = F.normalize(sae.W_enc[:, dead].t(), dim=1) @ F.normalize(xn - sae.pre_bias, dim=1).t()
    assert torch.all(dec_cos.max(dim=1).values > 0.9999) and torch.all(enc_cos.max(dim=1).values > 0.9999)
    same = enc_cos[torch.arange(3), dec_cos.argmax(dim=1)]
    assert torch.all(same > 0.9999)
    live_norm = before_enc[:, live].norm(dim=0).mean()
    torch.testing.assert_close(sae.W_enc[:, dead].norm(dim=0), torch.full((3,), float(live_norm) * 0.2))


def test_resampling_a_family_over_several_hooked_modules_reads_each_sae_s_own_columns() -> None:
    import functools

    from experiments.sae.coders.multi import MultiSAE

    torch.manual_seed(0)
    base = functools.partial(TopKSAE, n_latents=16, dead_window="5st")
    family = MultiSAE(base=base, ks=[2], hooks={"a": 8, "b": 6})
    rows = torch.randn(256, 14) * torch.linspace(0.5, 2.0, 14)
    callback, _ = _resampled(family, rows, torch.tensor([1, 2]))
    assert callback.resampled == 4
    for name, columns in (("a_k2", rows[:, :8]), ("b_k2", rows[:, 8:])):
        sae = family.saes[name]
        cos = F.normalize(sae.W_dec[[1, 2]], dim=1) @ F.normalize(columns * sae.input_scale - sae.b_dec, dim=1).t()
        assert torch.all(cos.max(dim=1).values > 0.9999), name


# ---- 3. Real runs recover the truth --------------------------------------------------------------------------------

QUALITY = (
    "+experiment=sae",
    "data=transcoder_synthetic",
    "data.splits.d=32",
    "data.splits.d_out=48",
    "data.splits.n_features=64",
    "data.splits.mean_active=2",
    "model.n_latents=128",
    "model.k=3",
    "model.dead_window=50st",
    "data.batch_size=512",
    "data.val_batch_size=2048",
    "data.splits.n_val=2048",
    "checkpoint=none",
)


def test_topk_transcoder_recovers_the_true_decoder_and_encoder(compose_cfg: Callable[..., DictConfig]) -> None:
    # noise 0.1 on the inputs: without it the encoder learns detectors that cancel the other features' interference
    # (64 features in 32 dims), whose directions are further from the features (encoder MMCS ~0.77-0.80)
    run = build(compose_cfg(*QUALITY, "data.splits.noise=0.1", "optimizer.lr=3e-3", "trainer.max_duration=600st"))
    sae, val = run.task, run.val_loader.dataset
    assert sae.transcoder and sae.d_in == 32 and sae.d_out == 48 and sae.W_dec.shape == (128, 48)
    assert feature_recovery(sae.W_dec.detach(), val.true_targets)["mmcs"] < 0.6  # not there at the start
    assert feature_recovery(sae.W_enc.detach().t(), val.true_features)["mmcs"] < 0.6
    fit(run)
    m = run.state.metrics
    assert run.state.nonfinite_steps == 0 and run.progress.step == 600
    # measured (seeds 0, 1, 2): decoder MMCS 0.9968-0.9971, encoder MMCS 0.934-0.942
    assert m["val/mmcs"] >= 0.99 and m["val/recovered_0.95"] == 1.0, m
    assert m["val/encoder_mmcs"] >= 0.9, m
    assert "val/skip_error" not in m


def test_skip_transcoder_recovers_the_linear_part(compose_cfg: Callable[..., DictConfig]) -> None:
    # The noise makes the linear part identifiable: on noiseless inputs x @ L = c @ (E L) is a sum of feature
    # directions that the decoder learns as well as the skip map could (measured: skip_error 1.16, MMCS 0.80).
    overrides = ("model.skip=true", "data.splits.linear=1.0", "data.splits.noise=0.2", "optimizer.lr=1e-2")
    run = build(compose_cfg(*QUALITY, *overrides, "trainer.max_duration=900st"))
    assert run.task.W_skip.shape == (32, 48) and run.val_loader.dataset.true_linear.shape == (32, 48)
    fit(run)
    m = run.state.metrics
    # measured (seeds 0, 1, 2): skip_error 0.063-0.066, decoder MMCS 0.976-0.984, encoder MMCS 0.960-0.973
    assert m["val/skip_error"] <= 0.1, m
    assert m["val/mmcs"] >= 0.95 and m["val/encoder_mmcs"] >= 0.93, m
