"""Attribution graphs (experiments/sae/circuits/, `python -m runner.attribute`): on a 2-block GPT whose MLPs are ReLU
MLPs that ReLU transcoders reproduce exactly, the error nodes are zero, the replacement and completeness scores 1, a
target's incoming edges sum to its pre-activation (or demeaned logit), and every edge is a finite difference of the
frozen replacement model; a CLT with cross-layer writes gives edges that finite differences check too (its error
nodes included); the graph is the same for any batch size; pruning at thresholds 1 keeps everything, at 0 no
feature."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import SAE_LM, exact_coder, exact_transcoders, finished_clt_run, finished_run, relu_mlp_gpt
from omegaconf import OmegaConf

from experiments.lm.model import GPT
from experiments.sae.circuits.attribute import Graph, attribute
from experiments.sae.circuits.cli import main
from experiments.sae.circuits.coders import CoderSet
from experiments.sae.circuits.frozen import FrozenGPT
from experiments.sae.circuits.load import _layers
from experiments.sae.circuits.prune import prune, scores
from experiments.sae.coders.activations import ReLUSAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from runner import ConfigError

D, HIDDEN, LAYERS = 16, 24, 2


def _gpt() -> GPT:
    # a GPT whose MLPs are ReLU MLPs (helpers.ReluMlp) that ReLU transcoders reproduce exactly
    return relu_mlp_gpt(LAYERS, D, HIDDEN)


def _transcoders(gpt: GPT) -> CoderSet:
    return CoderSet.of_transcoders(exact_transcoders(gpt))


def _clt(gpt: GPT) -> CoderSet:
    torch.manual_seed(1)
    clt = CrossLayerTranscoder(partial(ReLUSAE, n_latents=HIDDEN), layers=LAYERS, d_in=D, d_out=D).double()
    with torch.no_grad():
        clt.input_scale.fill_(2.0)
        clt.target_scale.copy_(torch.tensor([0.5, 3.0]))
        for coder, block in zip(clt.coders, gpt.blocks, strict=True):
            exact_coder(coder, block.mlp, 1.0)
            coder.W_enc.div_(2.0)
            coder.W_dec[:, :D].mul_(0.5)  # written in units of layer 0's target_scale
        clt.coders[0].W_dec[:, D:] = 0.1 * torch.randn(HIDDEN, D)  # layer 0 writes to layer 1 too: errors there
        clt.coders[0].b_dec[D:].normal_()  # a constant, no node
    return CoderSet.of_clt(clt)


PROMPT = torch.tensor(list(b"def f(x):\n  ret"))


def test_the_frozen_model_is_the_model_on_its_prompt() -> None:
    gpt = _gpt()
    frozen = FrozenGPT(gpt, PROMPT)
    with torch.no_grad():
        assert torch.allclose(frozen.logits, gpt(PROMPT[None])[0], atol=1e-10)


def _targets(frozen: FrozenGPT, coders: CoderSet, graph: Graph, delta: list[torch.Tensor], emb=None) -> torch.Tensor:
    # every target's value in the frozen replacement model, features held at their activations, the MLP outputs moved
    # by `delta` (and the embeddings replaced by `emb`): the features' pre-activations less b_enc, then the logits
    # less the mean logit
    mlp = lambda m, x: frozen.mlp_outputs[m] + delta[m] + coders.skip(m, x) - coders.skip(m, frozen.mlp_inputs[m])  # noqa: E731
    with torch.no_grad():
        ins, final = frozen.run((frozen.embeddings if emb is None else emb)[None], mlp)
        layer, pos, latent = graph.features.t()
        reads = torch.stack(ins)[layer, 0, pos]
        encoders = torch.stack(
            [coders.encoder(int(m), torch.tensor([int(f)]))[0] for m, f in zip(layer, latent, strict=True)]
        )
        u = frozen.unembed
        logits = (u[graph.logit_tokens] - u.mean(0)) @ final[0, -1]
        return torch.cat([(reads * encoders).sum(1), logits])


def _check_finite_differences(frozen: FrozenGPT, coders: CoderSet, graph: Graph) -> None:
    eps, n_f, t = 1e-4, graph.n_features, graph.n_pos
    rows = torch.cat(
        [torch.arange(n_f), torch.arange(len(graph.adjacency) - len(graph.logit_tokens), len(graph.adjacency))]
    )
    zero = [torch.zeros_like(o) for o in frozen.mlp_outputs]
    base = _targets(frozen, coders, graph, zero)
    for source in [*range(0, n_f, 3), *range(n_f, n_f + (LAYERS + 1) * t)]:
        delta = [z.clone() for z in zero]
        emb = frozen.embeddings.clone()
        if source < n_f:  # a feature's activation moved by eps: its decoder rows move what it writes
            layer, pos, latent = graph.features[source].tolist()
            for m in coders.writes_to(layer):
                row = coders.rows(layer, torch.tensor([[latent]]))[0, 0]
                delta[m][pos] += eps * graph.activations[source] * row[(m - layer) * D : (m - layer + 1) * D]
        elif source < n_f + LAYERS * t:  # an error node scaled by 1 + eps
            layer, pos = divmod(source - n_f, t)
            delta[layer][pos] += eps * (frozen.mlp_outputs[layer][pos] - _replacement(frozen, coders, layer)[pos])
        else:  # a token's embedding scaled by 1 + eps
            emb[source - n_f - LAYERS * t] *= 1 + eps
        moved = _targets(frozen, coders, graph, delta, emb)
        assert torch.allclose((moved - base) / eps, graph.adjacency[rows, source], rtol=1e-6, atol=1e-7)


def _replacement(frozen: FrozenGPT, coders: CoderSet, layer: int) -> torch.Tensor:
    values = [coders.codes(m, frozen.mlp_inputs[m]) for m in range(LAYERS)]
    writes = coders.writes([v[None] for v, _ in values], [coders.rows(m, i) for m, (_, i) in enumerate(values)])
    return writes[layer][0] + coders.skip(layer, frozen.mlp_inputs[layer]) + coders.bias(layer)


def test_exact_transcoders_give_zero_errors_scores_of_1_and_edges_that_are_finite_differences() -> None:
    gpt = _gpt()
    frozen, coders = FrozenGPT(gpt, PROMPT), _transcoders(gpt)
    graph = attribute(frozen, coders, batch_size=5)
    assert graph.n_features > 20 and float(graph.error_norms.max()) < 1e-12
    assert scores(graph) == pytest.approx((1.0, 1.0), abs=1e-12)
    # a target's inputs sum to its pre-activation (no bias anywhere), a logit's to the logit less the mean logit
    for row in range(graph.n_features):
        layer, pos, latent = graph.features[row].tolist()
        pre = frozen.mlp_inputs[layer][pos] @ gpt.blocks[layer].mlp.up.weight[latent].detach()
        assert float(graph.adjacency[row].sum()) == pytest.approx(float(pre), abs=1e-10)
        assert float(graph.activations[row]) == pytest.approx(max(float(pre), 0.0), abs=1e-10)
    logits = frozen.logits[-1]
    demeaned = (logits - logits.mean())[graph.logit_tokens]
    assert torch.allclose(graph.adjacency[-len(graph.logit_tokens) :].sum(1), demeaned, atol=1e-10)
    _check_finite_differences(frozen, coders, graph)


def test_a_clt_s_edges_are_finite_differences_with_its_error_nodes() -> None:
    gpt = _gpt()
    frozen, coders = FrozenGPT(gpt, PROMPT), _clt(gpt)
    graph = attribute(frozen, coders, batch_size=7)
    assert float(graph.error_norms[0].max()) < 1e-12 < float(graph.error_norms[1].min())  # layer 0 exact
    replacement, completeness = scores(graph)
    assert 0 < replacement < 1 and 0 < completeness < 1
    _check_finite_differences(frozen, coders, graph)


def test_the_graph_is_the_same_for_every_batch_size() -> None:
    gpt = _gpt()
    frozen, coders = FrozenGPT(gpt, PROMPT), _clt(gpt)
    graphs = [attribute(frozen, coders, batch_size=b).adjacency for b in (1, 3, 64, 10_000)]
    for other in graphs[1:]:
        assert torch.allclose(graphs[0], other, rtol=1e-12, atol=1e-14)


def test_logit_nodes_follow_the_probability_mass_up_to_max_logits() -> None:
    gpt = _gpt()
    frozen, coders = FrozenGPT(gpt, PROMPT), _transcoders(gpt)
    probs = frozen.logits[-1].softmax(-1).sort(descending=True).values
    graph = attribute(frozen, coders, max_logits=200, logit_mass=0.5)
    k = len(graph.logit_tokens)
    assert float(probs[: k - 1].sum()) < 0.5 <= float(probs[:k].sum())
    assert len(attribute(frozen, coders, max_logits=3, logit_mass=1.0).logit_tokens) == 3


def test_pruning_at_1_keeps_everything_and_at_0_no_feature() -> None:
    gpt = _gpt()
    graph = attribute(FrozenGPT(gpt, PROMPT), _clt(gpt))
    # thresholds 1: the cumulative share reaches 1 (in floating point) at the last score that counts, so every node
    # of some influence stays (tokens and logits always), and every edge of some weight among the kept nodes; nodes of
    # none, or of a share below rounding (layer 0's error nodes here, vectors of 1e-15), go
    everything = prune(graph, 1.0, 1.0)
    fixed = graph.n_pos + len(graph.logit_tokens)
    some = everything.influence > 1e-12 * everything.influence.sum()
    some[-fixed:] = True
    assert torch.equal(everything.nodes, some)
    # the features of no influence: layer 1's before the last position (no later layer reads them)
    layer, pos, _ = graph.features.t()
    assert torch.equal(some[: graph.n_features], (layer == 0) | (pos == graph.n_pos - 1))
    among = (graph.adjacency != 0) & some[:, None] & some[None, :]
    assert everything.edges[among].all()
    nothing = prune(graph, 0.0, 0.0)
    assert nothing.nodes[-fixed:].all() and not nothing.nodes[: graph.n_features].any()
    assert int(nothing.nodes[:-fixed].sum()) <= 1  # the top error node at most
    default = prune(graph)
    assert 0 < int(default.nodes[: graph.n_features].sum()) < graph.n_features
    with pytest.raises(ValueError):
        prune(graph, 1.5)


def test_hooks_that_are_no_mlp_pairs_are_refused() -> None:
    def cfg(module, target):
        return OmegaConf.create({"data": {"module": module, "target": target}})

    assert _layers(Path("run"), cfg(["blocks.0.mlp_norm", "blocks.1.mlp_norm"], ["blocks.0.mlp", "blocks.1.mlp"])) == [
        0,
        1,
    ]
    for module, target in (
        ("blocks.0.mlp_norm", "blocks.1.mlp"),
        ("blocks.0", "blocks.0.mlp"),
        (["blocks.0.mlp_norm"], []),
    ):
        with pytest.raises(ConfigError, match="mixed hooks"):
            _layers(Path("run"), cfg(module, target))


@pytest.fixture(scope="module")
def clt_run(lm_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_clt_run(tmp_path_factory.mktemp("clt"), lm_run)


def test_the_command_writes_the_graph_of_a_clt_run(clt_run: Path, tmp_path: Path, capsys) -> None:
    import json

    assert main([str(clt_run), "prompt=import json", f"out={tmp_path}", "--batch-size", "16", "node_threshold=1"]) == 0
    data = json.loads((tmp_path / "graph.json").read_text())
    assert data["tokens"] == list(b"import json") and data["model"] and data["coder"] == [str(clt_run)]
    kinds = {node["kind"] for node in data["nodes"]}
    assert {"token", "logit", "feature"} <= kinds and data["edges"]
    assert 0 < data["scores"]["replacement"] <= 1 and 0 < data["scores"]["completeness"] <= 1
    page = (tmp_path / "index.html").read_text()
    assert "import json" in page and "<script src" not in page  # the page, whole and offline
    assert capsys.readouterr().out.count("wrote") == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["prompt="], "prompt= is empty"),
        (["prompt=" + "x" * 33], "longer than the model's window"),
        (["prompt=a", "node_threshold=2"], "fraction"),
        (["prompt=a", "batch_size=0"], "whole number"),
        (["prompt=a", "--serve", "port=0"], "give a port from 1 to 65535"),
        (["prompt=a", "--serv"], "--serve"),
        ([], "prompt= is empty"),
    ],
)
def test_bad_input_exits_2_with_one_paragraph(clt_run: Path, args: list[str], said: str, capsys) -> None:
    assert main([str(clt_run), *args]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_an_sae_is_no_transcoder(sae_lm_run: Path, capsys) -> None:
    assert main([str(sae_lm_run), "prompt=ab"]) == 2
    assert "no transcoder" in capsys.readouterr().err


def test_a_family_of_saes_is_refused(lm_run: Path, tmp_path: Path, capsys) -> None:
    # model=sae_multi over blocks.0 and blocks.1: SAEs of the stream, no replacement of the MLPs
    overrides = [o for o in SAE_LM if not o.startswith("model.")] + ["model=sae_multi", "model.ks=[4]"]
    overrides += ["model.base.n_latents=32", "source.module=[blocks.0,blocks.1]"]
    finished_run(tmp_path, "+experiment=sae_lm", f"source.checkpoint={lm_run}", *overrides)
    capsys.readouterr()
    assert main([str(tmp_path), "prompt=ab"]) == 2
    err = capsys.readouterr().err
    assert "a family of SAEs (model=sae_multi)" in err and err.count("\n") == 1


def test_help_exits_0(capsys) -> None:
    assert main(["--help"]) == 0 and "runner.attribute" in capsys.readouterr().out


def test_a_clt_exported_to_circuit_tracer_s_folder_gives_the_same_graph(lm_run: Path, tmp_path: Path) -> None:
    # weights folded into raw units and read back, the skipped first positions kept in config.yaml: the same graph
    import json

    from experiments.sae.circuits.output import graph_data
    from experiments.sae.formats.circuit_tracer_clt import write_clt
    from runner.load import load_trained

    gpt, _ = load_trained(lm_run)
    gpt.eval()
    torch.manual_seed(3)
    d, layers = gpt.head.weight.shape[1], len(gpt.blocks)
    clt = CrossLayerTranscoder(partial(ReLUSAE, n_latents=24), layers=layers, d_in=d, d_out=d).eval()
    with torch.no_grad():
        clt.input_scale.uniform_(0.5, 2.0)
        clt.target_scale.uniform_(0.5, 2.0)
        for coder in clt.coders:
            coder.W_dec.normal_(std=0.2)
            coder.b_enc.normal_(std=0.1)
    modules, targets = [f"blocks.{i}.mlp_norm" for i in range(layers)], [f"blocks.{i}.mlp" for i in range(layers)]
    write_clt(clt, tmp_path / "ct", modules, str(lm_run), targets, skip_positions=2)
    prompt = "def f(x):"
    assert main([str(tmp_path / "ct"), f"prompt={prompt}", f"out={tmp_path / 'graph'}", "node_threshold=1"]) == 0
    got = json.loads((tmp_path / "graph" / "graph.json").read_text())
    graph = attribute(FrozenGPT(gpt, torch.tensor(list(prompt.encode()))), CoderSet.of_clt(clt, skip_positions=2))
    want = graph_data(graph, prune(graph, 1.0, 0.98), scores(graph), {})
    assert got["skip_positions"] == 2 and min(n["pos"] for n in got["nodes"] if n["kind"] == "feature") >= 2
    assert [n["kind"] for n in got["nodes"]] == [n["kind"] for n in want["nodes"]]
    assert got["unpruned"]["features"] == graph.n_features > 0
    ours = {(e["source"], e["target"]): e["weight"] for e in want["edges"]}
    theirs = {(e["source"], e["target"]): e["weight"] for e in got["edges"]}
    assert ours.keys() == theirs.keys()
    scale = max(abs(w) for w in ours.values())
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-5 * scale
    assert got["scores"] == pytest.approx(want["scores"], abs=1e-5)


def test_a_clt_run_exports_to_circuit_tracer_and_its_folder_is_attributed(
    clt_run: Path, lm_run: Path, tmp_path: Path, capsys
) -> None:
    # python -m runner.export on a run: the TopK CLT calibrated on the run's own validation rows, its cost said; the
    # folder read back by runner.attribute on the run's GPT
    import json

    import yaml

    from runner.tools import export

    assert export.main([str(clt_run), "format=circuit_tracer", f"out={tmp_path / 'ct'}"]) == 0
    said = capsys.readouterr()
    assert "TopK -> JumpReLU on" in said.out + said.err and "FVE" in said.out + said.err
    cfg = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert (cfg["model_kind"], cfg["feature_input_hook"]) == ("cross_layer_transcoder", "mlp.hook_in")
    ours = cfg["runner"]
    assert ours["converted_from"] == "topk" and ours["skip_positions"] == 1 and len(ours["conversion"]["l0_topk"]) == 2
    for topk, jumprelu in zip(ours["conversion"]["l0_topk"], ours["conversion"]["l0_jumprelu"], strict=True):
        assert jumprelu == pytest.approx(topk, rel=0.05)
    out = tmp_path / "graph"
    assert main([str(tmp_path / "ct"), f"source={lm_run}", "prompt=import json", f"out={out}", "node_threshold=1"]) == 0
    data = json.loads((out / "graph.json").read_text())
    assert data["skip_positions"] == 1 and data["unpruned"]["features"] > 0
    assert min(n["pos"] for n in data["nodes"] if n["kind"] == "feature") >= 1
