"""Attribution graphs on a transformers GPT-2 (experiments/sae/circuits/frozen_hf.py): the frozen model's logits and
MLP inputs are the model's on its prompt; on a tiny random GPT2LMHeadModel (GELU MLPs, which no transcoder reproduces
exactly) with random transcoders (layer 0's a skip transcoder, whose linear path stays at the BOS) or a CLT, every
edge is a finite difference of the frozen replacement model with its error nodes, and a target's incoming edges plus
its constant part (what the position embeddings, biases and held position 0 give with every node at zero) sum to its
value; position 0 (the BOS) has no feature and its error nodes no edge. A prompt is tokenized after a BOS and refused
past n_positions; the command reads circuit-tracer folders on a saved GPT-2 folder (at
mlp.hook_in; ln2.hook_normalized is refused); a run's hooks pair GPT-2's ln_2 and mlp."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from experiments.sae.circuits.attribute import Graph, attribute  # noqa: E402
from experiments.sae.circuits.cli import main  # noqa: E402
from experiments.sae.circuits.coders import CoderSet  # noqa: E402
from experiments.sae.circuits.frozen_hf import FrozenHF, prompt_tokens  # noqa: E402
from experiments.sae.circuits.load import _layers, load_coders  # noqa: E402
from experiments.sae.coders.activations import ReLUSAE  # noqa: E402
from experiments.sae.coders.clt import CrossLayerTranscoder  # noqa: E402
from experiments.sae.formats import export  # noqa: E402
from runner import ConfigError  # noqa: E402
from runner.load import TRUSTED_TARGETS  # noqa: E402

D, LATENTS, LAYERS, VOCAB = 16, 32, 2, 40
PROMPT = torch.tensor([0, 7, 12, 3, 25, 7, 30, 9, 14])  # 0: the BOS


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS, n_embd=D, n_head=2, n_positions=16, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    config.initializer_range = 0.3  # patterns far from uniform, MLPs far from linear
    return GPT2LMHeadModel(config).eval()


def _rows(model: GPT2LMHeadModel) -> torch.Tensor:
    # every layer's MLP inputs then outputs on random prompts, [rows, 2 L d]: what the coders start from
    frozen = FrozenHF(model, torch.randint(1, VOCAB, (16,)), 0)
    return torch.cat([*frozen.mlp_inputs, *frozen.mlp_outputs], 1).float()


def _transcoders(model: GPT2LMHeadModel) -> list[ReLUSAE]:
    rows, coders = _rows(model), []
    torch.manual_seed(1)
    for layer in range(LAYERS):
        coder = ReLUSAE(d_in=D, n_latents=LATENTS, d_out=D, skip=layer == 0)
        inputs, outputs = rows[:, layer * D : (layer + 1) * D], rows[:, (LAYERS + layer) * D : (LAYERS + layer + 1) * D]
        coder.initialize_from(torch.cat([inputs, outputs], 1))
        if coder.skip:
            with torch.no_grad():
                coder.W_skip.normal_(std=0.2)
        coders.append(coder.eval())
    return coders


def _clt(model: GPT2LMHeadModel) -> CrossLayerTranscoder:
    torch.manual_seed(2)
    clt = CrossLayerTranscoder(partial(ReLUSAE, n_latents=LATENTS), layers=LAYERS, d_in=D, d_out=D)
    clt.initialize_from(_rows(model))
    with torch.no_grad():
        clt.coders[0].W_dec[:, D:].normal_(std=0.3)  # layer 0 writes to layer 1 too
    return clt.eval()


def _graph(kind: str) -> tuple[FrozenHF, CoderSet, Graph]:
    model = _model()
    coders = (
        CoderSet.of_transcoders([c.double() for c in _transcoders(model)], 1)
        if kind == "transcoders"
        else CoderSet.of_clt(_clt(model).double(), 1)
    )
    frozen = FrozenHF(model.double(), PROMPT, 1, coders.skip)
    return frozen, coders, attribute(frozen, coders, max_logits=5, batch_size=7)


def test_the_frozen_model_is_the_model_on_its_prompt() -> None:
    model = _model().double()
    frozen = FrozenHF(model, PROMPT)
    seen = []
    hooks = [block.ln_2.register_forward_hook(lambda _m, _i, out: seen.append(out[0])) for block in model.transformer.h]
    with torch.no_grad():
        logits = model(PROMPT[None]).logits[0]
    for hook in hooks:
        hook.remove()
    assert torch.allclose(frozen.logits, logits, atol=1e-12) and float(logits.std()) > 0.1
    for ours, theirs in zip(frozen.mlp_inputs, seen, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-12)
    with pytest.raises(ConfigError, match="reads 1 to 16"):
        FrozenHF(model, torch.zeros(17, dtype=torch.long))


def _values(frozen: FrozenHF, coders: CoderSet, graph: Graph, delta: list[torch.Tensor], emb=None) -> torch.Tensor:
    # every target's value in the frozen replacement model, features held at their activations, the MLP outputs moved
    # by `delta` (and the token embeddings replaced by `emb`): the features' pre-activations less b_enc, then the
    # logits less the mean logit
    def mlp(m: int, x: torch.Tensor) -> torch.Tensor:
        return frozen.mlp_outputs[m] + delta[m] + coders.skip(m, x) - coders.skip(m, frozen.mlp_inputs[m])

    return _read(frozen, coders, graph, frozen.embeddings if emb is None else emb, mlp)


def _read(frozen: FrozenHF, coders: CoderSet, graph: Graph, emb: torch.Tensor, mlp) -> torch.Tensor:
    with torch.no_grad():
        ins, final = frozen.run(emb[None], mlp)
        layer, pos, latent = graph.features.t()
        encoders = torch.stack([coders.encoder(int(m), latent[i : i + 1])[0] for i, m in enumerate(layer)])
        features = (torch.stack(ins)[layer, 0, pos] * encoders).sum(1)
        u = frozen.unembed
        return torch.cat([features, (u[graph.logit_tokens] - u.mean(0)) @ final[0, -1]])


def _target_rows(graph: Graph) -> torch.Tensor:
    size = len(graph.adjacency)
    return torch.cat([torch.arange(graph.n_features), torch.arange(size - len(graph.logit_tokens), size)])


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_edges_are_finite_differences_of_the_frozen_replacement_model(kind: str) -> None:
    frozen, coders, graph = _graph(kind)
    n_f, t = graph.n_features, graph.n_pos
    assert n_f > 20 and not (graph.features[:, 1] == 0).any()  # none at the BOS
    assert float(graph.error_norms.min()) > 1e-3  # GELU MLPs: every error node is there
    rows, eps = _target_rows(graph), 1e-5
    zero = [torch.zeros_like(o) for o in frozen.mlp_outputs]
    base = _values(frozen, coders, graph, zero)
    for source in [*range(0, n_f, 3), *range(n_f, n_f + (LAYERS + 1) * t)]:
        delta, emb = [z.clone() for z in zero], frozen.embeddings.clone()
        if source < n_f:  # a feature's activation moved by eps: its decoder rows move what it writes
            layer, pos, latent = graph.features[source].tolist()
            row = coders.rows(layer, torch.tensor([[latent]]))[0, 0]
            for m in coders.writes_to(layer):
                delta[m][pos] += eps * graph.activations[source] * row[(m - layer) * D : (m - layer + 1) * D]
        elif source < n_f + LAYERS * t:  # an error node scaled by 1 + eps
            layer, pos = divmod(source - n_f, t)
            delta[layer][pos] += eps * _error(frozen, coders, layer)[pos]
        else:  # a token's embedding scaled by 1 + eps
            emb[source - n_f - LAYERS * t] *= 1 + eps
        moved = _values(frozen, coders, graph, delta, emb)
        assert torch.allclose((moved - base) / eps, graph.adjacency[rows, source], rtol=1e-6, atol=1e-8), source
    # the BOS's error nodes: held constant, no edge (circuit-tracer zeroes them); the others have some
    errors = graph.adjacency[:, n_f : n_f + LAYERS * t].view(-1, LAYERS, t)
    assert not errors[:, :, 0].any() and errors[:, :, 1:].abs().sum() > 0


def _error(frozen: FrozenHF, coders: CoderSet, layer: int) -> torch.Tensor:
    # the MLP output less everything the coders write (features, skip, biases)
    codes = [coders.codes(m, frozen.mlp_inputs[m]) for m in range(LAYERS)]
    writes = coders.writes([v[None] for v, _ in codes], [coders.rows(m, i) for m, (_, i) in enumerate(codes)])
    m = frozen.mlp_inputs[layer]
    return frozen.mlp_outputs[layer] - writes[layer][0] - coders.skip(layer, m) - coders.bias(layer)


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_a_target_s_edges_and_its_constant_part_sum_to_its_value(kind: str) -> None:
    frozen, coders, graph = _graph(kind)
    # the value: on the prompt itself (the replacement's MLP outputs are the model's, error nodes included)
    value = _values(frozen, coders, graph, [torch.zeros_like(o) for o in frozen.mlp_outputs])
    # the constant part: every node at zero (no token embedding, feature or error), what the position embeddings,
    # the biases, a skip transcoder's linear map of them and the held BOS outputs give
    constant = _read(
        frozen, coders, graph, torch.zeros_like(frozen.embeddings), lambda m, x: coders.skip(m, x) + coders.bias(m)
    )
    edges = graph.adjacency[_target_rows(graph)].sum(1)
    assert torch.allclose(edges + constant, value, atol=1e-10)
    assert float((edges - value).abs().max()) > 1e-3  # the constant part is no rounding


def test_a_skip_transcoder_s_linear_path_stays_at_the_bos() -> None:
    # circuit-tracer holds the BOS's MLP outputs but for W_skip's path: layer 0's carries token 0's embedding on
    frozen, coders, graph = _graph("transcoders")
    held = attribute(FrozenHF(frozen.model, PROMPT, 1), coders, max_logits=5, batch_size=7)
    token_0 = graph.n_features + LAYERS * graph.n_pos
    assert (graph.adjacency != held.adjacency).any(0).nonzero().flatten().tolist() == [token_0]


def _tokenizer(folder: Path | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    word = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    if folder is not None:
        tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_prompt_starts_with_a_bos_and_fits_the_window() -> None:
    tokenizer = _tokenizer()
    assert prompt_tokens(tokenizer, "w7 w12 w3", 16).tolist() == [0, 7, 12, 3]
    assert prompt_tokens(tokenizer, "<|endoftext|> w7", 16).tolist() == [0, 7]  # a special token first: as it is
    with pytest.raises(ConfigError, match="the prompt is 17 tokens") as error:
        prompt_tokens(tokenizer, " ".join(["w1"] * 16), 16)
    assert "\n" not in str(error.value)


def test_the_command_reads_circuit_tracer_folders_on_a_gpt2_folder(tmp_path: Path, capsys) -> None:
    model, folders = _model(), []
    model.save_pretrained(tmp_path / "gpt2")
    _tokenizer(tmp_path / "gpt2")
    for layer, coder in enumerate(_transcoders(model)):
        hooks = (f"transformer.h.{layer}.ln_2", f"transformer.h.{layer}.mlp")
        folders.append(
            str(export(coder, "circuit_tracer", tmp_path / f"l{layer}", hooks[0], str(tmp_path / "gpt2"), hooks[1]))
        )
    out = tmp_path / "graph"
    assert main([*folders, "prompt=w7 w12 w3 w25 w7 w30 w9 w14", f"out={out}", "node_threshold=1"]) == 0
    data = json.loads((out / "graph.json").read_text())
    assert data["tokens"] == PROMPT.tolist() and data["model"] == str(tmp_path / "gpt2")
    assert data["skip_positions"] == 1 and "feature" in {node["kind"] for node in data["nodes"]}
    # the same graph as the library's, circuit-tracer's folders read back to float rounding
    frozen, coders, graph = _graph("transcoders")
    assert data["unpruned"]["features"] == graph.n_features
    assert main([*folders, "prompt=" + " ".join(["w1"] * 16)]) == 2
    assert "longer than the model's window of 16" in capsys.readouterr().err
    # circuit-tracer's folders from elsewhere: mlp.hook_in is the MLP's input; ln2.hook_normalized (TransformerLens's
    # stream before ln2's gain and bias) is not, and is refused
    for folder in folders:
        config = Path(folder) / "config.yaml"
        cfg = yaml.safe_load(config.read_text())
        assert cfg["feature_input_hook"] == "mlp.hook_in"
        config.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "runner"} | {"model_name": "gpt2"}))
        config.write_text(config.read_text().replace("mlp.hook_in", "ln2.hook_normalized"))
    assert main([*folders, "prompt=w7"]) == 2
    assert "before ln2's gain and bias" in capsys.readouterr().err
    for folder in folders:
        config = Path(folder) / "config.yaml"
        config.write_text(config.read_text().replace("ln2.hook_normalized", "mlp.hook_in"))
    assert main([*folders, "prompt=w7"]) == 2
    assert "no transformers folder nor runner run here: give source=FOLDER" in capsys.readouterr().err
    assert load_coders([Path(f) for f in folders], TRUSTED_TARGETS, source=str(tmp_path / "gpt2")).coders.n_layers == 2


def test_a_run_s_hooks_pair_each_block_s_mlp_input_and_output_of_one_model() -> None:
    def cfg(module, target):
        return OmegaConf.create({"data": {"module": module, "target": target}})

    reads, writes = ["transformer.h.0.ln_2", "transformer.h.1.ln_2"], ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert _layers(Path("run"), cfg(reads, writes)) == [0, 1]
    for module, target in (("transformer.h.0.ln_2", "blocks.0.mlp"), ("transformer.h.0.ln_1", "transformer.h.0.mlp")):
        with pytest.raises(ConfigError, match="mixed hooks"):
            _layers(Path("run"), cfg(module, target))
