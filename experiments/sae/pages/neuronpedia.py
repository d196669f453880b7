"""The feature pages' data in the shape Neuronpedia's uploads take (`python -m runner.features RUN neuronpedia=true`):
`neuronpedia/batch-N.json`, each {model_id, layer, sae_set, features: [...]} of a chunk of the pages' latents (256;
model_id and sae_set are publishing names, never a local path: runner.tools.published), each feature as
SAEDashboard's NeuronpediaDashboardFeature writes it: its logit lens (pos_str / pos_values, neg_str / neg_values),
firing fraction, activation histogram, nearest latents by decoder cosine, its largest decoder dimensions, and its
contexts (`activations`: the strongest first with bin_min -1, then each fifth with its range and share 0.2).

What runner's pass does not record is left empty or said: a context's `values` hold the latent's activation at the
token where it fired and 0 elsewhere (the pass keeps one activation per context, not the whole window's), and there
is no logit histogram or pearson correlation. Nothing is uploaded: Neuronpedia's upload is the user's call.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.sae.pages.stats import QUANTILES, bin_edges
from runner import ConfigError
from runner.rundir import write_atomic
from runner.rundir.outputs import make_dir


def write_batch(
    path: Path, sae: nn.Module, latents: dict[int, dict[str, Any]], r: dict[str, torch.Tensor], inputs: Any,
    head: dict[str, Any],
) -> Path:  # fmt: skip
    """Write one batch file `path` of the pages' `latents` (write.py `_latent`, by index), from the statistics `r`,
    the `inputs` (a text source's: its vocab names the tokens) and the index's `head` (its hook, and the model and
    SAE set's publishing names: runner.tools.published)."""
    if not inputs.texts:
        raise ConfigError("neuronpedia=true: Neuronpedia's features are shown on text; this run's rows have none")
    layer = re.search(r"(?:^|\.)(\d+)(?:\.|$)", str(head.get("hook") or ""))
    # Neuronpedia's URLs are MODEL_ID/LAYER-SAE_SET/INDEX: a hub id's name alone (EleutherAI/pythia-70m: pythia-70m)
    model_id = str(head.get("model") or "").rpartition("/")[2]
    meta = {"model_id": model_id, "layer": int(layer.group(1)) if layer else 0, "sae_set": head.get("sae_set") or ""}
    extra = {"n_prompts_total": sum(inputs.splits.values()), "n_tokens_in_prompt": inputs.window, "dataset": ""}
    rows = sae.W_dec.detach()[list(latents)].float().cpu()  # this batch's decoder rows, not the whole decoder again
    pairs = zip(latents.items(), rows, strict=True)
    features = [{**_feature(i, latent, r, inputs, row), **extra} for (i, latent), row in pairs]
    make_dir(path.parent)
    write_atomic(path, json.dumps({**meta, "features": features}).encode())
    return path


def _feature(i: int, latent: dict[str, Any], r: dict[str, torch.Tensor], inputs: Any, row: torch.Tensor) -> dict:
    # one latent as NeuronpediaDashboardFeature.to_dict() has it
    words = (lambda ids: [inputs.vocab[t] for t in ids]) if inputs.vocab else (lambda ids: [f"#{t}" for t in ids])
    hist, edges = r["hist"][i], bin_edges()
    filled = hist.nonzero().flatten()
    span = range(int(filled[0]), int(filled[-1]) + 1) if len(filled) else range(0)
    middle = [float((edges[b] * edges[b + 1]).sqrt()) if 0 < b < len(edges) - 2 else float(edges[b + 1]) for b in span]
    largest = row.abs().topk(min(3, len(row)))
    activations = [_context(c, -1.0, float(r["max"][i]), -1.0, words) for c in latent["contexts"]]
    for interval in latent["intervals"]:
        low, high = interval["low"], interval["high"]
        activations += [_context(c, low, high, 1 / QUANTILES, words) for c in interval["items"]]
    lens = {side: latent.get(side, []) for side in ("promoted", "suppressed")}
    return {
        "feature_index": i,
        "neuron_alignment_indices": largest.indices.tolist(),
        "neuron_alignment_values": [round(float(row[j]), 3) for j in largest.indices],
        "neuron_alignment_l1": [round(float(row[j].abs() / row.abs().sum()), 3) for j in largest.indices],
        "correlated_neurons_indices": [],
        "correlated_neurons_l1": [],
        "correlated_neurons_pearson": [],
        "correlated_features_indices": latent["near"],
        "correlated_features_l1": latent["near_cos"],  # SAEDashboard puts the decoder cosine here too
        "correlated_features_pearson": [],
        "neg_str": words([t for t, _ in lens["suppressed"]]),
        "neg_values": [v for _, v in lens["suppressed"]],
        "pos_str": words([t for t, _ in lens["promoted"]]),
        "pos_values": [v for _, v in lens["promoted"]],
        "frac_nonzero": float(r["density"][i]),
        "freq_hist_data_bar_values": [round(v, 4) for v in middle],
        "freq_hist_data_bar_heights": [int(hist[b]) for b in span],
        "logits_hist_data_bar_heights": [],
        "logits_hist_data_bar_values": [],
        "decoder_weights_dist": [],
        "activations": activations,
    }


def _context(item: dict[str, Any], low: float, high: float, share: float, words: Any) -> dict[str, Any]:
    # a context as NeuronpediaDashboardActivation.to_dict() has it: the latent's value at its firing token alone
    values = [0.0] * len(item["ids"])
    values[item["at"]] = item["value"]
    return {"bin_min": low, "bin_max": high, "bin_contains": share, "tokens": words(item["ids"]), "values": values}
