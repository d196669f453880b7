"""python -m runner.features: per-latent statistics in one streaming pass (equal to brute force over the whole matrix),
the pages' data for an SAE on a GPT's residual stream (contexts are the text around the firing position) and on the
synthetic preset (best-matching true features), determinism, and refusals."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import SAE_LM, finished_run

from experiments.sae.pages.dashboard import BEFORE
from experiments.sae.pages.stats import QUANTILES, LatentStats, bin_edges, logit_lens, nearest, top_per_group
from experiments.sae.pages.write import CHUNK
from experiments.sae.sources.source import SourceModel
from runner.load import load_trained
from runner.tools import features as features_module
from runner.tools.features import main


def _data(path: Path) -> dict:
    # a data file's payload: `FEATURES.index({...});`
    return json.loads(re.fullmatch(r"FEATURES\.\w+\((.*)\);\n", path.read_text(), re.DOTALL).group(1))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-codes", "topk-codes"])
def test_streaming_statistics_equal_brute_force_over_the_whole_matrix(sparse: bool) -> None:
    torch.manual_seed(0)
    codes = torch.relu(torch.randn(1000, 40) - 1.2)
    if sparse:  # the k largest per row, as a TopK SAE's activate gives them
        values, indices = codes.topk(3, dim=1)
        codes = torch.zeros_like(codes).scatter(1, indices, values)
    stats = LatentStats(40, top=6, samples=2)
    for start in range(0, 1000, 64):
        rows = slice(start, start + 64)
        stats.add(*((values[rows], indices[rows]) if sparse else (codes[rows], None)), first_row=start)
    r = stats.result()
    fired = codes > 0
    torch.testing.assert_close(r["density"], fired.double().mean(0))
    torch.testing.assert_close(r["max"], codes.max(0).values)
    torch.testing.assert_close(r["mean"], codes.double().sum(0) / fired.sum(0).clamp_min(1))
    assert torch.equal(r["hist"].sum(1), fired.sum(0))
    top = codes.t().topk(6, dim=1)
    has = top.values > 0  # a latent that fired on fewer rows keeps fewer (-1 / 0 after them)
    assert torch.equal(r["top_values"], top.values * has)
    assert torch.equal(r["top_rows"][has], top.indices[has]) and (r["top_rows"][~has] == -1).all()
    # each sampled example is a row where its latent fired, with its value, inside its quantile's range, and in a bin
    # whose share of the latent's activations (brute force: the fraction below and up to the bin) meets that quantile
    rows, values, edges = r["sample_rows"], r["sample_values"], bin_edges()
    assert (rows >= 0).sum(2).gt(0).sum(1).max() == QUANTILES  # latents that fire often show every quantile
    for latent, q, slot in (rows >= 0).nonzero().tolist():
        row, value = rows[latent, q, slot], values[latent, q, slot]
        assert codes[row, latent] == value
        assert r["sample_low"][latent, q] <= value <= r["sample_high"][latent, q]
        b = int(torch.searchsorted(edges, torch.tensor(float(value), dtype=torch.float64), right=True)) - 1
        fired_values = codes[:, latent][fired[:, latent]].double()
        below, upto = ((fired_values < edges[b]).double().mean(), (fired_values < edges[b + 1]).double().mean())
        assert below <= (q + 1) / QUANTILES and upto >= q / QUANTILES, (latent, q, below, upto)


def test_a_latent_whose_activations_fill_one_bin_still_shows_every_fifth_in_order() -> None:
    # each bin's rows placed in one fifth (by the bin's middle) left such a latent's sections without the 60-80% fifth
    gen = torch.Generator().manual_seed(0)
    codes = torch.zeros(3000, 2)
    codes[:, 0] = 1.0 + 0.04 * torch.rand(3000, generator=gen)  # one log10 bin holds every activation
    codes[::3, 1] = torch.rand(1000, generator=gen) * 5 + 0.01  # spread over a few decades
    stats = LatentStats(2, top=8, samples=3)
    for start in range(0, 3000, 250):
        stats.add(codes[start : start + 250], None, first_row=start)
    r = stats.result()
    for latent in (0, 1):
        rows, low, high = r["sample_rows"][latent], r["sample_low"][latent], r["sample_high"][latent]
        assert (rows >= 0).all(), (latent, rows)  # five fifths, three examples each
        assert not set(rows.flatten().tolist()) & set(r["top_rows"][latent].tolist())  # none repeats the strongest
        assert (low <= high).all() and (high[:-1] <= low[1:]).all(), (low, high)  # the fifths in order
        fired = codes[:, latent][codes[:, latent] > 0]
        for q in range(QUANTILES):
            for row in rows[q].tolist():
                share = float((fired < codes[row, latent]).double().mean())  # the rank of its value, brute force
                assert q / QUANTILES - 0.1 <= share <= (q + 1) / QUANTILES + 0.1, (latent, q, share)  # a sample's rank


def test_top_per_group_keeps_the_largest_of_each_group_with_their_payload() -> None:
    groups = torch.tensor([2, 0, 2, 0, 2, 1])
    values = torch.tensor([5.0, 1.0, 7.0, 3.0, 6.0, 4.0])
    kept = top_per_group(groups, values, 2, torch.arange(6))
    assert [t.tolist() for t in kept] == [[0, 0, 1, 2, 2], [3.0, 1.0, 4.0, 7.0, 6.0], [3, 1, 5, 2, 4]]


def test_the_logit_lens_and_neighbours_come_from_the_weights() -> None:
    W_dec = torch.eye(4)[[0, 1, 3]]  # latents along dimensions 0, 1 and 3
    unembed = torch.tensor([[1.0, 0, 0, 0], [0, 2.0, 0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 1.0]])  # 4 tokens
    lens = logit_lens(W_dec, unembed, gain=torch.tensor([1.0, 0.5, 1.0, 1.0]), k=1)
    assert lens["promoted"].flatten().tolist() == [0, 1, 3] and lens["suppressed"][0].item() == 2
    assert lens["promoted_logits"][1].item() == 1.0  # token 1's 2 x the gain's 0.5
    near, cos = nearest(torch.tensor([[1.0, 0], [0.9, 0.1], [0, 1.0]]), k=1)
    assert near.flatten().tolist() == [1, 0, 1] and cos[0].item() == pytest.approx(0.9939, abs=1e-4)


def test_an_sae_on_a_gpt_gets_pages_whose_contexts_are_the_text_around_its_strongest_activations(
    sae_lm_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 400 positions: the held-out windows alone (16 of 32 tokens, the first position skipped)
    assert main([str(sae_lm_run), "tokens=400", "top=4", f"out={tmp_path / 'a'}"]) == 0
    assert f"wrote {tmp_path / 'a' / 'index.html'}" in capsys.readouterr().out
    index = _data(tmp_path / "a" / "data" / "index.js")
    assert index["n_latents"] == 64 and index["texts"] and len(index["vocab"]) == 256 and index["lens_tied"]
    assert index["rows"] == 16 * 31 and index["splits"] == {"val": 16}
    assert (tmp_path / "a" / "index.html").read_text() == (Path("experiments/sae/pages/static/index.html")).read_text()
    chunk = _data(tmp_path / "a" / "data" / "latents-0000.js")["latents"]
    assert len(chunk) == min(64, CHUNK)
    # brute force: every code of the same rows (the source's validation windows first, in order)
    sae, cfg = load_trained(sae_lm_run)
    source = SourceModel(cfg.data.checkpoint, cfg.data.module, skip_positions=cfg.data.skip_positions)
    windows, acts = [], []
    for batch in source.data.val_loader():
        windows.append(batch["tokens"][:, :-1])
        acts.append(source.activations(batch))
    windows, codes = torch.cat(windows), sae.encode(torch.cat(acts))
    per_window = windows.shape[1] - source.skip
    checked = 0
    for latent, data in chunk.items():
        best = data["contexts"][0] if data["contexts"] else None
        if best is None:
            assert codes[:, int(latent)].max() == 0
            continue
        row = int(codes[:, int(latent)].argmax())
        window, position = divmod(row, per_window)
        position += source.skip
        assert best["value"] == pytest.approx(codes[row, int(latent)].item(), abs=1e-4)
        start = max(0, position - BEFORE)
        assert best["ids"][: best["at"] + 1] == windows[window, start : position + 1].tolist() and best["at"] <= BEFORE
        checked += 1
    assert checked >= 32
    assert all(len(p := d["promoted"]) == 8 and p[0][1] >= p[-1][1] for d in chunk.values())
    # the same command gives the same pages (400 written as Hydra reads 4e2: a number)
    assert main([str(sae_lm_run), "tokens=4e2", "top=4", f"out={tmp_path / 'b'}"]) == 0
    for name in ("index.js", "latents-0000.js"):
        a, b = _data(tmp_path / "a" / "data" / name), _data(tmp_path / "b" / "data" / name)
        a.pop("seconds", None), b.pop("seconds", None)
        assert a == b, name
    # more text than the held-out windows hold: the training windows follow; each phase of the build tells the console
    # how far it is, from 0 to its end: the pass batch by batch, then the weights' views and the pages (minutes of work
    # that would otherwise follow the pass's last line in silence)
    heard: list[tuple[str, int, int]] = []
    monkeypatch.setattr(features_module.ConsoleLogger, "working", lambda self, *call: heard.append(call))
    assert main([str(sae_lm_run), "tokens=3000", f"out={tmp_path / 'c'}"]) == 0
    more = _data(tmp_path / "c" / "data" / "index.js")
    assert more["splits"]["val"] == 16 and more["splits"]["train"] > 0 and more["rows"] >= 3000
    phases = ["features: statistics (1 of 3)", "features: weights (2 of 3)", "features: pages (3 of 3)"]
    assert list(dict.fromkeys(what for what, _, _ in heard)) == phases
    for phase in phases:
        calls = [(done, total) for what, done, total in heard if what == phase]
        assert [done for done, _ in calls] == list(range(len(calls))) and calls[-1][0] == calls[-1][1]
        assert all(total for _, total in calls[1:])  # a total (hence an ETA) from its first step
    assert len([c for c in heard if c[0] == phases[0]]) > 3
    # 64 latents: the neighbours and the logit lens take a step each; the pages are one file of CHUNK latents
    assert [c for c in heard if c[0] != phases[0]] == [(phases[1], d, 2) for d in (0, 1, 2)] + [
        (phases[2], 0, 1),
        (phases[2], 1, 1),
    ]


def test_an_sae_on_synthetic_data_shows_each_latent_s_best_true_feature(compose_cfg: Callable, tmp_path: Path) -> None:
    run = tmp_path / "sae"
    overrides = ["+experiment=sae", "model.n_latents=32", "data.splits.n_train=4096", "data.splits.n_val=512"]
    overrides += ["data.splits.d=16", "data.splits.n_features=16", "trainer.max_duration=30st", "logger=none"]
    run.mkdir()
    finished_run(run, *overrides, "checkpoint=none")
    assert main([str(run), "tokens=512", "neuronpedia=true", f"out={tmp_path / 'np'}"]) == 2  # no text to show
    assert not (tmp_path / "np" / "index.html").exists()
    assert main([str(run), "tokens=512", f"out={tmp_path / 'pages'}"]) == 0
    index = _data(tmp_path / "pages" / "data" / "index.js")
    assert not index["texts"] and index["vocab"] is None and index["rows"] == 512 and len(index["truth"]) == 32
    chunk = _data(tmp_path / "pages" / "data" / "latents-0000.js")["latents"]
    assert all(0 <= d["truth"][0] < 16 and -1 <= d["truth"][1] <= 1 for d in chunk.values())
    assert all("row" in c and "ids" not in c for d in chunk.values() for c in d["contexts"])
    assert all("promoted" not in d for d in chunk.values())  # no source model, no logit lens


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "usage: python -m runner.features RUN_DIR"),
        (["tokens=0"], "tokens=0: give a whole number >= 1"),
        (["tokens=lots"], "tokens='lots': give a whole number >= 1"),
        (["depth=3"], "'depth=3': give KEY=VALUE with KEY one of tokens, out, top, device, neuronpedia, port"),
        (["device=cuda:7"], "device=cuda:7: this machine has"),
    ],
)
def test_bad_arguments_are_refused_with_exit_2(
    sae_lm_run: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main([str(sae_lm_run), *args] if args else []) == 2
    assert message in capsys.readouterr().err


def test_a_run_that_is_not_an_sae_is_refused(lm_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(lm_run)]) == 2
    assert "has no feature pages (runner's SAEs have)" in capsys.readouterr().err


def test_a_family_on_two_hook_points_gets_a_folder_per_sae_each_reading_its_module(
    lm_run: Path, tmp_path: Path
) -> None:
    family = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.module=[blocks.0,blocks.1]"]
    family += ["model=sae_multi", "model.ks=[4,8]", "model.base.n_latents=32"]
    family += [o for o in SAE_LM if not o.startswith(("model.", "source."))]
    run = tmp_path / "family"
    run.mkdir()
    finished_run(run, *family)
    assert main([str(run), "tokens=400", f"out={tmp_path / 'pages'}"]) == 0
    names = ["blocks_0_k4", "blocks_0_k8", "blocks_1_k4", "blocks_1_k8"]
    assert re.findall(r'href="(\w+)/index.html"', (tmp_path / "pages" / "index.html").read_text()) == names
    task, cfg = load_trained(run)
    source = SourceModel(cfg.data.checkpoint, list(cfg.data.module), skip_positions=cfg.data.skip_positions)
    acts = torch.cat([source.activations(batch) for batch in source.data.val_loader()])
    for name in names:
        index = _data(tmp_path / "pages" / name / "data" / "index.js")
        assert index["title"] == f"TopKSAE {name}" and index["n_latents"] == 32 and index["rows"] == 16 * 31
        # its density is that of its own SAE on its own module's columns (32 of the 64)
        codes = task.saes[name].encode(task.rows_of(acts, name))
        assert index["density"] == [float(f"{v:.3g}") for v in (codes > 0).double().mean(0).tolist()]  # as shown


def _density(codes: torch.Tensor) -> list[float]:
    return [float(f"{v:.3g}") for v in (codes > 0).double().mean(0).tolist()]  # as the pages show it


def test_a_transcoder_s_pages_read_its_input_and_its_lens_reads_what_it_writes(lm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "transcoder"
    run.mkdir()
    settings = [o for o in SAE_LM if not o.startswith("source.")]
    finished_run(run, "+experiment=transcoder_lm", f"source.checkpoint={lm_run}", "source.layer=1", *settings)
    assert main([str(run), "tokens=400", f"out={tmp_path / 'pages'}"]) == 0
    index = _data(tmp_path / "pages" / "data" / "index.js")
    assert index["n_latents"] == 64 and index["rows"] == 16 * 31 and index["texts"]
    task, cfg = load_trained(run)
    assert task.transcoder and cfg.data.target == "blocks.1.mlp"
    source = SourceModel(cfg.data.checkpoint, cfg.data.module, skip_positions=1, target=cfg.data.target)
    rows = torch.cat([source.activations(batch) for batch in source.data.val_loader()])
    # the latents as they fire on the MLP's input (the rows' first d_in columns), not on its output
    assert index["density"] == _density(task.encode(task.split(rows)[0]))
    chunk = _data(tmp_path / "pages" / "data" / "latents-0000.js")["latents"]
    unembed = source.model.head.weight.detach() * source.model.norm.weight.detach()
    best = (task.W_dec.detach()[0] @ unembed.t()).topk(8).indices.tolist()  # latent 0's write, through the head
    assert [token for token, _ in chunk["0"]["promoted"]] == best


def test_a_cross_layer_transcoder_gets_a_folder_per_layer_each_reading_its_layer_s_input(
    lm_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "clt"
    run.mkdir()
    settings = [o for o in SAE_LM if not o.startswith(("source.", "model."))]
    layers = ["source.module=[blocks.0.mlp_norm,blocks.1.mlp_norm]", "source.target=[blocks.0.mlp,blocks.1.mlp]"]
    coder = ["model.coder.n_latents=32", "model.coder.k=4"]
    finished_run(run, "+experiment=clt_lm", f"source.checkpoint={lm_run}", *layers, *coder, *settings)
    assert main([str(run), "tokens=400", f"out={tmp_path / 'pages'}"]) == 0
    assert re.findall(r'href="(\w+)/index.html"', (tmp_path / "pages" / "index.html").read_text()) == [
        "layer0",
        "layer1",
    ]
    task, cfg = load_trained(run)
    source = SourceModel(cfg.data.checkpoint, list(cfg.data.module), skip_positions=1, target=list(cfg.data.target))
    inputs, _ = task.split(torch.cat([source.activations(batch) for batch in source.data.val_loader()]))
    for layer in (0, 1):
        index = _data(tmp_path / "pages" / f"layer{layer}" / "data" / "index.js")
        assert index["n_latents"] == 32 and index["rows"] == 16 * 31
        with torch.no_grad():
            values, indices = task.coders[layer].codes(inputs[layer] * task.input_scale[layer])
        assert index["density"] == _density(task.coders[layer]._dense(values, indices))


# NeuronpediaDashboardFeature.to_dict()'s keys (SAEDashboard, sae_dashboard/neuronpedia/neuronpedia_dashboard.py)
NEURONPEDIA_KEYS = {
    *("feature_index", "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1"),
    *("correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson"),
    *("correlated_features_indices", "correlated_features_l1", "correlated_features_pearson"),
    *("neg_str", "neg_values", "pos_str", "pos_values", "frac_nonzero", "freq_hist_data_bar_values"),
    *("freq_hist_data_bar_heights", "logits_hist_data_bar_heights", "logits_hist_data_bar_values"),
    *("n_prompts_total", "n_tokens_in_prompt", "dataset", "decoder_weights_dist", "activations"),
}


def test_neuronpedia_batches_hold_every_latent_as_its_uploads_take_them(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path
) -> None:
    assert main([str(sae_lm_run), "tokens=400", "neuronpedia=true", f"out={tmp_path / 'p'}"]) == 0
    batches = sorted((tmp_path / "p" / "neuronpedia").glob("batch-*.json"))
    assert [b.name for b in batches] == ["batch-0.json"]  # 64 latents: one chunk
    batch = json.loads(batches[0].read_text())
    assert (batch["model_id"], batch["layer"], batch["sae_set"]) == (lm_run.name, 1, sae_lm_run.name)
    index = _data(tmp_path / "p" / "data" / "index.js")
    features = batch["features"]
    assert [f["feature_index"] for f in features] == list(range(64))
    for feature in features:
        assert set(feature) == NEURONPEDIA_KEYS
        i = feature["feature_index"]
        assert feature["frac_nonzero"] == pytest.approx(index["density"][i], rel=1e-2)
        assert len(feature["pos_str"]) == len(feature["pos_values"]) == 8 and all(feature["pos_str"])
        if not feature["activations"]:
            assert index["density"][i] == 0
            continue
        top = feature["activations"][0]
        assert top["bin_min"] == -1 and top["bin_max"] == pytest.approx(index["max"][i], rel=1e-3)
        for context in feature["activations"]:
            assert len(context["tokens"]) == len(context["values"])
            assert all(isinstance(t, str) for t in context["tokens"])
            assert sum(v != 0 for v in context["values"]) == 1  # the firing token's activation alone (see the module)
    assert sum(bool(f["activations"]) for f in features) > 32
    # the same folder written again without them: no batch is left that the pages no longer match
    assert main([str(sae_lm_run), "tokens=400", f"out={tmp_path / 'p'}"]) == 0
    assert not list((tmp_path / "p" / "neuronpedia").glob("batch-*.json"))
    assert main([str(sae_lm_run), "neuronpedia=maybe"]) == 2
