"""data=synth_sae_bench's world (experiments/sae/sources/synth_bench*.py) and SynthSAEBench's metrics
(experiments/sae/evals/ground_truth.py), each metric on a case whose answer is known. The bit-for-bit agreement with
SAELens's generator and metrics is tests/e2e/test_synth_bench_agreement.py."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from experiments.sae.coders.activations import ReLUSAE
from experiments.sae.evals.ground_truth import Scores, abs_cosines, mcc, score_sae, uniqueness
from experiments.sae.sources.synth_bench import SynthBench, synth_bench_splits
from experiments.sae.sources.synth_bench_world import Hierarchy, sample_codes
from runner import ConfigError

SMALL = {"num_features": 256, "d": 32, "roots": 4, "ortho_steps": 0, "rank": 4}


def test_the_hierarchy_is_built_breadth_first_with_its_exclusive_parents() -> None:
    h = Hierarchy(30, roots=2, branching=3, depth=2, mutually_exclusive=1.0, seed=0)
    assert h.children[0] == [2, 3, 4] and h.children[1] == [5, 6, 7]
    assert h.children[2] == [8, 9, 10] and h.children[7] == [23, 24, 25]
    assert 26 not in h.parent and h.parent[25] == 7 and h.level[25] == 2
    assert h.exclusive == {0, 1, 2, 3, 4, 5, 6, 7}  # every parent with two or more children
    assert len(Hierarchy(30, 2, 3, 2, mutually_exclusive=0.5, seed=0).exclusive) == 4


def test_children_fire_only_under_their_parent_and_exclusive_siblings_never_together() -> None:
    world = SynthBench(**SMALL, seed=1)
    codes = world.sample_with_codes(4096, torch.Generator().manual_seed(0))[1]
    on = codes > 0
    h = world.hierarchy
    for child, parent in h.parent.items():
        assert not (on[:, child] & ~on[:, parent]).any()
    for node in h.exclusive:
        assert on[:, h.children[node]].sum(1).max() <= 1
    # not vacuous: before the hierarchy (the same draws up to there), orphans and sibling pairs were common
    args = world.probs, world.factor, world.diag_sqrt, world.means, world.stds, None
    raw = sample_codes(4096, *args, torch.Generator().manual_seed(0)) > 0
    assert torch.equal(raw & on, on)
    assert any((raw[:, c] & ~raw[:, p]).any() for c, p in h.parent.items())
    assert any(raw[:, h.children[node]].sum(1).max() > 1 for node in h.exclusive)
    assert on[:, list(h.parent)].any()


def test_scaling_by_the_parent_multiplies_a_child_by_its_parent_over_the_parents_mean_down_the_chain() -> None:
    # root 0 -> children 1, 2; 1 -> 3, 4; 2 -> 5, 6; no exclusive groups, so no random draws
    plain = Hierarchy(7, roots=1, branching=2, depth=2, mutually_exclusive=0.0, seed=0)
    scaled = Hierarchy(7, roots=1, branching=2, depth=2, mutually_exclusive=0.0, seed=0, scale_by_parent=True)
    assert scaled.children == {0: [1, 2], 1: [3, 4], 2: [5, 6]}
    means = torch.tensor([2.0, 4.0, 5.0, 1.0, 1.0, 1.0, 1.0])
    codes = torch.tensor([[3.0, 2.0, 0.0, 4.0, 0.0, 1.0, 0.0], [0.0, 2.0, 1.0, 4.0, 1.0, 1.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    # feature 1: 2 * 3/2 = 3; feature 3: 4 * (its parent's scaled 3) / 4 = 3; 5 under the silent 2: 0; row 2: no root
    expected = torch.tensor([[3.0, 3.0, 0.0, 3.0, 0.0, 0.0, 0.0], [0.0] * 7])
    assert torch.equal(scaled.apply(codes, g, means), expected)
    assert torch.equal(plain.apply(codes, g), torch.tensor([[3.0, 2.0, 0.0, 4.0, 0.0, 0.0, 0.0], [0.0] * 7]))


def test_scaling_by_the_parent_changes_magnitudes_never_which_features_fire() -> None:
    worlds = [SynthBench(**SMALL, seed=1, scale_children_by_parent=flag) for flag in (False, True)]
    plain, scaled = (w.sample_with_codes(4096, torch.Generator().manual_seed(0))[1] for w in worlds)
    assert torch.equal(plain > 0, scaled > 0)  # the same draws: the exclusive groups' winners too
    roots = list(range(4))
    assert torch.equal(plain[:, roots], scaled[:, roots])
    children = list(worlds[1].hierarchy.parent)
    assert not torch.equal(plain[:, children], scaled[:, children])


def test_activations_are_the_codes_through_the_directions_plus_the_bias_and_reproducible() -> None:
    world = SynthBench(**SMALL, seed=2)
    x, codes = world.sample_with_codes(64, torch.Generator().manual_seed(5))
    torch.testing.assert_close(x, codes @ world.features + world.bias)
    assert torch.allclose(world.features.norm(dim=1), torch.ones(256)) and world.bias.norm() == pytest.approx(0.5)
    again = SynthBench(**SMALL, seed=2).sample(64, torch.Generator().manual_seed(5))
    assert torch.equal(x, again)
    assert not torch.equal(x, SynthBench(**SMALL, seed=3).sample(64, torch.Generator().manual_seed(5)))


def test_the_splits_generate_by_position_and_keep_the_validation_codes() -> None:
    splits = synth_bench_splits(n_train=10_000, n_val=300, seed=4, **SMALL)
    train, val = splits["train"], splits["val"]
    assert torch.equal(train.__getitems__(list(range(8, 16)))[0], train.__getitems__(list(range(8, 16)))[0])
    assert len(val) == 300 and val.true_features.shape == (256, 32)
    x, codes = next(val.truth_batches())
    torch.testing.assert_close(x, codes @ val.source.features + val.source.bias)


@pytest.mark.parametrize(
    ("override", "message"),
    [({"min_prob": 0.5}, "min_prob"), ({"roots": -1}, "roots"), ({"mutually_exclusive": 2.0}, "share")],
)
def test_bad_settings_are_refused(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SynthBench(**{**SMALL, **override})


def _orthonormal(n: int, d: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)))
    return q[:n]


def _codes(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(n, k, generator=g) < 0.2) * (1 + torch.rand(n, k, generator=g))


def test_a_decoder_that_is_the_truth_with_its_codes_scores_one_everywhere_signs_and_order_aside() -> None:
    truth, codes = _orthonormal(16, 32), _codes(2000, 16)
    x = codes @ truth
    perm, signs = torch.randperm(16, generator=torch.Generator().manual_seed(2)), torch.tensor([1.0, -1.0]).repeat(8)
    scores = Scores(signs[:, None] * truth[perm], truth)
    scores.add(x, codes[:, perm], x, codes)
    got = scores.result()
    for key in ("mcc", "uniqueness", "precision", "recall", "f1", "accuracy", "explained_variance", "shrinkage"):
        assert got[key] == pytest.approx(1.0, abs=1e-6), key
    assert got["dead_latents"] == 0 and got["l0"] == got["true_l0"] == pytest.approx((codes > 0).sum(1).float().mean())


def test_half_true_half_orthogonal_latents_score_what_is_computed_by_hand() -> None:
    basis = torch.eye(32)  # exact zeros: an orthogonal row's best match is then feature 0 (argmax's first maximum)
    truth, decoder = basis[:16], torch.cat([basis[8:16], basis[16:24]])  # latents 8..15: orthogonal to every feature
    codes = _codes(2000, 16)
    latents = torch.cat([codes[:, 8:], torch.zeros(2000, 8)], 1)  # the true half fires as its features, the rest never
    recon = latents @ decoder
    scores = Scores(decoder, truth)
    scores.add(codes @ truth, latents, recon, codes)
    got = scores.result()
    assert got["mcc"] == pytest.approx(0.5, abs=1e-6)  # 8 matches at |cos| 1, 8 at 0
    assert got["uniqueness"] == pytest.approx(9 / 16)  # 8 distinct, and the orthogonal rows all argmax to feature 0
    assert got["precision"] == got["recall"] == got["f1"] == pytest.approx(0.5)
    assert got["dead_latents"] == 8
    # the reconstruction keeps features 8..15: its residual is the codes of features 0..7
    x = codes @ truth
    mse = (codes[:, :8] ** 2).sum(1).mean()
    variance = (x**2).sum(1).mean() - (x.mean(0) ** 2).sum()
    assert got["explained_variance"] == pytest.approx((1 - mse / variance).item(), rel=1e-5)


def test_precision_and_recall_count_false_alarms_and_misses() -> None:
    truth, codes = _orthonormal(2, 8), torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    latents = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # latent 0: 1 hit, 1 miss, 1 false alarm
    scores = Scores(truth, truth)
    scores.add(codes @ truth, latents, latents @ truth, codes)
    got = scores.result()
    assert got["precision"] == pytest.approx((0.5 + 1) / 2) and got["recall"] == pytest.approx((0.5 + 1) / 2)
    assert got["f1"] == pytest.approx((0.5 + 1) / 2) and got["accuracy"] == pytest.approx((0.5 + 1) / 2)


def test_mcc_is_a_one_to_one_match_where_uniqueness_lets_latents_share() -> None:
    truth = _orthonormal(4, 8)
    twice = torch.cat([truth[:2], truth[:2]])  # each of two features twice
    assert uniqueness(twice, truth) == pytest.approx(0.5)
    assert mcc(twice, truth) == pytest.approx(0.5, abs=1e-6)  # one copy of each matches, the other two are at 0


def test_an_sae_whose_decoder_is_the_truth_and_encoder_its_transpose_scores_one() -> None:
    truth, codes = _orthonormal(16, 32), _codes(512, 16)
    sae = ReLUSAE(d_in=32, n_latents=16, normalize_input=False, geometric_median_init=False)
    with torch.no_grad():
        sae.W_dec.copy_(truth)
        sae.W_enc.copy_(truth.T)
        sae.b_enc.fill_(-1e-3)  # rounding leaves ~1e-7 where a code is 0, which would count as firing
        sae.b_dec.zero_()
    got = score_sae(sae, truth, [(codes @ truth, codes)])
    assert got["mcc"] == pytest.approx(1.0, abs=1e-6) and got["f1"] == pytest.approx(1.0)
    assert got["explained_variance"] == pytest.approx(1.0, abs=1e-4) and sae.training


def test_the_world_is_one_whatever_the_run_seed_and_never_the_stream_of_the_sae_init() -> None:
    worlds = [synth_bench_splits(n_train=10, n_val=0, seed=s, **SMALL)["train"].source for s in (0, 1)]
    assert torch.equal(worlds[0].features, worlds[1].features)
    torch.manual_seed(0)  # what the run does before building the SAE
    init = torch.randn(64, 32)
    assert abs_cosines(init, worlds[0].features).max() < 0.9
    with pytest.raises(ConfigError, match="world_seed"):
        synth_bench_splits(n_train=10, n_val=0, seed=2029, world_seed=2026, **SMALL)


def _bench() -> types.ModuleType:
    # benchmarks/synth_bench.py, as the script its users run
    spec = importlib.util.spec_from_file_location("synth_bench", ROOT / "benchmarks" / "synth_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_side_by_side_trains_runner_s_relu_with_its_option_s_own_l1_coefficient(tmp_path: Path) -> None:
    # runner's ReLU row is what `model=sae_relu` gives a user of the preset, unless a coefficient is asked for
    bench = _bench()
    plain = bench.runner_command("relu", 6, 3e-3, bench.RUNNER_COEFF, tmp_path)
    assert not any(arg.startswith("model.l1_coeff=") for arg in plain)
    asked = bench.runner_command("relu", 6, 3e-3, {**bench.RUNNER_COEFF, "relu": 0.3}, tmp_path)
    assert "model.l1_coeff=0.3" in asked


def test_runner_overrides_go_to_their_architecture_s_command_after_the_script_s_own(tmp_path: Path) -> None:
    bench = _bench()
    asked = bench.overrides(["jumprelu=model.bandwidth=0.05", "relu=model.l1_coeff=0.2", "jumprelu=model.x=a=b"])
    assert asked == {"jumprelu": ["model.bandwidth=0.05", "model.x=a=b"], "relu": ["model.l1_coeff=0.2"]}
    plain = bench.runner_command("jumprelu", 6, 3e-3, bench.RUNNER_COEFF, tmp_path)
    command = bench.runner_command("jumprelu", 6, 3e-3, bench.RUNNER_COEFF, tmp_path, asked["jumprelu"])
    assert command == [*plain, "model.bandwidth=0.05", "model.x=a=b"]  # last: Hydra keeps the last value of a key
    for bad in ("jumprelu", "jumprelu=model.bandwidth", "gated=model.bandwidth=0.05"):
        with pytest.raises(SystemExit, match="ARCH=KEY=VALUE"):
            bench.overrides([bad])


def test_saelens_thresholds_a_hair_below_zero_are_scored_at_zero_and_counted(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bench = _bench()
    (tmp_path / "cfg.json").write_text("{}")
    weights = {"W_enc": torch.ones(2, 3), "threshold": torch.tensor([0.5, -1.3e-6, 0.0])}
    save_file(weights, str(tmp_path / "sae_weights.safetensors"))
    folder, raised = bench.readable(tmp_path)
    assert raised == 1 and folder != tmp_path and (folder / "cfg.json").read_text() == "{}"
    scored = load_file(str(folder / "sae_weights.safetensors"))
    assert torch.equal(scored["threshold"], torch.tensor([0.5, 0.0, 0.0]))
    assert torch.equal(scored["W_enc"], weights["W_enc"])
    save_file({"threshold": torch.tensor([0.5, 0.0])}, str(tmp_path / "sae_weights.safetensors"))
    assert bench.readable(tmp_path) == (tmp_path, 0)  # nothing to raise: SAELens's own folder, as written
