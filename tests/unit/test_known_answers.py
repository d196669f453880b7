"""Scores whose answer is known: SAEs in SAELens's layout whose splice is exact, zero or the ablation's mean score 1, 0
against zero ablation and 0 against mean ablation, in runner.tools.evaluate's validation (SpliceEval) and
runner.sae_eval's core alike, on a runner GPT (its first position left out of splicing) and on a transformers model (its
special tokens left out). A baseline that destroyed more positions than the coder is asked to rebuild would score the
zero SAE above 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hf_text, tiny_hf_model
from safetensors.torch import save_file

from experiments.sae.evals.cli import main as sae_eval_main
from experiments.sae.evals.core import core
from experiments.sae.sources.source import SourceModel
from runner.load import load_model
from runner.tools.evaluate import evaluate_run

D, HOOK = 32, "blocks.0.hook_resid_post"  # the tiny GPTs' width; their first block's output, which the second reads


def saelens_folder(folder: Path, W_enc: torch.Tensor, W_dec: torch.Tensor, b_dec: torch.Tensor) -> Path:
    """A standard (ReLU) SAE in SAELens's layout, with zero encoder bias."""
    folder.mkdir(parents=True)
    n = W_enc.shape[1]
    meta = {"hook_name": HOOK, "sae_lens_version": "6.0"}
    cfg = {"d_in": D, "d_sae": n, "dtype": "float32", "architecture": "standard", "metadata": meta}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    tensors = {"W_enc": W_enc, "b_enc": torch.zeros(n), "W_dec": W_dec, "b_dec": b_dec}
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(folder / "sae_weights.safetensors"))
    return folder


def known_saes(root: Path, mean: torch.Tensor) -> dict[str, Path]:
    """exact: ReLU(x) - ReLU(-x) = x through [I, -I]; zero: decodes to 0; mean: decodes to `mean` whatever it reads."""
    eye, gen = torch.eye(D), torch.Generator().manual_seed(0)
    W_enc = torch.randn(D, 2 * D, generator=gen)  # latents fire: what is decoded does not depend on them
    zero = torch.zeros(2 * D, D)
    return {
        "exact": saelens_folder(root / "exact", torch.cat([eye, -eye], 1), torch.cat([eye, -eye], 0), torch.zeros(D)),
        "zero": saelens_folder(root / "zero", W_enc, zero, torch.zeros(D)),
        "mean": saelens_folder(root / "mean", W_enc, zero, mean),
    }


def assert_known_answers(got: dict[str, dict[str, float]]) -> None:
    """`got[sae]`: its scores under the names of both tools (ce_loss_score: the fraction recovered against zero
    ablation, *_mean: against mean ablation)."""
    exact, zero, mean = got["exact"], got["zero"], got["mean"]
    for name in ("ce_loss_score", "ce_loss_score_mean", "kl_div_score", "kl_div_score_mean"):
        assert exact[name] == pytest.approx(1.0, abs=1e-6), name
    assert exact["kl_spliced"] == pytest.approx(0.0, abs=1e-9) and exact["ce_spliced"] == exact["ce_clean"]
    assert zero["ce_loss_score"] == pytest.approx(0.0, abs=1e-6)
    assert zero["kl_div_score"] == pytest.approx(0.0, abs=1e-6)
    assert zero["ce_spliced"] == pytest.approx(zero["ce_zero_ablated"], rel=1e-7)
    assert mean["ce_loss_score_mean"] == pytest.approx(0.0, abs=1e-4), mean
    assert mean["kl_div_score_mean"] == pytest.approx(0.0, abs=1e-4), mean
    # the ablations cost the model something, so that the scores above divide by more than noise
    assert zero["ce_zero_ablated"] > zero["ce_clean"] + 0.05 and mean["ce_mean_ablated"] > mean["ce_clean"] + 0.01


def spliced(folder: Path, attach: dict[str, Any]) -> dict[str, float]:
    """runner.tools.evaluate's validation metrics of an SAE folder (SpliceEval's) under sae_eval's names."""
    m = evaluate_run(folder, attach=attach)["metrics"]
    kl = {name: m[f"val/kl_{name}"] for name in ("spliced", "zero_ablated", "mean_ablated")}
    return {
        "ce_clean": m["val/ce_clean"],
        "ce_spliced": m["val/ce_spliced"],
        "ce_zero_ablated": m["val/ce_zero_ablated"],
        "ce_mean_ablated": m["val/ce_mean_ablated"],
        "kl_spliced": kl["spliced"],
        "ce_loss_score": m["val/loss_recovered"],
        "ce_loss_score_mean": m["val/loss_recovered_mean"],
        "kl_div_score": (kl["zero_ablated"] - kl["spliced"]) / kl["zero_ablated"],
        "kl_div_score_mean": (kl["mean_ablated"] - kl["spliced"]) / kl["mean_ablated"],
    }


def validation_rows(source: SourceModel) -> tuple[torch.Tensor, int]:
    """The mean of the hooked module's rows over the validation windows, and how many positions give rows there."""
    rows = torch.cat([source.activations(batch) for batch in source.data.val_loader()]).double()
    return rows.mean(0).float(), len(rows)


def test_a_runner_gpt_scores_exact_zero_and_mean_saes_at_their_known_answers(lm_run: Path, tmp_path: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    # the mean over the validation windows' positions from the second on, read off the GPT by a hook of its own
    outputs = []
    handle = source.model.blocks[0].register_forward_hook(lambda m, i, out: outputs.append(out[:, 1:].detach()))
    with torch.no_grad():
        for batch in source.data.val_loader():
            source.model(batch["tokens"][:, :-1])
    handle.remove()
    stream = torch.cat(outputs).flatten(0, 1).double()
    folders = known_saes(tmp_path, stream.mean(0).float())
    attach = {"source": str(lm_run)}
    # sae_eval reads exactly the validation windows (val first, then training windows beyond `tokens`)
    tokens = len(stream)
    from_eval, from_validation = {}, {}
    for name, folder in folders.items():
        out = tmp_path / f"eval-{name}"
        argv = [str(folder), f"source={lm_run}", "evals=[core]", f"tokens={tokens}", f"splice_tokens={tokens}"]
        assert sae_eval_main([*argv, f"out={out}"]) == 0
        downstream = json.loads((out / "eval.json").read_text())["evals"]["core"]["downstream"]
        assert downstream["positions"] == tokens
        from_eval[name] = downstream
        from_validation[name] = spliced(folder, attach)
    assert_known_answers(from_eval)
    assert_known_answers(from_validation)
    # both tools score the same positions the same way: their losses agree (sae_eval's are over the kept positions
    # only, validation's over every position, whose first is the same in all three models: scaled by (T - 1) / T)
    share = tokens / sum(b["tokens"][:, :-1].numel() for b in source.data.val_loader())
    for name in folders:
        ours, theirs = from_eval[name], from_validation[name]
        assert theirs["ce_loss_score"] == pytest.approx(ours["ce_loss_score"], abs=1e-5)
        assert theirs["kl_spliced"] == pytest.approx(ours["kl_spliced"] * share, rel=1e-4, abs=1e-9)


def test_a_transformers_model_scores_them_at_their_known_answers_with_special_tokens_kept(tmp_path: Path) -> None:
    model = tiny_hf_model(tmp_path / "model", "gpt2")
    inputs = {"paths": hf_text(tmp_path / "text"), "val_every": 2, "context": 16}
    source = SourceModel(str(model), "transformer.h.0", inputs=inputs)
    batches = list(source.data.val_loader())
    special = sum(int((~source.mask(batch)).sum()) for batch in batches)
    assert special > len(batches)  # BOS and the EOS between files: positions the splice leaves as they are
    mean, positions = validation_rows(source)
    folders = known_saes(tmp_path, mean)
    got = {}
    for name, folder in folders.items():
        sae, _ = load_model(folder, attach={"source": str(model), "inputs": inputs})
        got[name] = core(sae, source, positions, positions)["downstream"]
        assert got[name]["positions"] == positions
    assert_known_answers(got)
    assert_known_answers({name: spliced(f, {"source": str(model), "inputs": inputs}) for name, f in folders.items()})
