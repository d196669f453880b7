"""runner's attribution graphs of a transformers GPT-2 (experiments/sae/circuits/frozen_hf.py) are circuit-tracer
0.5.0's: a tiny GPT-2 (tests/helpers.py tiny_hf_model, saved by save_pretrained) and random transcoders (ReLU;
JumpReLU and ReLU skip transcoders; a ReLU CLT writing across layers) exported as circuit-tracer folders, which
runner reads back (load_coders) and circuit-tracer loads with its own loaders in its virtualenv (benchmarks/peers/
circuit_tracer_graph.py), into its TransformerLensReplacementModel built from a HookedTransformerConfig and the same
weights (convert_gpt2_weights; no LayerNorm folding, no centring: the graph is of the model as saved, as
from_pretrained_and_transcoders loads it). On the same token ids (a BOS first), both run in float64: the same active
features (layer, position, latent) and activations, the same logit tokens, the adjacency matrix to 1e-9 of its largest
entry, the replacement and completeness scores to 1e-6 (runner's logit probabilities are a float32 softmax).

What agrees by definition on both sides: the token nodes are W_E[token] (position embeddings and every bias are
constants); position 0 (the BOS) has no features and its error nodes no edges, its MLP outputs held at the prompt's
but for a skip transcoder's linear path; targets are encoder rows at the MLP input and demeaned unembedding columns.

circuit-tracer loads the folders with the hooks they name: `mlp.hook_in` (its ReplacementMLP's input, ln_2's output;
not `ln2.hook_normalized`, TransformerLens's stream before ln2's gain and bias) and `hook_mlp_out`.

What does not: circuit-tracer's TranscoderSet takes layer 0's W_skip to say whether every layer has a skip path (a
set of skip and plain transcoders loses its later skip paths' edges there): the skip case's layers all have one.
Skipped where .venv-circuit-tracer is absent."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import HF_TEXT, ROOT, peer_python, tiny_hf_model

from experiments.sae.circuits.attribute import attribute
from experiments.sae.circuits.frozen_hf import FrozenHF, prompt_tokens
from experiments.sae.circuits.load import load_coders
from experiments.sae.circuits.prune import scores
from experiments.sae.coders.activations import ReLUSAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.formats import export
from experiments.sae.formats.circuit_tracer_clt import write_clt
from runner.load import TRUSTED_TARGETS

pytestmark = pytest.mark.slow
D, LATENTS, LAYERS, MAX_LOGITS, MASS = 32, 64, 2, 5, 0.95
PROMPT = "def add(a, b):\n    return"
THEIRS = ROOT / "benchmarks" / "peers" / "circuit_tracer_graph.py"  # run by circuit-tracer's interpreter


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model(tmp_path_factory.mktemp("gpt2") / "model", "gpt2")


def _rows(folder: Path) -> torch.Tensor:
    # every layer's MLP input, then every layer's output, on 64 tokens of the model's text: [64, 2 L d]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    frozen = FrozenHF(model.eval(), torch.tensor(tokenizer("".join(HF_TEXT))["input_ids"][:64]), 0)
    return torch.cat([*frozen.mlp_inputs, *frozen.mlp_outputs], 1)


def _transcoders(folder: Path, rows: torch.Tensor, out: Path, jumprelu: bool) -> list[str]:
    # one per layer, each exported alone (as `runner export` writes one): ReLU; or skip transcoders, JumpReLU then ReLU
    # (circuit-tracer's TranscoderSet takes layer 0's W_skip to say whether every layer has one)
    torch.manual_seed(0)
    folders = []
    for layer in range(LAYERS):
        cls = JumpReLUSAE if jumprelu and layer == 0 else ReLUSAE
        coder = cls(d_in=D, n_latents=LATENTS, d_out=D, skip=jumprelu)
        inputs, outputs = rows[:, layer * D : (layer + 1) * D], rows[:, (LAYERS + layer) * D : (LAYERS + layer + 1) * D]
        coder.initialize_from(torch.cat([inputs, outputs], 1))
        with torch.no_grad():
            coder.b_enc.sub_(0.8)  # some of the latents active at a position
            if coder.skip:
                coder.W_skip.normal_(std=0.1)
            if cls is JumpReLUSAE:
                coder.threshold.uniform_(0.0, 0.3)
        hooks = (f"transformer.h.{layer}.ln_2", f"transformer.h.{layer}.mlp")
        folders.append(
            str(export(coder.eval(), "circuit_tracer", out / f"layer{layer}", hooks[0], str(folder), hooks[1]))
        )
    return folders


def _clt(folder: Path, rows: torch.Tensor, out: Path) -> list[str]:
    torch.manual_seed(1)
    clt = CrossLayerTranscoder(functools.partial(ReLUSAE, n_latents=LATENTS), layers=LAYERS, d_in=D, d_out=D)
    clt.initialize_from(rows)
    with torch.no_grad():
        for coder in clt.coders:
            coder.b_enc.sub_(0.8)
        clt.coders[0].W_dec[:, D:].normal_(std=0.2)  # layer 0's latents write to layer 1's output too
    modules = [f"transformer.h.{i}.ln_2" for i in range(LAYERS)]
    write_clt(clt.eval(), out, modules, str(folder), [f"transformer.h.{i}.mlp" for i in range(LAYERS)])
    return [str(out)]


def _ours(folders: list[str]) -> dict:
    # runner's graph of the folders as runner reads them back, in float64
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the coders are built in it
    try:
        model, coders, meta, tokenizer = load_coders([Path(f) for f in folders], TRUSTED_TARGETS)
    finally:
        torch.set_default_dtype(was)
    assert meta["skip_positions"] == 1
    tokens = prompt_tokens(tokenizer, PROMPT, int(model.config.n_positions))
    frozen = FrozenHF(model.double(), tokens, coders.skip_positions, coders.skip)
    graph = attribute(frozen, coders, MAX_LOGITS, MASS)
    return {"graph": graph, "scores": scores(graph), "tokens": tokens.tolist()}


@pytest.fixture(scope="module")
def graphs(gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    """Each case's (runner's graph, circuit-tracer's), circuit-tracer's made in one run of its interpreter."""
    interpreter = peer_python("circuit-tracer")
    tmp, rows = tmp_path_factory.mktemp("agreement"), _rows(gpt2)
    cases = {
        "relu": _transcoders(gpt2, rows, tmp / "relu", jumprelu=False),
        "jumprelu_skip": _transcoders(gpt2, rows, tmp / "jumprelu_skip", jumprelu=True),
        "clt": _clt(gpt2, rows, tmp / "clt"),
    }
    ours = {name: _ours(folders) for name, folders in cases.items()}
    specs = [
        {"name": name, "folders": folders, "clt": name == "clt", "tokens": ours[name]["tokens"]}
        | {"input_hook": _written_hook(folders[0]), "max_logits": MAX_LOGITS, "mass": MASS}
        | {"dtype": "float64", "batch_size": 16}
        for name, folders in cases.items()
    ]
    out = tmp / "theirs"
    out.mkdir()
    done = subprocess.run(
        [interpreter, str(THEIRS), str(gpt2), str(out), json.dumps(specs)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {spec["name"]: (ours[spec["name"]], _theirs(out / spec["name"])) for spec in specs}


def _written_hook(folder: str) -> str:
    return yaml.safe_load((Path(folder) / "config.yaml").read_text())["feature_input_hook"]


def _theirs(where: Path) -> dict:
    got = {p.stem: np.load(p) for p in where.glob("*.npy")}
    return got | json.loads((where / "facts.json").read_text())


def _agree(ours: dict, theirs: dict) -> None:
    graph = ours["graph"]
    assert theirs["input_tokens"].tolist() == ours["tokens"] and ours["tokens"][0] == 0  # the BOS first
    assert np.array_equal(theirs["active_features"], graph.features.numpy())
    assert np.allclose(theirs["activation_values"], graph.activations.numpy(), rtol=1e-9, atol=1e-12)
    assert theirs["logit_tokens"] == graph.logit_tokens.tolist()
    assert np.allclose(theirs["logit_probabilities"], graph.logit_probabilities.numpy(), atol=1e-6)
    adjacency = graph.adjacency.numpy()
    assert theirs["adjacency_matrix"].shape == adjacency.shape
    assert np.abs(theirs["adjacency_matrix"] - adjacency).max() <= 1e-9 * np.abs(adjacency).max()
    assert ours["scores"] == pytest.approx(tuple(theirs["scores"]), abs=1e-6)


@pytest.mark.parametrize("case", ["relu", "jumprelu_skip", "clt"])
def test_runner_s_graph_is_circuit_tracer_s(graphs: dict, case: str) -> None:
    ours, theirs = graphs[case]
    graph = ours["graph"]
    assert graph.n_features > 50 and not (graph.features[:, 1] == 0).any()
    assert 0 < ours["scores"][0] < 1 and 0 < ours["scores"][1] < 1  # error nodes of some weight
    _agree(ours, theirs)
