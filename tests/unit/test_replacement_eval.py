"""runner.sae_eval evals=[replacement] (experiments/sae/evals/replacement.py): transcoders that reproduce a GPT's ReLU
MLPs exactly score 1 and 1 on every prompt; transcoders that decode nothing leave every MLP output to the error nodes,
and score the tokens' share of each logit's direct inputs, computed here by superposition through the frozen model
(not by gradients), with completeness (1 + that) / 2; the command on a CLT's run and on a transcoder per block writes
the scores of the source's held-out windows, and refuses an SAE, an incomplete set and a set given to the
single-coder evaluations in one paragraph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SAE_LM, exact_transcoders, finished_clt_run, finished_run, relu_mlp_gpt

from experiments.lm.model import GPT
from experiments.sae.circuits.attribute import attribute
from experiments.sae.circuits.coders import CoderSet
from experiments.sae.circuits.frozen import FrozenGPT
from experiments.sae.circuits.load import load_coders
from experiments.sae.circuits.prune import scores
from experiments.sae.evals.cli import main
from experiments.sae.evals.replacement import Circuits, graph_scores
from experiments.sae.evals.run import source_of
from runner.load import TRUSTED_TARGETS, load_model

D, HIDDEN = 16, 24


def _gpt(layers: int) -> GPT:
    # a GPT whose MLPs are ReLU MLPs (helpers.ReluMlp) that ReLU transcoders reproduce exactly
    return relu_mlp_gpt(layers, D, HIDDEN)


def _circuits(gpt: GPT, decode: bool) -> Circuits:
    # transcoders whose features are the MLPs' hidden units (W_enc = up^T on inputs scaled by 2); decoding them
    # (W_dec = down^T) or nothing (W_dec = 0, b_dec = 0)
    coders = exact_transcoders(gpt)
    if not decode:
        with torch.no_grad():
            for coder in coders:
                coder.W_dec.zero_()
    meta = {"coder": [], "model": "test", "skip_positions": 0}
    return Circuits(gpt, CoderSet.of_transcoders(coders), meta)


PROMPTS = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))


def test_exact_transcoders_score_1_on_every_prompt() -> None:
    got = graph_scores(_circuits(_gpt(2), decode=True), PROMPTS)
    assert got["read"]["prompts"] == 4 and got["read"]["prompt_tokens"] == 12 and got["read"]["features_mean"] > 20
    for prompt in got["per_prompt"]:
        assert (prompt["replacement"], prompt["completeness"]) == pytest.approx((1.0, 1.0), abs=1e-12)
    for key in ("replacement_score", "completeness_score"):
        spread = got[key]
        assert (spread["mean"], spread["min"], spread["max"], spread["std"]) == pytest.approx((1, 1, 1, 0), abs=1e-12)


def _by_hand(gpt: GPT, prompt: torch.Tensor) -> float:
    # a 1-block GPT whose MLP is all error: each salient logit's direct inputs are the tokens (residual stream and
    # attention, patterns and norms frozen) and the MLP's output; the frozen model is linear in them, so one run per
    # token (that token's embedding alone) and one per error node (that position's MLP output alone) splits each
    # demeaned logit into them; the replacement score is the probability-weighted tokens' share of |inputs|
    frozen = FrozenGPT(gpt, prompt)
    t = len(prompt)
    emb = torch.zeros(2 * t, t, D, dtype=torch.float64)
    delta = torch.zeros(2 * t, t, D, dtype=torch.float64)
    for p in range(t):
        emb[p, p] = frozen.embeddings[p]
        delta[t + p, p] = frozen.mlp_outputs[0][p]
    with torch.no_grad():
        _, final = frozen.run(emb, lambda _m, _x: delta)
    probs = frozen.logits[-1].float().softmax(-1).double()  # the logit weights are float32's, as circuit-tracer's
    top, tokens = probs.sort(descending=True)
    keep = min(int((top.cumsum(0) < 0.95).sum()) + 1, 10)  # until 95% of the mass, at most 10 (runner.attribute's)
    u = frozen.unembed
    parts = final[:, -1] @ (u[tokens[:keep]] - u.mean(0)).t()  # [2T, K]: each input's share of each logit
    demeaned = frozen.logits[-1] - frozen.logits[-1].mean()
    assert torch.allclose(parts.sum(0), demeaned[tokens[:keep]], atol=1e-10)  # nothing left out: no bias anywhere
    share = parts[:t].abs().sum(0) / parts.abs().sum(0)
    w = top[:keep]
    return float((w * share).sum() / w.sum())


def test_coders_that_decode_nothing_score_the_tokens_share_of_the_logits_inputs() -> None:
    gpt = _gpt(1)
    got = graph_scores(_circuits(gpt, decode=False), PROMPTS)
    for prompt, scored in zip(PROMPTS, got["per_prompt"], strict=True):
        expected = _by_hand(gpt, prompt)
        assert 0.05 < expected < 0.99  # not 0: the tokens reach the logits around the MLP
        assert scored["replacement"] == pytest.approx(expected, rel=1e-9)
        assert scored["completeness"] == pytest.approx((1 + expected) / 2, rel=1e-9)
    # with more blocks the features still write nothing, so the influence stops at the tokens and error nodes alike
    for scored in graph_scores(_circuits(_gpt(2), decode=False), PROMPTS)["per_prompt"]:
        assert 0 < scored["replacement"] < 1
        assert scored["completeness"] == pytest.approx((1 + scored["replacement"]) / 2, rel=1e-9)


@pytest.fixture(scope="module")
def clt_run(lm_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # as tests/unit/test_attribution.py's: a CLT of 32 latents per block
    return finished_clt_run(tmp_path_factory.mktemp("clt"), lm_run)


@pytest.fixture(scope="module")
def transcoder_runs(lm_run: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    # one transcoder of 32 latents per block: the set of the same width as clt_run
    settings = [o for o in SAE_LM if not o.startswith(("source.", "model.n_latents"))]
    runs = []
    for layer in (0, 1):
        run = tmp_path_factory.mktemp(f"transcoder{layer}")
        finished_run(
            run, "+experiment=transcoder_lm", f"source.checkpoint={lm_run}", f"source.layer={layer}", *settings,
            "model.n_latents=32",
        )  # fmt: skip
        runs.append(run)
    return runs


def test_the_command_scores_a_clt_on_held_out_windows(clt_run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "ev"
    assert main([str(clt_run), "evals=[replacement]", "--limit", f"out={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    got = result["evals"]["replacement"]
    assert result["coder"]["class"] == "cross-layer transcoder" and result["coder"]["n_latents_per_layer"] == [32, 32]
    assert got["read"]["prompts"] == 4 and got["read"]["prompt_tokens"] == 32  # --limit: 4 prompts
    # the prompts are the source's first held-out windows, and the scores runner.attribute's graphs'
    _, cfg = load_model(clt_run)
    batch = next(iter(source_of(cfg, torch.device("cpu")).data.val_loader()))
    loaded = load_coders([clt_run], TRUSTED_TARGETS)
    expected = [scores(attribute(FrozenGPT(loaded.model, w[:32]), loaded.coders)) for w in batch["tokens"][:4]]
    flat = [score for p in got["per_prompt"] for score in (p["replacement"], p["completeness"])]
    assert flat == pytest.approx([score for pair in expected for score in pair], rel=1e-6)
    mean = got["replacement_score"]["mean"]
    assert mean == pytest.approx(sum(r for r, _ in expected) / 4, rel=1e-6) and 0 < mean < 1
    spread = got["completeness_score"]
    assert 0 < spread["min"] <= spread["mean"] <= spread["max"] <= 1 and spread["std"] >= 0
    page = (out / "index.html").read_text()
    assert "replacement: replacement_score" in page and f"{mean:.6g}" in page and "replacement score:" in page
    assert "replacement/replacement_score/mean" in capsys.readouterr().out


def test_a_transcoder_per_block_is_a_set_of_the_same_kind(transcoder_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "ev"
    assert main([*map(str, transcoder_runs), "prompts=2", f"out={out}"]) == 0  # several runs: replacement
    result = json.loads((out / "eval.json").read_text())
    assert set(result["evals"]) == {"replacement"} and result["coder"]["class"] == "transcoder per block"
    assert result["coder"]["runs"] == [str(r) for r in transcoder_runs] and result["coder"]["n_latents"] == 64
    assert result["evals"]["replacement"]["read"]["prompts"] == 2
    assert 0 < result["evals"]["replacement"]["replacement_score"]["mean"] <= 1


def test_what_has_no_replacement_model_is_refused_in_one_paragraph(
    clt_run: Path, transcoder_runs: list[Path], sae_lm_run: Path, capsys
) -> None:
    first, both = str(transcoder_runs[0]), [*map(str, transcoder_runs)]
    for args, said in [
        ([str(sae_lm_run), "evals=[replacement]"], "no transcoder"),
        ([first, "evals=[replacement]"], "replaces every one of the model's 2 blocks"),
        ([*both, "evals=[core,replacement]"], "2 runs name a coder set"),
        ([str(clt_run), "evals=[replacement]", "prompt_tokens=33"], "reads at most 32 tokens"),
        ([str(clt_run), "evals=[replacement]", "prompts=0"], "prompts=0: give a whole number"),
        ([str(clt_run)], "is evals=[replacement]'s"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (args, err)
