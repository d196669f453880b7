"""python -m runner.sae_eval (experiments/sae/evals/): the core metrics equal a brute-force computation over the same
positions (the losses from the GPT's own forward with hooks written here), the probes fit as scikit-learn fits them,
the absorption formula's cases, Python's token labels, the files written, and the refusals (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from experiments.sae.evals.absorption import _absorbed
from experiments.sae.evals.cli import main
from experiments.sae.evals.core import core, windows
from experiments.sae.evals.probes import fit_logistic
from experiments.sae.evals.probing import char_categories
from experiments.sae.evals.run import source_of
from experiments.sae.metrics import loss_recovered
from runner.load import load_trained


@torch.no_grad()
def test_core_metrics_equal_brute_force_over_the_same_positions(sae_lm_run: Path) -> None:
    sae, cfg = load_trained(sae_lm_run)
    source = source_of(cfg, torch.device("cpu"))
    got = core(sae, source, tokens=3000, splice_tokens=3000)
    batches = list(windows(source, 3000))
    x = torch.cat([source.activations(batch) for batch, _ in batches]).double()
    recon, codes = sae(x.float()).double(), sae.encode(x.float()).double()
    sse = (x - recon).pow(2).sum(1)
    expected = {
        "explained_variance": 1 - sse.mean() / (x.pow(2).sum(1).mean() - x.mean(0).pow(2).sum()),
        "mse": sse.mean(),
        "cossim": F.cosine_similarity(x, recon, dim=1).mean(),
        "l2_ratio": (recon.norm(dim=1) / x.norm(dim=1)).mean(),
        "l0": (codes != 0).sum(1).double().mean(),
        "l1": codes.abs().sum(1).mean(),
    }
    flat = {**got["reconstruction"], **got["shrinkage"], **got["sparsity"]}
    for key, value in expected.items():
        assert flat[key] == pytest.approx(value.item(), rel=1e-6), key
    assert got["latent_density"] == pytest.approx((codes != 0).double().mean(0).tolist())
    assert got["sparsity"]["dead_fraction"] == pytest.approx(((codes != 0).sum(0) == 0).double().mean().item())
    fired = (codes != 0).sum(0) > 0  # faint: a firing latent's mean code when firing x its row's norm, < 0.1 x median
    write = codes.abs().sum(0)[fired] / (codes != 0).sum(0)[fired] * sae.W_dec.norm(dim=1).double()[fired]
    faint = (write < 0.1 * write.median()).sum().item() / sae.n_latents
    assert got["sparsity"]["faint_fraction"] == pytest.approx(faint)
    assert got["read"]["positions"] == len(x) and got["downstream"]["positions"] == len(x)
    # the losses from the GPT itself: the first position (skip_positions=1) is neither scored nor spliced nor ablated
    gpt, skip, losses = source.model, source.skip, {"clean": [], "zero": []}
    zero_kept = lambda m, i, out: torch.cat([out[:, :skip], torch.zeros_like(out[:, skip:])], dim=1)  # noqa: E731
    for batch, _ in batches:
        tokens = batch["tokens"]
        for name in losses:
            hook = gpt.blocks[1].register_forward_hook(zero_kept) if name == "zero" else None
            logits = gpt(tokens[:, :-1])
            if hook is not None:
                hook.remove()
            losses[name].append(
                F.cross_entropy(logits[:, skip:].flatten(0, 1), tokens[:, 1 + skip :].flatten(), reduction="none")
            )
    clean, zero = (torch.cat(v).double().mean().item() for v in losses.values())
    assert got["downstream"]["ce_clean"] == pytest.approx(clean, rel=1e-6)
    assert got["downstream"]["ce_zero_ablated"] == pytest.approx(zero, rel=1e-6)
    spliced = got["downstream"]["ce_spliced"]
    assert got["downstream"]["ce_loss_score"] == pytest.approx((zero - spliced) / (zero - clean), rel=1e-6)
    assert (
        got["downstream"]["kl_spliced"] > 0 and got["downstream"]["kl_zero_ablated"] > got["downstream"]["kl_spliced"]
    )


def test_a_score_whose_ablation_costs_nothing_is_undefined_and_says_why() -> None:
    score, note = loss_recovered(ablated=6.908, spliced=6.95, clean=6.906)
    assert np.isnan(score) and "too little to divide by" in note
    assert loss_recovered(ablated=8.0, spliced=5.0, clean=4.0) == (0.75, None)


def test_the_cli_writes_json_and_a_page_and_refuses_by_name(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "ev"
    assert main([str(sae_lm_run), "evals=[core,probing]", "--limit", f"out={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert set(result["evals"]) == {"core", "probing"}
    assert result["coder"]["module"] == "blocks.1" and result["coder"]["n_latents"] == 64
    probing = result["evals"]["probing"]
    assert set(probing["tasks"]) >= {"token_string", "token_comment", "token_keyword"}
    assert all(0 <= t["sae_top_1_test_accuracy"] <= 1 for t in probing["tasks"].values())
    page = (out / "index.html").read_text()
    assert "<svg" in page and "explained_variance" in page and "token_string" in page
    assert "core/reconstruction/explained_variance" in capsys.readouterr().out
    for args, message in [
        (["evals=[core,typo]"], "evals=['core', 'typo']: give some of core, probing, absorption"),
        (["tokens=0"], "tokens=0: give a whole number >= 1"),
        (["hook=x"], "hook=: for an SAE folder of SAELens or sparsify"),
    ]:
        assert main([str(sae_lm_run), *args]) == 2
        assert message in capsys.readouterr().err, args
    assert main([str(lm_run)]) == 2
    assert "is no single SAE or transcoder to evaluate" in capsys.readouterr().err


def test_probes_fit_as_scikit_learn_fits_them() -> None:
    from sklearn.linear_model import LogisticRegression

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 5, generator=gen, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(300, generator=gen, dtype=torch.float64) > 0.8).long()
    for balanced in (False, True):
        w, b = fit_logistic(x, y, balanced=balanced)
        theirs = LogisticRegression(C=1.0, max_iter=1000, tol=1e-10, class_weight="balanced" if balanced else None)
        theirs.fit(x.numpy(), y.numpy())
        np.testing.assert_allclose(w.numpy(), theirs.coef_[0], atol=1e-4)
        assert b.item() == pytest.approx(theirs.intercept_[0], abs=1e-4)


def test_python_source_is_labelled_by_tokenize() -> None:
    text = 'if x:  # note\n    y = "s" + 12\n'
    cats = char_categories(text)
    label = lambda s: int(cats[text.index(s)])  # noqa: E731
    assert (label("if"), label("# note"), label('"s"'), label("12"), label("y")) == (4, 2, 1, 3, 0)
    assert char_categories("x = (\n") is None  # does not tokenize: the file is left out


@pytest.mark.parametrize(
    ("a", "s", "cos", "codes", "main", "expected"),
    [
        # the main latent covers the probe's projection: nothing absorbed
        (1.0, [1.2, 0.5, 0.0], [0.9, 0.5, 0.0], [1.2, 0.5, 0.0], [0], (0.0, False)),
        # the main latent silent, another aligned one carries it all: fully absorbed
        (1.0, [0.0, 0.9, 0.0], [0.9, 0.5, 0.0], [0.0, 1.8, 0.0], [0], (1.0, True)),
        # partly: main 0.3, absorbing 0.5 (of a - main = 0.7): 0.5 / 0.8
        (1.0, [0.3, 0.5, 0.0], [0.9, 0.5, 0.0], [0.3, 1.0, 0.0], [0], (0.625, False)),
        # the other latents cover less than 0.4 of a: not counted as absorption
        (1.0, [0.2, 0.3, 0.0], [0.9, 0.5, 0.0], [0.2, 0.6, 0.0], [0], (0.0, False)),
        # an absorbing latent barely aligned with the probe (cos < 0.1) does not count
        (1.0, [0.0, 0.9, 0.0], [0.9, 0.05, 0.0], [0.0, 18.0, 0.0], [0], (0.0, True)),
    ],
)
def test_absorption_follows_saebench_cases(a, s, cos, codes, main, expected) -> None:
    fraction, full = _absorbed(a, torch.tensor(s), torch.tensor(cos), torch.tensor(codes), main)
    assert (pytest.approx(fraction), full) == expected


def test_an_imported_sae_on_a_transformers_model_gets_every_evaluation(tmp_path: Path, capsys) -> None:
    from helpers import hf_text, tiny_hf_model

    from experiments.sae.coders.activations import TopKSAE
    from experiments.sae.formats import export

    model = tiny_hf_model(tmp_path / "model", "gpt2")
    sae = TopKSAE(d_in=32, n_latents=96, k=6)
    sae.initialized.fill_(True)
    export(sae, "saelens", tmp_path / "sae", hook="blocks.1", model="tiny")  # -> blocks.1.hook_resid_post
    out = tmp_path / "ev"
    inputs = f"inputs={{paths: [{','.join(hf_text(tmp_path / 'text'))}], val_every: 2, context: 16}}"
    assert main([str(tmp_path / "sae"), f"source={model}", inputs, "--limit", f"out={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["coder"]["module"] == "transformer.h.1" and result["coder"]["source"] == str(model)
    assert result["evals"]["core"]["read"]["windows"] * 16 >= result["evals"]["core"]["read"]["positions"]
    core_ = result["evals"]["core"]
    assert core_["downstream"]["positions"] > 0 and 0 < core_["reconstruction"]["cossim"] <= 1
    absorption = result["evals"]["absorption"]
    assert "skipped" not in absorption and absorption["read"]["words"] > 20  # the BPE vocabulary's letter tokens
    assert absorption["summary"]["letters"] == len(absorption["tasks"])
    assert set(result["evals"]["probing"]["tasks"]) >= {"token_string", "token_keyword"}


def test_probing_with_no_class_to_tell_apart_is_one_error(
    sae_lm_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # one held-out file of plain names: no string, comment, number or keyword, and a single file for the window task
    plain = tmp_path / "plain.py"
    plain.write_text("alpha\nbeta\ngamma\n" * 400)
    monkeypatch.setattr("experiments.sae.evals.probing.stdlib_sources", lambda: [plain] * 20)
    assert main([str(sae_lm_run), "evals=[probing]", "--limit", f"out={tmp_path / 'ev'}"]) == 2
    assert "sparse probing had too few examples of every class" in capsys.readouterr().err


def test_the_core_pass_says_how_many_batches_it_reads(sae_lm_run: Path) -> None:
    sae, cfg = load_trained(sae_lm_run)
    calls: list[tuple[int, int | None]] = []
    core(sae, source_of(cfg, torch.device("cpu")), 3000, 500, lambda done, total: calls.append((done, total)))
    # a total from the first batch on, estimated from each batch's rows (the held-out batches hold more than the
    # training ones), and exact at the last
    assert len(calls) > 2 and [done for done, _ in calls] == list(range(1, len(calls) + 1))
    assert all(total is not None and total >= done for done, total in calls) and calls[-1] == (len(calls), len(calls))
