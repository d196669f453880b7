"""The sparse-autoencoder experiment: the SAE variants and their recipe, the synthetic and file data, feature-recovery
scores, a real training run that must recover known features, and SAEs on live activations of a trained digits MLP.

Everything runs on one CPU thread; the whole module takes well under a minute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import SyncsAreErrors, assert_resume_is_exact, compose_job
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.sae.coders import sparse as sparse_module
from experiments.sae.coders.activations import BatchTopKSAE, ReLUSAE, TopKSAE, auxk_loss, geometric_median
from experiments.sae.metrics import feature_recovery
from experiments.sae.sources.files import ActivationFiles, RowData, file_splits
from experiments.sae.sources.hooked import LiveActivations
from experiments.sae.sources.synthetic import (
    SyntheticActivations,
    SyntheticData,
    SyntheticFeatures,
    synthetic_splits,
)
from runner import ConfigError
from runner.build import build
from runner.ckpt.weights import save_weights
from runner.data import DataModule
from runner.loop import fit
from runner.run import Callback, Run
from runner.train import train as train_cfg


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Callable[..., DictConfig]]:
    yield lambda *overrides, run_dir=None: compose_job(run_dir or tmp_path / "run", "logger=none", *overrides)
    HydraConfig.instance().cfg = None


def _topk(**kwargs) -> TopKSAE:
    torch.manual_seed(kwargs.pop("seed", 0))
    return TopKSAE(**{"d_in": 16, "n_latents": 64, "k": 4, **kwargs})


# ---- 1. TopK: shapes, sparsity, sparse vs dense decoding ----------------------------------------------------------


def test_topk_shapes_sparsity_and_sparse_decode_matches_dense() -> None:
    sae = _topk()
    assert sae.W_dec.shape == (64, 16) and sae.W_enc.shape == (16, 64)
    assert sae.b_enc.shape == (64,) and sae.b_dec.shape == (16,)
    x = torch.randn(32, 16)
    codes = sae.encode(x)
    assert codes.shape == (32, 64)
    assert int((codes != 0).sum(1).max()) <= 4
    assert (codes >= 0).all()
    with torch.no_grad():
        sae.b_enc.fill_(10.0)  # every pre-activation positive: exactly k survive per row
    codes = sae.encode(x)
    assert (codes != 0).sum(1).tolist() == [4] * 32
    # the survivors are the k largest pre-activations
    pre = sae.pre_activations(x)
    assert torch.equal((codes != 0), torch.zeros_like(pre, dtype=torch.bool).scatter(1, pre.topk(4, 1).indices, True))

    with torch.no_grad():
        sae.b_enc.normal_()
        sae.b_dec.normal_()
        sae.input_scale.fill_(0.7)
    sparse = sae(x)
    sae.sparse_decode = False
    dense = sae(x)
    assert sparse.shape == dense.shape == (32, 16)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sparse, torch.zeros_like(sparse))


def test_topk_rejects_k_outside_range() -> None:
    with pytest.raises(ConfigError, match=r"model.k=0"):
        TopKSAE(d_in=4, n_latents=8, k=0)
    with pytest.raises(ConfigError, match=r"model.k=9"):
        TopKSAE(d_in=4, n_latents=8, k=9)


# ---- 2. Unit-norm decoder and the parallel-gradient removal --------------------------------------------------------


def _parallel_fraction(sae: TopKSAE) -> float:
    grad, w = sae.W_dec.grad, sae.W_dec.detach()
    parallel = (grad * w).sum(1).abs()
    return float((parallel / (grad.norm(dim=1) * w.norm(dim=1)).clamp_min(1e-30)).max())


def test_decoder_rows_stay_unit_norm_and_gradient_has_no_parallel_part() -> None:
    sae = _topk(k_aux=8)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-2)
    for _ in range(6):
        out = sae.training_step(torch.randn(64, 16) * 3 + 1)
        opt.zero_grad()
        out["loss"].backward()
        assert sae.W_dec.grad.abs().max() > 0
        assert _parallel_fraction(sae) < 1e-6
        opt.step()
        # Adam moved the rows off the sphere; after_optimizer_step puts them back
        assert (sae.W_dec.detach().norm(dim=1) - 1).abs().max() > 1e-4
        sae.after_optimizer_step()
        assert float((sae.W_dec.detach().norm(dim=1) - 1).abs().max()) < 1e-5

    # without the recipe the gradient does have a parallel part (so the check above can fail)
    plain = _topk(unit_norm_decoder=False)
    plain.training_step(torch.randn(64, 16) * 3 + 1)["loss"].backward()
    assert _parallel_fraction(plain) > 1e-3


# ---- 3. AuxK reaches dead latents only -----------------------------------------------------------------------------


def test_auxk_gradient_reaches_dead_latents_only() -> None:
    sae = _topk(k_aux=6, dead_window="5st")
    dead = torch.tensor([1, 5, 9, 17, 30, 41, 42, 60])
    with torch.no_grad():
        sae.since_fired[dead] = 10
    sae.after_optimizer_step()  # advances the clock (live latents now at 1) and counts the dead
    assert sae.n_dead == len(dead)
    assert torch.equal(sae.dead_mask().nonzero().flatten(), dead)
    live = ~sae.dead_mask()

    x = torch.randn(64, 16)
    pre = sae.pre_activations(x)
    values, indices = sae.activate(pre)
    recon = sae.decode(values, indices).detach()
    terms = sae.aux_loss(x, pre, values, indices, recon)
    assert set(terms) == {"auxk_loss", "auxk_term"}
    assert float(terms["auxk_loss"]) > 0
    torch.testing.assert_close(terms["auxk_term"].detach(), sae.auxk_coeff * terms["auxk_loss"])
    terms["auxk_term"].backward()

    assert torch.count_nonzero(sae.W_dec.grad[live]) == 0
    assert torch.count_nonzero(sae.W_enc.grad[:, live]) == 0
    assert torch.count_nonzero(sae.b_enc.grad[live]) == 0
    assert int((sae.W_dec.grad[dead].abs().sum(1) > 0).sum()) >= 2
    assert int((sae.W_enc.grad[:, dead].abs().sum(0) > 0).sum()) >= 2


def test_auxk_is_absent_without_dead_latents() -> None:
    sae = _topk()
    sae.after_optimizer_step()
    assert sae.n_dead == 0
    x = torch.randn(8, 16)
    pre = sae.pre_activations(x)
    values, indices = sae.activate(pre)
    terms = sae.aux_loss(x, pre, values, indices, sae.decode(values, indices).detach())
    assert float(terms["auxk_loss"]) == 0.0 and float(terms["auxk_term"]) == 0.0
    out = sae.training_step(x)
    assert float(out["auxk_loss"]) == 0.0
    assert torch.equal(out["loss"].detach(), out["recon_loss"].detach())


@pytest.mark.parametrize("n_dead", [0, 3, 40])  # none, fewer than k_aux (8), more than k_aux
def test_auxk_masked_path_equals_the_gathered_path(n_dead: int) -> None:
    # The GPU's masked top-k (no host read) and the CPU's gather: the same loss and the same gradients, both run here.
    dead = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:n_dead]
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    seen = {}
    for masked in (False, True):
        sae = _topk()  # the same initialisation both times
        with torch.no_grad():
            sae.since_fired[dead] = 500
        sae.after_optimizer_step()
        pre = sae.pre_activations(x)
        values, indices = sae.activate(pre)
        recon = sae.decode(values, indices)
        auxk = auxk_loss(pre, sae.dead, sae.W_dec, sae.k_aux, (x - recon).detach(), masked)
        ((recon - x).pow(2).mean() + auxk).backward()
        seen[masked] = auxk.detach(), {name: p.grad for name, p in sae.named_parameters()}
    (gathered, gathered_grads), (masked, masked_grads) = seen[False], seen[True]
    assert sae.n_dead == n_dead
    if n_dead == 0:
        assert float(gathered) == float(masked) == 0.0
        for name, grad in gathered_grads.items():
            assert torch.equal(masked_grads[name], grad), name  # the zero term adds exactly nothing
    else:
        assert float(gathered) > 0
        torch.testing.assert_close(masked, gathered)
        for name, grad in gathered_grads.items():
            torch.testing.assert_close(masked_grads[name], grad, msg=name)


def test_latents_die_after_dead_window_steps_without_firing() -> None:
    sae = _topk(dead_window="3st")
    with torch.no_grad():
        sae.b_enc[:4] = 100.0  # latents 0-3 win every row: all others never fire
    for step in range(1, 5):
        sae.training_step(torch.randn(16, 16))
        sae.after_optimizer_step()
        assert sae.n_dead == (60 if step >= 3 else 0), step
    assert not sae.dead_mask()[:4].any()


# ---- 4. Geometric median -------------------------------------------------------------------------------------------


def _sum_of_distances(points: torch.Tensor, center: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(points - center, dim=1).sum())


def test_geometric_median_resists_outliers() -> None:
    g = torch.Generator().manual_seed(0)
    cluster = torch.randn(50, 3, generator=g) * 0.1 + torch.tensor([1.0, 2.0, 3.0])
    points = torch.cat([cluster, torch.tensor([[1000.0, -1000.0, 1000.0]])])
    median, mean = geometric_median(points), points.mean(0)
    center = torch.tensor([1.0, 2.0, 3.0])
    assert float(torch.linalg.vector_norm(median - center)) < 0.1
    assert float(torch.linalg.vector_norm(mean - center)) > 20
    assert _sum_of_distances(points, median) <= _sum_of_distances(points, mean)


def test_geometric_median_of_three_collinear_points_is_the_middle_one() -> None:
    points = torch.tensor([[0.0], [1.0], [10.0]])
    median = geometric_median(points)
    assert median.shape == (1,)
    assert float(median) == pytest.approx(1.0, abs=1e-3)
    assert _sum_of_distances(points, median) <= _sum_of_distances(points, points.mean(0))
    assert _sum_of_distances(points, median) == pytest.approx(10.0, abs=1e-3)


# ---- 5. Input normalisation ----------------------------------------------------------------------------------------


def test_initialize_from_scales_inputs_to_root_d() -> None:
    sae = _topk()
    x = torch.randn(256, 16) * 5 + 3
    sae.initialize_from(x)
    assert bool(sae.initialized)
    mean_norm = float(torch.linalg.vector_norm(x * sae.input_scale, dim=1).mean())
    assert mean_norm == pytest.approx(16**0.5, rel=1e-5)
    assert float(sae.input_scale) < 0.5
    # the decoder bias starts at the geometric median of the scaled batch
    torch.testing.assert_close(sae.b_dec.detach(), geometric_median(x * sae.input_scale))


@pytest.mark.parametrize("make", [TopKSAE, BatchTopKSAE])
def test_encoder_init_fit_scales_the_encoder_to_the_first_batch_s_least_squares_optimum(make: type) -> None:
    # top-k codes keep their latents at any encoder scale, so the first batch's error is a parabola in the scale
    torch.manual_seed(0)
    x = torch.randn(512, 32) @ torch.randn(32, 32) + 3
    sae = make(d_in=32, n_latents=256, k=8, encoder_init="fit")
    sae.initialize_from(x)
    xn = x * sae.input_scale

    def error(scale: float) -> float:
        with torch.no_grad():
            pre = (xn - sae.b_dec) @ (sae.W_enc * scale) + sae.b_enc
            return float((sae.decode(*sae.activate(pre)) - xn).pow(2).sum())

    fitted = error(1.0)
    assert fitted < error(0.97) and fitted < error(1.03)
    assert 0.1 < float(sae.W_enc.detach().norm(dim=0).mean()) < 0.9  # unit-norm columns start far too large here
    if make is BatchTopKSAE:
        sae = make(d_in=32, n_latents=256, k=8, encoder_init="fit")
        sae.initialize_from(x)
        assert float(sae.threshold) == -1.0  # the fit's codes leave the inference threshold to training
    unit = make(d_in=32, n_latents=256, k=8)
    unit.initialize_from(x)
    torch.testing.assert_close(unit.W_enc.detach().norm(dim=0), torch.ones(256))
    # row-major like its gradient and its optimizer state: a fused Adam walks all three as flat memory, and a
    # transposed W_enc beside the row-major state a checkpoint restores made a resumed run step wrongly
    assert sae.W_enc.is_contiguous() and make(d_in=32, n_latents=256, k=8, tied_init=False).W_enc.is_contiguous()
    # a number: the columns' starting norm, kept by the data-dependent init
    fixed = make(d_in=32, n_latents=256, k=8, encoder_init=0.5)
    fixed.initialize_from(x)
    torch.testing.assert_close(fixed.W_enc.detach().norm(dim=0), torch.full((256,), 0.5))
    torch.testing.assert_close(fixed.W_enc.detach() / 0.5, fixed.W_dec.detach().t())  # still tied
    for bad in ("auto", 0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match="give unit, fit or the encoder columns' starting norm"):
            make(d_in=32, n_latents=256, k=8, encoder_init=bad)


def test_identity_sae_reconstructs_in_original_units() -> None:
    d = 8
    sae = TopKSAE(d_in=d, n_latents=d, k=d, geometric_median_init=False)
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(d))
        sae.W_dec.copy_(torch.eye(d))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    x = torch.rand(64, d) * 7
    sae.initialize_from(x)
    assert abs(float(sae.input_scale) - 1) > 0.1
    assert float(sae.b_dec.detach().abs().max()) == 0.0  # geometric_median_init=False leaves it alone
    torch.testing.assert_close(sae(x), x, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        out = sae.validation_summary(sae.validation_step(x))
    assert float(out["mse"]) < 1e-10 and float(out["fve"]) == pytest.approx(1.0, abs=1e-6)


# ---- 6. ReLU + L1 warmup, BatchTopK --------------------------------------------------------------------------------


def test_relu_l1_coefficient_ramps_linearly() -> None:
    torch.manual_seed(0)
    sae = ReLUSAE(d_in=16, n_latents=64, l1_coeff=2.0, l1_warmup="10st")
    x = torch.randn(32, 16)
    seen = {}
    for step in range(21):
        if step in (0, 5, 10, 20):
            with torch.no_grad():
                out = sae.training_step(x)
            assert float(out["l1_loss"]) > 0
            seen[step] = float(out["loss"] - out["recon_loss"]) / float(out["l1_loss"])
        sae.after_optimizer_step()
    assert seen[0] == pytest.approx(0.0, abs=1e-6)
    assert seen[5] == pytest.approx(1.0, rel=1e-4)  # half of l1_coeff
    assert seen[10] == pytest.approx(2.0, rel=1e-4)
    assert seen[20] == pytest.approx(2.0, rel=1e-4)  # capped


def test_batchtopk_keeps_k_times_batch_in_training_and_thresholds_in_eval() -> None:
    torch.manual_seed(0)
    sae = BatchTopKSAE(d_in=16, n_latents=64, k=3)
    with torch.no_grad():
        sae.b_enc.fill_(10.0)
    x = torch.randn(8, 16)
    codes = sae.encode(x).detach()
    assert int((codes != 0).sum()) == 3 * 8
    pre = F.relu(sae.pre_activations(x)).detach()
    kept = codes[codes != 0]
    assert float(kept.min()) >= float(pre.flatten().topk(24).values.min()) - 1e-6
    # the first step sets the threshold to the smallest kept activation
    assert float(sae.threshold) == pytest.approx(float(kept.min()), rel=1e-6)

    sae.eval()
    with torch.no_grad():
        sae.threshold.fill_(float(pre.median()))
    eval_codes = sae.encode(x)
    torch.testing.assert_close(eval_codes, pre * (pre > sae.threshold))
    n = int((eval_codes != 0).sum())
    assert 0 < n < pre.numel() and n != 24
    threshold_before = float(sae.threshold)
    sae.encode(x)
    assert float(sae.threshold) == threshold_before  # eval never moves it


# ---- 7. Feature recovery scores ------------------------------------------------------------------------------------


def test_feature_recovery_is_perfect_for_the_true_features() -> None:
    g = torch.Generator().manual_seed(0)
    truth = F.normalize(torch.randn(32, 16, generator=g), dim=1)
    decoder = torch.cat([truth[torch.randperm(32, generator=g)] * 3.0, torch.randn(20, 16, generator=g)])
    scores = feature_recovery(decoder, truth)
    assert set(scores) == {"mmcs", "recovered_0.5", "recovered_0.8", "recovered_0.9", "recovered_0.95"}
    assert scores["mmcs"] == pytest.approx(1.0, abs=1e-5)
    assert all(scores[f"recovered_{t}"] == 1.0 for t in (0.5, 0.8, 0.9, 0.95))
    # half the features missing: recovered fractions say so
    half = feature_recovery(truth[:16], truth, thresholds=(0.99,))
    assert half["recovered_0.99"] == 0.5


def test_feature_recovery_of_a_random_decoder_is_poor() -> None:
    g = torch.Generator().manual_seed(1)
    scores = feature_recovery(torch.randn(128, 64, generator=g), torch.randn(128, 64, generator=g))
    assert scores["mmcs"] < 0.6
    assert scores["recovered_0.9"] == 0.0


# ---- 8. Synthetic data ---------------------------------------------------------------------------------------------


def _activity(source: SyntheticFeatures, x: torch.Tensor) -> torch.Tensor:
    """Recover the 0/1 activity of each feature from samples built with magnitude (1, 1) and n_features <= d."""
    coefficients = torch.linalg.lstsq(source.features.double().t(), x.double().t()).solution.t()
    assert float((coefficients - coefficients.round()).abs().max()) < 1e-3  # every sample is a 0/1 sum of features
    return coefficients.round()


def test_synthetic_probabilities_sum_to_mean_active() -> None:
    source = SyntheticFeatures(d=16, n_features=64, mean_active=3.0)
    assert float(source.probs.sum()) == pytest.approx(3.0, rel=1e-5)
    assert bool((source.probs[:-1] >= source.probs[1:]).all())  # decaying
    capped = SyntheticFeatures(d=16, n_features=20, mean_active=8.0, decay=0.7)
    assert float(capped.probs.max()) == 1.0 and float(capped.probs.min()) > 0
    assert float(capped.probs.sum()) == pytest.approx(8.0, rel=1e-5)
    with pytest.raises(ConfigError, match="mean_active"):
        SyntheticFeatures(d=4, n_features=4, mean_active=5.0)


def test_synthetic_samples_are_sums_of_active_features() -> None:
    source = SyntheticFeatures(d=32, n_features=16, mean_active=3.0, magnitude=(1.0, 1.0), seed=3)
    x = source.sample(4000, torch.Generator().manual_seed(0))
    assert x.shape == (4000, 32)
    active = _activity(source, x)
    assert set(active.unique().tolist()) <= {0.0, 1.0}
    assert float(active.sum(1).mean()) == pytest.approx(3.0, abs=0.15)
    assert float((active.mean(0) - source.probs.double()).abs().max()) < 0.05
    # with random magnitudes the samples still lie in the span of the features
    x = SyntheticFeatures(d=32, n_features=16, seed=3).sample(256, torch.Generator().manual_seed(1))
    q, _ = torch.linalg.qr(source.features.t())
    residual = x - (x @ q) @ q.t()
    assert float(residual.norm() / x.norm()) < 1e-5


def test_synthetic_activations_are_reproducible_by_position() -> None:
    source = SyntheticFeatures(d=16, n_features=32, mean_active=3.0)
    data = SyntheticActivations(source, size=10_000, seed=0)
    (a,) = data.__getitems__(list(range(0, 256)))
    (b,) = data.__getitems__(list(range(0, 256)))
    (c,) = data.__getitems__(list(range(256, 512)))
    (other_seed,) = SyntheticActivations(source, 10_000, seed=1).__getitems__(list(range(256)))
    assert a.shape == (256, 16)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c) and not torch.allclose(a, other_seed)
    assert data.true_features is source.features
    splits = synthetic_splits(d=16, n_features=32, n_train=1000, n_val=300)
    assert len(splits["train"]) == 1000 and len(splits["val"]) == 300
    assert torch.equal(splits["val"].true_features, splits["train"].true_features)


def test_true_features_are_not_the_models_initialisation() -> None:
    # A generator seeded with `seed` would reproduce torch.manual_seed(seed); torch.randn(...): the SAE's init.
    for seed in (0, 1):
        source = SyntheticFeatures(d=32, n_features=64, seed=seed)
        torch.manual_seed(seed)
        leaked = F.normalize(torch.randn(64, 32), dim=1)
        assert not torch.allclose(source.features, leaked)
        assert feature_recovery(leaked, source.features)["recovered_0.9"] == 0.0
        torch.manual_seed(seed)
        sae = TopKSAE(d_in=32, n_latents=64, k=3)
        assert feature_recovery(sae.W_dec.detach(), source.features)["recovered_0.9"] == 0.0
    # but the same seed gives the same features, and another seed other ones
    assert torch.equal(SyntheticFeatures(d=32, n_features=64, seed=0).features, SyntheticFeatures(32, 64).features)
    other = SyntheticFeatures(d=32, n_features=64, seed=1).features
    assert not torch.allclose(other, SyntheticFeatures(32, 64).features)


def test_correlation_keeps_marginals_and_makes_groups_co_occur() -> None:
    n, kwargs = 20_000, {"d": 64, "n_features": 32, "mean_active": 4.0, "decay": 0.97, "magnitude": (1.0, 1.0)}
    independent = SyntheticFeatures(**kwargs)
    correlated = SyntheticFeatures(**kwargs, correlation=0.8, group_size=8)
    a0 = _activity(independent, independent.sample(n, torch.Generator().manual_seed(0)))
    a1 = _activity(correlated, correlated.sample(n, torch.Generator().manual_seed(0)))
    probs = correlated.probs.double()
    assert float((a0.mean(0) - probs).abs().max()) < 0.02
    assert float((a1.mean(0) - probs).abs().max()) < 0.02

    def co_occurrence(active: torch.Tensor) -> tuple[float, float]:
        joint = active.t() @ active / len(active)
        groups = torch.arange(32) // 8
        same = (groups[:, None] == groups[None, :]) & ~torch.eye(32, dtype=torch.bool)
        lift = joint / (probs[:, None] * probs[None, :])
        other = groups[:, None] != groups[None, :]
        return float(lift[same].mean()), float(lift[other].mean())

    same0, other0 = co_occurrence(a0)
    same1, other1 = co_occurrence(a1)
    assert same0 == pytest.approx(1.0, abs=0.1) and other0 == pytest.approx(1.0, abs=0.1)
    assert same1 > 2.0 and same1 > same0 + 1.0
    assert other1 == pytest.approx(1.0, abs=0.1)  # across groups still independent


def test_dense_sampling_draws_the_same_distribution_reproducibly() -> None:
    # sample_dense is how a GPU makes batches (no read of the device); here it runs on the CPU.
    for correlation in (0.0, 0.6):
        source = SyntheticFeatures(d=32, n_features=16, mean_active=3.0, magnitude=(1.0, 1.0), correlation=correlation)
        # the same draws decide which features are active: with unit magnitudes both ways give the same samples
        sparse = source.sample_sparse(500, torch.Generator().manual_seed(7))
        torch.testing.assert_close(source.sample_dense(500, torch.Generator().manual_seed(7)), sparse)
    # random magnitudes: one drawn per (sample, feature), so other values than the sparse way's, the same statistics
    source = SyntheticFeatures(d=32, n_features=16, mean_active=3.0, magnitude=(0.5, 1.5), seed=3)
    dense = source.sample_dense(4000, torch.Generator().manual_seed(0))
    assert torch.equal(dense, source.sample_dense(4000, torch.Generator().manual_seed(0)))
    assert not torch.allclose(dense, source.sample_dense(4000, torch.Generator().manual_seed(1)))
    for x in (dense, source.sample_sparse(4000, torch.Generator().manual_seed(0))):
        coefficients = torch.linalg.lstsq(source.features.double().t(), x.double().t()).solution.t()
        active = coefficients.abs() > 1e-4
        assert float(active.sum(1).double().mean()) == pytest.approx(3.0, abs=0.15)
        assert float((active.double().mean(0) - source.probs.double()).abs().max()) < 0.05
        magnitudes = coefficients[active]
        assert float(magnitudes.min()) > 0.5 - 1e-4 and float(magnitudes.max()) < 1.5 + 1e-4
        assert float(magnitudes.mean()) == pytest.approx(1.0, abs=0.02)


def test_synthetic_data_on_the_cpu_is_the_data_of_a_plain_data_module() -> None:
    def batches(module: type[DataModule]) -> list[torch.Tensor]:
        splits = synthetic_splits(d=16, n_features=32, n_train=1000, n_val=64, seed=5)
        return [b for (b,) in module(splits, batch_size=256, shuffle=False).train_loader(device=torch.device("cpu"))]

    assert all(torch.equal(a, b) for a, b in zip(batches(SyntheticData), batches(DataModule), strict=True))
    # on a GPU the batches are made in the training process: loader workers are refused before anything moves
    data = SyntheticData(synthetic_splits(d=16, n_features=32, n_train=1000, n_val=64), batch_size=256, num_workers=2)
    with pytest.raises(ConfigError, match=r"num_workers=2.*generated on the GPU.*set data.num_workers=0"):
        data.train_loader(device=torch.device("cuda"))
    assert data.splits["train"].true_features.device.type == "cpu"


# ---- 9. Quality: a real run recovers the true features -------------------------------------------------------------

QUALITY_OVERRIDES = (
    "+experiment=sae",
    "data.splits.d=32",
    "model.n_latents=128",
    "model.k=3",
    "model.dead_window=50st",
    "data.splits.n_features=64",
    "data.splits.mean_active=2",
    "data.batch_size=512",
    "data.val_batch_size=2048",
    "data.splits.n_val=2048",
    "optimizer.lr=3e-3",
    "trainer.max_duration=600st",
)


def test_topk_sae_recovers_synthetic_features(compose_cfg: Callable[..., DictConfig]) -> None:
    run = build(compose_cfg(*QUALITY_OVERRIDES))
    assert isinstance(run.task, TopKSAE) and run.task.W_dec.shape == (128, 32)
    truth = run.val_loader.dataset.true_features
    assert truth.shape == (64, 32)
    assert feature_recovery(run.task.W_dec.detach(), truth)["recovered_0.9"] < 0.2  # not there at the start
    fit(run)
    assert run.stop_reason == "max_duration" and run.progress.step == 600
    assert run.state.nonfinite_steps == 0
    m = run.state.metrics
    assert m["val/recovered_0.9"] >= 0.95, m
    assert m["val/mmcs"] >= 0.95
    assert m["val/fve"] > 0.8
    assert m["val/l0"] <= 3.0
    assert float((run.task.W_dec.detach().norm(dim=1) - 1).abs().max()) < 1e-5


# ---- 10. Activation files ------------------------------------------------------------------------------------------


@pytest.fixture
def matrix() -> torch.Tensor:
    return torch.randn(200, 8, generator=torch.Generator().manual_seed(0))


def _rows(dataset: RowData, indices: list[int]) -> torch.Tensor:
    return dataset.__getitems__(indices)[0]


def test_activation_files_load_in_every_format(tmp_path: Path, matrix: torch.Tensor) -> None:
    from safetensors.torch import save_file

    np.save(tmp_path / "acts.npy", matrix.numpy())
    torch.save(matrix, tmp_path / "acts.pt")
    save_file({"acts": matrix}, str(tmp_path / "acts.safetensors"))
    for name in ("acts.npy", "acts.pt", "acts.safetensors"):
        splits = file_splits(str(tmp_path / name), val_fraction=0.1, d=8)
        assert (len(splits["train"]), len(splits["val"])) == (180, 20), name
        assert torch.equal(_rows(splits["train"], [0, 1, 179]), matrix[[0, 1, 179]]), name
        assert torch.equal(_rows(splits["val"], [0, 19]), matrix[[180, 199]]), name
        assert _rows(splits["train"], [3]).dtype == torch.float32
    npy = file_splits(str(tmp_path / "acts.npy"))
    assert isinstance(npy["train"].array, np.memmap)
    assert (len(npy["train"]), len(npy["val"])) == (190, 10)  # default val_fraction 0.05
    assert set(file_splits(str(tmp_path / "acts.npy"), val_fraction=0.0)) == {"train"}

    np.save(tmp_path / "val.npy", matrix[:30].numpy())
    separate = file_splits(str(tmp_path / "acts.pt"), val_path=str(tmp_path / "val.npy"))
    assert (len(separate["train"]), len(separate["val"])) == (200, 30)
    assert torch.equal(_rows(separate["val"], [29]), matrix[[29]])

    module = ActivationFiles(str(tmp_path / "acts.safetensors"), val_fraction=0.25, batch_size=32)
    (batch,) = next(iter(module.train_loader()))
    assert batch.shape == (32, 8)
    assert len(module.val_loader().dataset) == 50


def test_activation_files_config_builds(compose_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    np.save(tmp_path / "acts.npy", np.random.default_rng(0).standard_normal((300, 8), dtype=np.float32))
    cfg = compose_cfg(
        "+experiment=sae",
        "data=activations_file",
        f"data.train_path={tmp_path / 'acts.npy'}",
        "model.n_latents=32",
        "model.k=2",
        "data.batch_size=64",
        "callbacks=none",
        "trainer.max_duration=3st",
    )
    run = fit(build(cfg))  # no model.d_in: the SAE's width is the file's
    assert run.task.d_in == 8 and run.progress.step == 3 and 0 < run.state.metrics["val/fve"] <= 1
    with pytest.raises(ConfigError, match=r"shape \[300, 8\].*\[N, 16\]"):
        build(
            compose_cfg(
                "+experiment=sae", "data=activations_file", f"data.train_path={tmp_path / 'acts.npy'}", "model.d_in=16"
            )
        )


def test_activation_files_refuse_bad_contents(tmp_path: Path, matrix: torch.Tensor) -> None:
    from safetensors.torch import save_file

    np.save(tmp_path / "flat.npy", matrix.flatten().numpy())
    with pytest.raises(ConfigError, match=r"shape \[1600\]"):
        file_splits(str(tmp_path / "flat.npy"))
    np.save(tmp_path / "acts.npy", matrix.numpy())
    with pytest.raises(ConfigError, match=r"shape \[200, 8\]; expected a floating-point \[N, 9\]"):
        file_splits(str(tmp_path / "acts.npy"), d=9)
    np.save(tmp_path / "val9.npy", np.zeros((10, 9), dtype=np.float32))
    with pytest.raises(ConfigError, match=r"shape \[10, 9\]"):
        file_splits(str(tmp_path / "acts.npy"), val_path=str(tmp_path / "val9.npy"))
    np.save(tmp_path / "ints.npy", np.arange(80).reshape(10, 8))
    with pytest.raises(ConfigError, match=r"int64"):
        file_splits(str(tmp_path / "ints.npy"))
    torch.save(torch.arange(80).reshape(10, 8), tmp_path / "ints.pt")
    with pytest.raises(ConfigError, match=r"torch.int64"):
        file_splits(str(tmp_path / "ints.pt"))
    save_file({"acts": torch.ones(10, 8, dtype=torch.int32)}, str(tmp_path / "ints.safetensors"))
    with pytest.raises(ConfigError, match=r"torch.int32"):
        file_splits(str(tmp_path / "ints.safetensors"))
    with pytest.raises(ConfigError, match="does not exist"):
        file_splits(str(tmp_path / "missing.npy"))
    (tmp_path / "acts").mkdir()  # e.g. a source.cache folder
    with pytest.raises(ConfigError, match="is a folder: give a file"):
        file_splits(str(tmp_path / "acts"))
    (tmp_path / "acts.csv").write_text("1,2\n")
    with pytest.raises(ConfigError, match="unknown format"):
        file_splits(str(tmp_path / "acts.csv"))

    torch.save({"resid": matrix, "mlp": matrix * 2}, tmp_path / "two.pt")
    with pytest.raises(ConfigError, match=r"\['mlp', 'resid'\].*data.key"):
        file_splits(str(tmp_path / "two.pt"))
    with pytest.raises(ConfigError, match=r"no tensor 'attn'"):
        file_splits(str(tmp_path / "two.pt"), key="attn")
    chosen = file_splits(str(tmp_path / "two.pt"), key="mlp", val_fraction=0.0)
    assert torch.equal(_rows(chosen["train"], [5]), matrix[[5]] * 2)
    save_file({"a": matrix, "b": matrix.clone()}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ConfigError, match=r"data.key"):
        file_splits(str(tmp_path / "two.safetensors"))


# ---- 11. SAEs on live activations of a trained digits MLP ----------------------------------------------------------


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished (2-epoch) digits run folder, as load_trained reads it: model.safetensors and .hydra/config.yaml."""
    directory = tmp_path_factory.mktemp("digits")
    torch.set_num_threads(1)
    cfg = compose_job(directory, "logger=none", "+experiment=digits", "trainer.max_duration=2ep")
    run = fit(build(cfg))
    HydraConfig.instance().cfg = None
    assert run.progress.epoch == 2
    (directory / ".hydra").mkdir()
    save_weights(run.task, directory / "model.safetensors")
    OmegaConf.save(cfg, directory / ".hydra" / "config.yaml")
    yield directory


SAE_DIGITS_SMALL = (
    "trainer.max_duration=40st",
    "data.samples_per_epoch=2560",
    "data.buffer_size=2048",
    "model.n_latents=1024",
)


def test_sae_digits_end_to_end(compose_cfg: Callable[..., DictConfig], digits_run: Path) -> None:
    run: Run = build(compose_cfg("+experiment=sae_digits", f"source.checkpoint={digits_run}", *SAE_DIGITS_SMALL))
    assert isinstance(run.task, TopKSAE) and run.task.d_in == 512
    (batch,) = next(iter(run.train_loader))
    assert batch.shape == (256, 512) and bool((batch >= 0).all())  # after the ReLU
    fit(run)
    assert run.progress.step == 40 and run.state.nonfinite_steps == 0
    m = run.state.metrics
    assert "val/loss_recovered" in m, sorted(m)
    # The spliced classifier may score a little better than the clean one (the SAE denoises its hidden layer: 1.003
    # with encoder_init=fit), so loss recovered is near 1, not at most 1.
    assert 0.8 <= m["val/loss_recovered"] <= 1.05
    assert m["val/ce_zero_ablated"] > m["val/ce_clean"]
    assert m["val/ce_spliced"] < m["val/ce_zero_ablated"]
    assert m["val/fve"] > 0
    # loss_recovered is what its definition says
    expected = (m["val/ce_zero_ablated"] - m["val/ce_spliced"]) / (m["val/ce_zero_ablated"] - m["val/ce_clean"])
    assert m["val/loss_recovered"] == pytest.approx(expected)


def test_sae_digits_wrong_module_lists_the_modules(compose_cfg: Callable[..., DictConfig], digits_run: Path) -> None:
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={digits_run}", "source.module=net.99")
    with pytest.raises(
        ConfigError,
        match=r"source.module='net.99' is not a module of MLPClassifier: the nearest of its 8 are net\.6, net\.5",
    ):
        build(cfg)


def test_the_synthetic_task_s_width_sets_the_sae_s_and_a_forced_other_one_is_refused(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    assert build(compose_cfg("+experiment=sae", "data.splits.d=32", "trainer.max_duration=1st")).task.d_in == 32
    with pytest.raises(ConfigError, match=r"model.d_in=64, but the data gives 256 \(SyntheticData\); leave model.d_in"):
        build(compose_cfg("+experiment=sae", "model.d_in=64"))


def test_sae_digits_wrong_width_is_refused(compose_cfg: Callable[..., DictConfig], digits_run: Path) -> None:
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={digits_run}", "model.d_in=64")
    with pytest.raises(ConfigError, match=r"512 features but model.d_in=64"):
        build(cfg)


def test_sae_digits_missing_checkpoint(compose_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="does not exist"):
        build(cfg)
    (tmp_path / "empty").mkdir()
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={tmp_path / 'empty'}")
    with pytest.raises(ConfigError, match=r"model.safetensors does not exist"):
        build(cfg)


def test_hooked_buffer_smaller_than_two_batches_is_refused(digits_run: Path) -> None:
    with pytest.raises(ConfigError, match="must hold at least two batches"):
        LiveActivations(str(digits_run), "net.1", buffer_size=256, samples_per_epoch=1024, batch_size=256)
    data = LiveActivations(str(digits_run), "net.1", buffer_size=512, samples_per_epoch=1024, batch_size=256)
    batches = [b for (b,) in data.train_loader()]
    assert [tuple(b.shape) for b in batches] == [(256, 512)] * 4  # refills as it goes


def test_resampling_points_dead_latents_at_badly_reconstructed_inputs() -> None:
    from types import SimpleNamespace

    from experiments.sae.callbacks import ResampleDead
    from runner.data import DataModule, TensorData
    from runner.distributed.strategies import Single
    from runner.progress import TrainingProgress

    torch.manual_seed(0)
    sae = ReLUSAE(d_in=16, n_latents=32, dead_window="5st", geometric_median_init=False)
    x = torch.randn(256, 16)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    sae.training_step((x,))["loss"].backward()
    opt.step()
    dead = torch.tensor([3, 7, 11])
    sae.since_fired[dead] = 10
    before = sae.W_dec.detach().clone()
    loader = DataModule({"train": TensorData(x)}, batch_size=64, shuffle=False).train_loader()
    progress = TrainingProgress("100st", batch_size=64, batches_per_epoch=4, samples_per_epoch=256)
    progress.count_micro_batch(64)
    progress.count_optimizer_step()  # step 1: '1st' ticks
    run = SimpleNamespace(
        task=sae, progress=progress, train_loader=loader, optimizer=opt, strategy=Single("cpu"), world_size=1
    )
    callback = ResampleDead(every="1st", until="1.0dur", samples=256)
    callback.on_optimizer_step(run)
    assert callback.resampled == 3
    live = torch.ones(32, dtype=torch.bool)
    live[dead] = False
    assert torch.equal(sae.W_dec[live], before[live])  # live latents untouched
    assert not torch.allclose(sae.W_dec[dead], before[dead])
    torch.testing.assert_close(sae.W_dec[dead].norm(dim=1), torch.ones(3))
    assert torch.all(sae.b_enc[dead] == 0) and torch.all(sae.since_fired[dead] == 0)
    for name in ("exp_avg", "exp_avg_sq"):  # Adam forgets what it knew about the resampled latents only
        assert torch.all(opt.state[sae.W_dec][name][dead] == 0)
        assert torch.any(opt.state[sae.W_dec][name][live] != 0)
    # each new direction is one of the inputs (minus b_dec), normalised
    xn = x * sae.input_scale
    cos = F.normalize(sae.W_dec[dead], dim=1) @ F.normalize(xn - sae.b_dec, dim=1).t()
    assert torch.all(cos.max(dim=1).values > 0.9999)


def test_a_run_that_resamples_dead_latents_resumes_exactly(compose_cfg, tmp_path) -> None:
    # the inputs are drawn by indices from the step, not from the loader's place in its epoch (which a resumed run
    # starts anew)
    overrides = [
        *("+experiment=sae", "model=sae_relu", "model.n_latents=2048", "model.l1_coeff=20.0", "model.l1_warmup=0st"),
        *("model.dead_window=2st", "data.splits.n_train=4096", "data.splits.n_val=512", "data.batch_size=128"),
        "trainer.max_duration=24st",
        *("trainer.val_interval=12st", "trainer.log_interval=4st", "callbacks=[sae_resample]", "logger=jsonl"),
        *("callbacks.sae_resample.every=3st", "callbacks.sae_resample.until=1.0dur"),
        "callbacks.sae_resample.samples=256",
        "checkpoint.interval=1000st",
    ]
    whole, _ = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=7)
    assert whole.callbacks[0].resampled > 0


@pytest.mark.parametrize("model", ["sae_topk", "sae_batchtopk", "sae_matryoshka", "sae_relu", "sae_jumprelu"])
def test_every_sae_trains_under_bf16_autocast_close_to_fp32(compose_cfg: Callable[..., DictConfig], model: str) -> None:
    # precision=bf16 on the CPU (as on a GPU): the encoder's product in bf16, the codes decoded in the weights' fp32,
    # AuxK over dead latents (a 2-step window), the sparse backward; weights stay fp32 and the fit follows fp32's
    def trained(precision: str) -> Run:
        overrides = ["+experiment=sae", f"model={model}", "model.dead_window=2st", "data.batch_size=256"]
        overrides += ["model.n_latents=512", "data.splits.d=128", "data.splits.n_features=256"]
        overrides += ["data.splits.n_val=512", "trainer.max_duration=20st", "checkpoint=none", "logger=none"]
        return train_cfg(compose_cfg(*overrides, f"precision={precision}", "callbacks=none"))

    bf16, fp32 = trained("bf16"), trained("fp32")
    assert all(p.dtype == torch.float32 for p in bf16.task.parameters())
    assert bf16.state.nonfinite_steps == 0 and bf16.state.metrics["train/fve"] > 0.1  # 20 steps: learning
    # the training fit (BatchTopK's inference threshold is still settling at 20 steps: its val/fve is not yet)
    assert bf16.state.metrics["train/fve"] == pytest.approx(fp32.state.metrics["train/fve"], abs=0.03)
    assert 0 < bf16.state.metrics["val/fve"] < 1


# ---- 12. On a GPU (skipped without one): data made there, and steps that never wait for it -------------------------


def gpu(test: Callable) -> Callable:
    """Marks a test `gpu` and skips it without a CUDA device (as tests/unit/test_gpu.py does for its whole module)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@gpu
@pytest.mark.parametrize("correlation", [0.0, 0.6])
def test_synthetic_batches_are_made_on_the_gpu_reproducibly_by_position(correlation: float) -> None:
    def module() -> SyntheticData:
        splits = synthetic_splits(d=32, n_features=16, mean_active=3.0, n_train=8192, n_val=64, correlation=correlation)
        return SyntheticData(splits, batch_size=512, shuffle=False, seed=0)

    data, cuda = module(), torch.device("cuda")
    loader = data.train_loader(device=cuda)
    batches = [b for (b,) in loader]
    assert all(b.is_cuda for b in batches) and not loader.pin_memory
    assert data.splits["train"].true_features.is_cuda and data.splits["val"].true_features.is_cuda
    assert not data.splits["val"].tensors[0].is_cuda  # validation data is the CPU's, whatever the device
    again = [b for (b,) in module().train_loader(device=cuda)]
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    loader.batch_sampler.set_epoch(0, skip=5)  # a resumed run starts at the sixth batch: the same data
    assert all(torch.equal(a, b) for a, b in zip(batches[5:], [b for (b,) in loader], strict=True))
    # the CUDA generator's stream is not the CPU's: other values, the same distribution. With no more features than
    # dimensions each sample's coefficients are recovered exactly; feature i's mean is p_i x the mean magnitude 0.5.
    features, probs = data.splits["train"].true_features.cpu().double(), data.splits["train"].source.probs.cpu()
    on_cpu, on_gpu = torch.cat([b for (b,) in module().train_loader()]), torch.cat(batches).cpu()
    assert not torch.allclose(on_gpu[:512], on_cpu[:512])
    for x in (on_cpu, on_gpu):
        means = torch.linalg.lstsq(features.t(), x.double().t()).solution.t().mean(0)
        torch.testing.assert_close(means, probs.double() * 0.5, rtol=0, atol=0.02)


@gpu
@pytest.mark.parametrize("model", ["sae_topk", "sae_batchtopk", "sae_relu", "sae_jumprelu"])
def test_sae_steps_on_the_gpu_never_wait_for_it(
    compose_cfg: Callable[..., DictConfig], model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Steps 3..10 neither log, validate nor checkpoint: data generation, forward, AuxK over dead latents (a 2-step
    # window makes some), backward, the fused optimizer and the dead-latent clock must not sync once. AuxK's picks
    # (256 rows x d/2) go through CUDA's sparse product in several slices here, whose bounds must not read it either.
    monkeypatch.setattr(sparse_module, "CHUNK_FLOATS", 2**20)
    cfg = compose_cfg(
        "+experiment=sae",
        f"model={model}",
        "model.dead_window=2st",
        "data.batch_size=256",
        "data.splits.n_val=512",
        "trainer.max_duration=12st",
        "trainer.log_interval=12st",
        "trainer.val_interval=12st",
        "checkpoint=none",
        "optimizer.fused=true",
    )
    run = build(cfg)
    assert run.device.type == "cuda" and next(iter(run.train_loader))[0].is_cuda
    watch = SyncsAreErrors(first=2, last=10)
    run.callbacks.append(watch)
    if model in ("sae_topk", "sae_batchtopk"):  # as a log row that saw dead latents would: AuxK on from step 3
        run.callbacks.append(AuxKOn(after=2))
    fit(run)
    assert watch.guarded == 8 and run.progress.step == 12 and run.state.nonfinite_steps == 0
    if model in ("sae_topk", "sae_batchtopk"):  # ReLU and JumpReLU have no AuxK
        assert run.task.n_dead > 0 and run.state.metrics["train/auxk_loss"] > 0  # AuxK trained dead latents


class AuxKOn(Callback):
    """Turns an SAE's AuxK on after optimizer step `after`, as a log row that saw dead latents does."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_step_end(self, run: Run) -> None:
        if run.progress.step == self.after:
            run.task.auxk_active = True


@gpu
def test_auxk_on_the_gpu_runs_only_while_the_last_log_row_saw_dead_latents() -> None:
    torch.manual_seed(0)
    sae = TopKSAE(d_in=16, n_latents=64, k=4, dead_window="1st").cuda()
    x = torch.randn(8, 16, device="cuda")  # 8 rows fire at most 32 of the 64 latents
    sae.training_step(x)
    sae.after_optimizer_step()  # every latent that did not fire is dead now
    assert sae.n_dead > 0 and not sae.auxk_active
    assert float(sae.training_step(x)["auxk_loss"]) == 0  # skipped: no log row has seen them yet
    sae.logged({"train/silent_fraction": 0.5})
    assert sae.auxk_active and float(sae.training_step(x)["auxk_loss"]) > 0
    sae.logged({"train/silent_fraction": 0.0})
    assert not sae.auxk_active


# ---- The field's metric bugs, as regression tests -----------------------------------------------------------------


def test_validation_fve_is_streamed_over_the_split_about_its_mean_in_float64() -> None:
    from helpers import make_run

    from runner.data import TensorData
    from runner.loop import evaluate

    # An SAE whose reconstruction is 0.9 x (positive inputs, identity weights but for the decoder's scale), on two
    # batches around 5 + 1 and 5 - 1: about zero, per batch, or over the split, FVE is three different numbers.
    d = 8
    sae = TopKSAE(d_in=d, n_latents=d, k=d, geometric_median_init=False, normalize_input=False)
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(d))
        sae.W_dec.copy_(0.9 * torch.eye(d))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(64, d, generator=g) * 0.5 + 6, torch.randn(64, d, generator=g) * 0.5 + 4])
    run = make_run(sae, splits={"train": TensorData(x), "val": TensorData(x)}, batch_size=64)
    run.val_loader = DataModule(
        {"train": TensorData(x), "val": TensorData(x)}, val_batch_size=64, batch_size=64
    ).val_loader()
    metrics = evaluate(run)
    xd = x.double()
    sse = (0.1 * xd).pow(2).sum()
    fve = 1 - sse / (xd - xd.mean(0)).pow(2).sum()
    assert metrics["val/fve"] == pytest.approx(float(fve), rel=1e-6)  # the SAE decodes in float32
    about_zero = 1 - sse / xd.pow(2).sum()
    batches = [xd[:64], xd[64:]]
    batchwise = sum(1 - (0.1 * b).pow(2).sum() / (b - b.mean(0)).pow(2).sum() for b in batches) / 2
    assert abs(metrics["val/fve"] - float(about_zero)) > 0.1 and abs(metrics["val/fve"] - float(batchwise)) > 0.1
    assert metrics["val/nmse"] == pytest.approx(float(sse / xd.pow(2).sum()), rel=1e-5)


def test_dead_fraction_counts_latents_that_never_fire_over_the_whole_split_not_per_batch() -> None:
    from helpers import make_run

    from runner.data import TensorData
    from runner.loop import evaluate

    # Identity encoder, k=1: each input fires the latent of its largest coordinate. The first batch fires latent 0
    # only, the second latent 1 only: over the split 2 of 4 latents never fire (per batch, 3 of 4 would look dead).
    sae = TopKSAE(d_in=4, n_latents=4, k=1, geometric_median_init=False, normalize_input=False)
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(4))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    x = torch.cat([torch.eye(4)[0].expand(8, 4), torch.eye(4)[1].expand(8, 4)]) * 2
    data = DataModule({"train": TensorData(x), "val": TensorData(x)}, val_batch_size=8, batch_size=8)
    run = make_run(sae, splits={"train": TensorData(x), "val": TensorData(x)}, batch_size=8)
    run.val_loader = data.val_loader()
    metrics = evaluate(run)
    assert metrics["val/dead_fraction"] == 0.5
    assert metrics["val/silent_fraction"] == 0.0  # no training step yet: none silent for its window


def test_a_batch_s_firing_counts_from_top_k_indices_are_the_dense_codes_counts() -> None:
    from experiments.sae.objectives import split_statistics

    # 3 rows, top 2 of 5 latents; a selected latent whose value is 0 (row 1's latent 4) did not fire
    values = torch.tensor([[2.0, 1.0], [3.0, 0.0], [1.0, 0.5]])
    indices = torch.tensor([[0, 3], [3, 4], [1, 0]])
    dense = torch.zeros(3, 5).scatter(1, indices, values)
    target = torch.randn(3, 4)
    norms = torch.ones(5)
    sparse, whole = (split_statistics(target, target, v, i, 5, norms) for v, i in ((values, indices), (dense, None)))
    assert sparse["firing_rate"].tolist() == whole["firing_rate"].tolist() == [2 / 3, 1 / 3, 0.0, 2 / 3, 0.0]
    assert sparse["code_mass"].tolist() == whole["code_mass"].tolist() == [2.5 / 3, 1 / 3, 0.0, 4 / 3, 0.0]
    assert sparse["l0"].item() == whole["l0"].item() == 5 / 3
    assert sparse["firing_rate"].dtype == sparse["l0"].dtype == torch.float64


def test_latents_that_fire_through_shrunken_decoder_rows_are_counted_faint() -> None:
    from experiments.sae.coders.jumprelu import JumpReLUSAE
    from runner.validation import summarize

    torch.manual_seed(0)
    sae = JumpReLUSAE(d_in=16, n_latents=64, unit_norm_decoder=False, threshold_init=0.01, normalize_input=False)
    x = torch.randn(512, 16)
    with torch.no_grad():
        sae.b_enc.fill_(1.0)  # every latent fires on every row: none is dead, so faintness is the rows' alone
        sae.W_dec[:5] *= 0.01  # 5 of 64 rows at a hundredth of the others' norm
        sae.W_dec[5:8] *= 0.5  # half as loud: not faint
    out = summarize(sae, {k: v.double() for k, v in sae.validation_step(x).items()})
    assert out["dead_fraction"].item() == 0.0
    assert out["faint_fraction"].item() == 5 / 64
    with torch.no_grad():
        sae.b_enc[:5] = -50.0  # the shrunken latents stop firing: dead, not faint
    out = summarize(sae, {k: v.double() for k, v in sae.validation_step(x).items()})
    assert out["dead_fraction"].item() == 5 / 64 and out["faint_fraction"].item() == 0.0
    (line,) = sae.advice({"val/faint_fraction": 5 / 64, "val/dead_fraction": 0.0})
    assert line.startswith("7.8% of the coder's 64 latents (5) fire but write under a tenth of the median")
    assert "model.unit_norm_decoder=true" in line
    assert not sae.advice({"val/faint_fraction": 0.01, "val/dead_fraction": 0.0})  # 1% is not said


def test_auxk_reconstructs_the_residual_without_the_decoder_bias_a_second_time() -> None:
    # The residual x - recon already holds b_dec once (recon = codes @ W_dec + b_dec); the dead latents' reconstruction
    # of it must not add b_dec again (a bug of the field's reference code).
    sae = _topk(normalize_input=False, k_aux=4, auxk_coeff=1.0)
    with torch.no_grad():
        sae.b_dec.fill_(3.0)
        sae.dead.fill_(True)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    pre = sae.pre_activations(x)
    values, indices = sae.activate(pre)
    recon = sae.decode(values, indices)
    out = sae.aux_loss(x, pre, values, indices, recon)
    residual = (x - recon).detach()
    top, picked = pre.topk(4, dim=1)
    aux = torch.zeros_like(pre).scatter(1, picked, F.relu(top)) @ sae.W_dec  # no b_dec
    expected = (aux - residual).pow(2).sum(1).mean() / (residual - residual.mean(0)).pow(2).sum(1).mean()
    torch.testing.assert_close(out["auxk_loss"], expected.detach())
    twice = (aux + sae.b_dec - residual).pow(2).sum(1).mean() / (residual - residual.mean(0)).pow(2).sum(1).mean()
    assert float((twice - expected).abs().detach()) > 0.1  # the check can tell the two apart


def test_a_summary_that_names_the_field_s_count_unfired_fraction_is_read_as_dead_fraction() -> None:
    from experiments.sae.metrics import summary_metric

    # a summary whose dead_fraction is the training window's count and whose unfired_fraction the field's
    older = {"val/dead_fraction": 0.4, "val/unfired_fraction": 0.01, "val/k2/dead_fraction": 0.3}
    older["val/k2/unfired_fraction"] = 0.0
    assert summary_metric(older, "val/dead_fraction") == 0.01 and summary_metric(older, "val/k2/dead_fraction") == 0.0
    today = {"val/dead_fraction": 0.02, "val/silent_fraction": 0.4, "val/fve": 0.9}
    assert summary_metric(today, "val/dead_fraction") == 0.02 and summary_metric(today, "val/fve") == 0.9
