"""runner's SynthSAEBench against SAELens's own (its venv, .venv-saelens, in a subprocess): with the same seed the
generator gives the same feature dictionary, probabilities, magnitudes and samples bit for bit (torch.equal), children
scaled by their parents included, and the metrics equal sae_lens/synthetic/evals.py's on the same weights and
samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.sae.evals.ground_truth import Scores
from experiments.sae.sources.synth_bench import SynthBench

SAELENS = Path(__file__).resolve().parents[2] / ".venv-saelens" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SAELENS.exists(), reason="SAELens's venv (.venv-saelens) is not installed"),
]

GENERATE = """
import json, sys, torch
from sae_lens.synthetic import (FoldedNormalMagnitudeConfig, HierarchyConfig, LinearMagnitudeConfig,
    ZipfianFiringProbabilityConfig)
from sae_lens.synthetic.synthetic_model import (LowRankCorrelationConfig, OrthogonalizationConfig, SyntheticModel,
    SyntheticModelConfig)
c = json.loads(sys.argv[1])
branching = c["branching"] if isinstance(c["branching"], int) else tuple(c["branching"])
cfg = SyntheticModelConfig(
    num_features=c["num_features"], hidden_dim=c["d"],
    firing_probability=ZipfianFiringProbabilityConfig(exponent=c["zipf_exponent"], max_prob=0.4, min_prob=5e-4),
    hierarchy=HierarchyConfig(total_root_nodes=c["roots"], branching_factor=branching, max_depth=c["depth"],
        mutually_exclusive_portion=c["mutually_exclusive"], compensate_probabilities=c["compensate"],
        scale_children_by_parent=c.get("scale_children_by_parent", False)),
    orthogonalization=OrthogonalizationConfig(num_steps=c["ortho_steps"], lr=c["ortho_lr"]),
    correlation=LowRankCorrelationConfig(rank=c["rank"], correlation_scale=c["correlation_scale"]),
    std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=c["std_magnitude"][0], std=c["std_magnitude"][1]),
    mean_firing_magnitudes=LinearMagnitudeConfig(start=c["mean_magnitude"][0], end=c["mean_magnitude"][1]),
    bias=c["bias"], seed=c["seed"])
model = SyntheticModel(cfg)
torch.manual_seed(c["sample_seed"])
x, codes = model.sample_with_features(c["n"])
g = model.activation_generator
torch.save({"features": model.feature_dict.feature_vectors.data, "bias": model.feature_dict.bias.data,
    "probs": g.firing_probabilities, "means": g.mean_firing_magnitudes, "stds": g.std_firing_magnitudes,
    "x": x, "codes": codes}, sys.argv[2])
"""

METRICS = """
import json, sys, torch
from sae_lens.evals import ExplainedVarianceCalculator
from sae_lens.synthetic.evals import (ShrinkageCalculator, DeadLatentsCalculator, L0Calculator,
    compute_classification_metrics, feature_uniqueness, mean_correlation_coefficient)
t = torch.load(sys.argv[1])
ev, shrink, dead, l0 = ExplainedVarianceCalculator(), ShrinkageCalculator(), DeadLatentsCalculator(64), L0Calculator()
ev.add_batch(t["recon"], t["x"]); shrink.add_batch(t["recon"], t["x"]); dead.add_batch(t["latents"])
l0.add_batch(t["latents"])
c = compute_classification_metrics(t["latents"], t["codes"], t["decoder"], t["truth"])
print(json.dumps({"mcc": mean_correlation_coefficient(t["decoder"], t["truth"]),
    "uniqueness": feature_uniqueness(t["decoder"], t["truth"]), "precision": c.precision, "recall": c.recall,
    "f1": c.f1_score, "accuracy": c.accuracy, "explained_variance": ev.compute(), "shrinkage": shrink.compute(),
    "dead_latents": dead.compute(), "l0": l0.compute()}))
"""

BENCH = {  # SynthSAEBench-16k's settings on a smaller world (the full one's orthogonalization takes an hour here)
    "num_features": 1024,
    "d": 64,
    "zipf_exponent": 0.5,
    "roots": 8,
    "branching": 4,
    "depth": 3,
    "mutually_exclusive": 1.0,
    "compensate": True,
    "rank": 25,
    "correlation_scale": 0.1,
    "ortho_steps": 5,
    "ortho_lr": 3e-4,
    "mean_magnitude": [5.0, 4.0],
    "std_magnitude": [0.5, 0.5],
    "bias": 1.0,
    "seed": 7,
}
# random branching and a drawn half of the parents exclusive: the hierarchy's own random draws
RANDOM_TREES = {**BENCH, "branching": [2, 5], "mutually_exclusive": 0.5, "compensate": False, "seed": 11}
# the published world's own settings (create_synth_bench_16k_model.py: children scaled by their parents, a bias of
# norm 0.5, seed 42) on the smaller world; and the scaling under random trees with half the parents exclusive
PUBLISHED = {**BENCH, "scale_children_by_parent": True, "bias": 0.5, "seed": 42}
SCALED_TREES = {**RANDOM_TREES, "scale_children_by_parent": True}


def _saelens(script: str, *args: str) -> str:
    done = subprocess.run([str(SAELENS), "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    "world",
    [BENCH, RANDOM_TREES, PUBLISHED, SCALED_TREES],
    ids=["bench", "random_trees", "published", "scaled_trees"],
)
def test_the_generator_equals_saelens_bit_for_bit(world: dict, tmp_path: Path) -> None:
    _saelens(GENERATE, json.dumps({**world, "sample_seed": 123, "n": 1024}), str(tmp_path / "saelens.pt"))
    theirs = torch.load(tmp_path / "saelens.pt")
    ours = SynthBench(**{k: v for k, v in world.items()})
    assert ours.hierarchy.scale_by_parent == world.get("scale_children_by_parent", False)
    x, codes = ours.sample_with_codes(1024, torch.Generator().manual_seed(123))
    mine = {"features": ours.features, "bias": ours.bias, "probs": ours.probs, "means": ours.means}
    mine.update({"stds": ours.stds, "x": x, "codes": codes})
    for key, value in mine.items():
        assert torch.equal(value, theirs[key]), key
    assert (codes > 0).sum() > 1000  # not an empty world: thousands of firings to agree on


def test_the_metrics_equal_saelens_evals_on_the_same_weights_and_samples(tmp_path: Path) -> None:
    world = SynthBench(num_features=128, d=32, roots=4, rank=4, ortho_steps=0, seed=3)
    x, codes = world.sample_with_codes(2000, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    # a half-learned SAE: 40 latents near true directions (with noise), 24 random; codes that partly track them
    decoder = torch.cat(
        [world.features[:40] + 0.3 * torch.randn(40, 32, generator=g), torch.randn(24, 32, generator=g)]
    )
    latents = torch.relu(x @ decoder.T - 2.0)
    latents[:, 60:] = 0  # four dead latents
    recon = latents @ decoder * 0.1 + world.bias
    tensors = {"decoder": decoder, "truth": world.features, "x": x, "latents": latents, "recon": recon}
    torch.save({**tensors, "codes": codes}, tmp_path / "inputs.pt")
    theirs = json.loads(_saelens(METRICS, str(tmp_path / "inputs.pt")))
    scores = Scores(decoder, world.features)
    for start in range(0, 2000, 500):  # in batches: the sums stream
        rows = slice(start, start + 500)
        scores.add(x[rows], latents[rows], recon[rows], codes[rows])
    ours = scores.result()
    assert 0.05 < theirs["f1"] < 0.99 and 0 < theirs["mcc"] < 0.99 and theirs["dead_latents"] == 4  # no degenerate case
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
