"""runner's core SAE evaluation (experiments/sae/evals/core.py) against the real SAELens's `run_evals`, run in its own
virtualenv on the same SAE folder, the same transformers model and the same token windows: every metric both compute
agrees to 1e-4. Skipped where that virtualenv is absent (benchmarks/peers/install.sh makes it).

The windows are runner's validation windows of a tiny GPT-2 (BOS first, EOS between files inside windows: special
tokens are masked out on both sides), given to SAELens as an in-memory pretokenised dataset. runner reads a window of
context + 1 tokens, runs the model on its first `context` and scores every one of those positions (activations, KL,
and the CE of predicting the next token); SAELens runs the model on its whole window of L tokens and scores all L
positions but only L - 1 CE terms (positions 0..L-2, it has no next token for the last). So SAELens runs twice:
- on the first `context` tokens of each window (the model's input, exactly runner's): every metric but the CE ones;
- on the whole context + 1 tokens: the CE ones (its L - 1 = context CE terms are runner's; the extra last position
  changes no logits before it, the model being causal).
`run_evals` reads its sparsity/variance batches after its reconstruction batches (resetting the dataset has no
effect on the sequences it has already made), so the dataset holds the windows twice: both phases see them all.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_text, peer_python, tiny_hf_model

from experiments.sae.evals.core import DENSE, core, per_token
from experiments.sae.formats import read_folder
from experiments.sae.sources.source import SourceModel

pytestmark = pytest.mark.slow

HOOK = "transformer.h.0"
CONTEXT, BATCH, WINDOWS = 16, 8, 32  # runner's source: 4 batches of 8 windows of 16 inputs
TOLERANCE = 1e-4

# Writes a SAELens SAE folder (random but sensible weights: EV ~0.4, decoder bias at the activations' mean), loads it
# back, and runs run_evals with everything on the windows (context, then context + 1 tokens): metrics.json
SAELENS = """
import json, sys, warnings, numpy as np, torch
warnings.filterwarnings("ignore")
from datasets import Dataset
from sae_lens import SAE, ActivationsStore
from sae_lens.evals import get_eval_everything_config, run_evals
from sae_lens.load_model import load_model
from sae_lens.registry import SAE_CLASS_REGISTRY
from sae_lens.training.activation_scaler import ActivationScaler
from sae_lens.util import get_special_token_ids

model_dir, sae_dir, arch, hook, folder = sys.argv[1:6]
batch = int(sys.argv[6])
rows = np.load(f"{folder}/windows.npy").astype(np.int64)  # [windows, context + 1]
mean = torch.from_numpy(np.load(f"{folder}/mean.npy"))
sae_cls, cfg_cls = SAE_CLASS_REGISTRY[arch]
cfg = cfg_cls(d_in=mean.shape[0], d_sae=64, **({"k": 8} if arch == "topk" else {}))
cfg.metadata.hook_name, cfg.metadata.model_class_name, cfg.metadata.model_name = hook, "AutoModelForCausalLM", model_dir
cfg.metadata.prepend_bos, cfg.metadata.context_size = True, rows.shape[1] - 1
torch.manual_seed(0)
sae = sae_cls(cfg)
with torch.no_grad():
    directions = torch.nn.functional.normalize(torch.randn(64, mean.shape[0]), dim=1)
    sae.W_dec.copy_(directions * (0.5 + 0.4 * torch.rand(64, 1)))
    sae.W_enc.copy_(directions.T + 0.1 * torch.randn_like(directions.T))
    sae.b_enc.copy_(-0.1 + 0.05 * torch.randn(64))
    sae.b_dec.copy_(mean)
sae.save_model(sae_dir)
sae = SAE.load_from_disk(sae_dir)
model = load_model("AutoModelForCausalLM", model_dir, device="cpu", hook_names=[hook])
data = Dataset.from_dict({"tokens": np.concatenate([rows, rows]).tolist()})
n_batches = len(rows) // batch
results = {"special": sorted(get_special_token_ids(model.tokenizer))}
for name, context in (("inputs", rows.shape[1] - 1), ("windows", rows.shape[1])):
    store = ActivationsStore.from_sae(
        model, sae, dataset=data, context_size=context, store_batch_size_prompts=batch, device="cpu"
    )
    config = get_eval_everything_config(
        batch_size_prompts=batch, n_eval_reconstruction_batches=n_batches, n_eval_sparsity_variance_batches=n_batches
    )
    metrics, features = run_evals(sae, store, model, ActivationScaler(), config, exclude_special_tokens=True)
    flat = {key: value for group in metrics.values() for key, value in group.items()}
    results[name] = {**flat, "feature_density": features["feature_density"]}
with open(f"{folder}/metrics.json", "w") as f:
    json.dump(results, f)
"""

# SAELens's name -> (runner's core group, key)
FROM_INPUTS = {  # from SAELens's run on the model's inputs (context tokens)
    "explained_variance": ("reconstruction", "explained_variance"),
    "mse": ("reconstruction", "mse"),
    "cossim": ("reconstruction", "cossim"),
    "l2_norm_in": ("shrinkage", "l2_norm_in"),
    "l2_norm_out": ("shrinkage", "l2_norm_out"),
    "l2_ratio": ("shrinkage", "l2_ratio"),
    "relative_reconstruction_bias": ("shrinkage", "relative_reconstruction_bias"),
    "l0": ("sparsity", "l0"),
    "l1": ("sparsity", "l1"),
    "kl_div_with_sae": ("downstream", "kl_spliced"),
}
FROM_WINDOWS = {  # from SAELens's run on the whole windows (context + 1 tokens: context CE terms)
    "ce_loss_without_sae": ("downstream", "ce_clean"),
    "ce_loss_with_sae": ("downstream", "ce_spliced"),
}
# Not compared: runner's mean ablation (ce/kl_mean_ablated, *_score_mean) and density histogram, SAELens has neither;
# SAELens's explained_variance_legacy and consistent_activation_heuristic, runner has neither. The zero ablation
# (kl_div_with_ablation, ce_loss_with_ablation and both scores) is defined otherwise: SAELens zeroes every position,
# the special tokens too, while it splices only the others; runner ablates the positions it splices
# (tests/unit/test_known_answers.py). Where the special tokens' zeroing costs loss, SAELens's scores are the higher.


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    return {"model": tiny_hf_model(root / "model", "gpt2"), "paths": hf_text(root / "text"), "root": root}


def _close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= TOLERANCE * max(1.0, abs(theirs))


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_core_agrees_with_saelens_run_evals(hf: dict[str, Any], tmp_path: Path, architecture: str) -> None:
    interpreter = peer_python("saelens")
    inputs = {"paths": hf["paths"], "context": CONTEXT, "batch_size": BATCH, "val_every": 2, "val_windows": WINDOWS}
    source = SourceModel(str(hf["model"]), HOOK, "cpu", inputs={**inputs, "cache_dir": str(hf["root"] / "tokens")})
    batches = list(source.data.val_loader())
    windows = torch.cat([batch["tokens"] for batch in batches])
    # whole batches, as SAELens reads them (its relative reconstruction bias is a mean over batches)
    assert windows.shape == (WINDOWS, CONTEXT + 1) and all(len(batch["tokens"]) == BATCH for batch in batches)
    positions = sum(int(source.mask(batch).sum()) for batch in batches)
    # special tokens inside the windows too (EOS between files), not only each window's first (BOS)
    assert positions < WINDOWS * (CONTEXT - 1)
    mean = torch.cat([source.activations(batch) for batch in batches]).mean(0)
    np.save(tmp_path / "windows.npy", windows.numpy())
    np.save(tmp_path / "mean.npy", mean.numpy())

    sae_folder = tmp_path / "sae"
    args = [str(hf["model"]), str(sae_folder), architecture, HOOK, str(tmp_path), str(BATCH)]
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [interpreter, "-c", SAELENS, *args], capture_output=True, text=True, timeout=300, env=offline, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "metrics.json").read_text())
    # the same positions are masked: SAELens leaves out BOS/EOS/PAD/SEP, runner every special id of the tokenizer
    assert theirs["special"] == sorted(source.pretrained.special.tolist())

    sae, facts = read_folder(sae_folder)
    assert (facts["format"], facts["architecture"], facts["hook"]) == ("saelens", architecture, HOOK)
    out = core(sae, source, positions, positions)  # every validation window, spliced too, and nothing else
    assert out["read"]["windows"] == WINDOWS and out["read"]["positions"] == positions
    assert out["downstream"]["positions"] == positions and not out["downstream"]["notes"]

    compared = {  # SAELens's name -> (ours, theirs)
        name: (out[group][key], theirs[run][name])
        for run, pairs in (("inputs", FROM_INPUTS), ("windows", FROM_WINDOWS))
        for name, (group, key) in pairs.items()
    }
    density, reference = np.array(out["latent_density"]), np.array(theirs["inputs"]["feature_density"])
    gaps = {name: abs(ours - ref) for name, (ours, ref) in compared.items()}
    gaps["feature_density"] = float(np.abs(density - reference).max())
    print(architecture, {name: f"{gap:.1e}" for name, gap in gaps.items()})  # pytest -s: the measured differences
    wrong = {name: pair for name, pair in compared.items() if not _close(*pair)}
    assert not wrong, f"runner's core differs from SAELens's run_evals (ours, theirs): {wrong}"
    np.testing.assert_allclose(density, reference, rtol=0, atol=TOLERANCE)
    # SAEBench core's latent counts, from SAELens's densities
    assert out["sparsity"]["dead_fraction"] == pytest.approx(float((reference == 0).mean()), abs=1e-12)
    for threshold in DENSE:
        assert out["sparsity"][f"dense_fraction_{threshold:g}"] == pytest.approx(float((reference > threshold).mean()))
    # a comparison that says something: latents fire, the SAE reconstructs, splicing and ablating cost loss
    reconstruction, downstream = out["reconstruction"], out["downstream"]
    assert 0 < out["sparsity"]["l0"] < 64 and 0.1 < reconstruction["explained_variance"] < 1
    assert downstream["ce_clean"] < downstream["ce_spliced"] < downstream["ce_zero_ablated"]
    assert 0 < downstream["kl_spliced"] < downstream["kl_zero_ablated"]
    # SAELens's zero ablation, every position zeroed (the special tokens' too), gives its figures here: the positions
    # are all that differs
    every = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            mask = source.row_mask(batch)
            clean = source.loss(batch)[1]
            with source._hook(HOOK, torch.zeros_like):
                ce, kl = per_token(source.loss(batch)[1], batch["tokens"], mask, clean[mask])
            every += torch.stack([ce.double().sum(), kl.double().sum()])
    ce_every, kl_every = (every / positions).tolist()
    assert _close(ce_every, theirs["windows"]["ce_loss_with_ablation"]), ce_every
    assert _close(kl_every, theirs["inputs"]["kl_div_with_ablation"]), kl_every
    score = (ce_every - downstream["ce_spliced"]) / (ce_every - downstream["ce_clean"])
    assert _close(score, theirs["windows"]["ce_loss_score"])
    assert ce_every != pytest.approx(downstream["ce_zero_ablated"])  # the special tokens' stream is worth something
