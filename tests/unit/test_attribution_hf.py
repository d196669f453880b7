"""Attribution graphs on transformers models (experiments/sae/circuits/frozen_hf.py, hf_blocks.py), each test for
every architecture read (GPT-2; Llama: RMSNorm, rotary, grouped-query attention, a gated MLP, its unembedding untied
or tied; GPT-NeoX: partial rotary, with and without the parallel residual): the frozen model's logits, MLP inputs and
outputs are the model's on its prompt (to 1e-10 in float64, Llama's RMSNorm kept in float64; to 1e-5 in float32,
under eager and sdpa attention); another architecture is refused in one paragraph. On a tiny random model (GELU or
SiLU MLPs, which no transcoder reproduces exactly) with random transcoders (layer 0's a skip transcoder, whose linear
path stays at the BOS) or a CLT, every edge is a finite difference of the frozen replacement model with its error
nodes, and a target's incoming edges plus its constant part (what the position embeddings, biases and held position 0
give with every node at zero) sum to its value; position 0 (the BOS) has no feature and its error nodes no edge. A
prompt is tokenized after a BOS and refused past the model's window; the command reads circuit-tracer folders on a
saved model folder (at mlp.hook_in; ln2.hook_normalized is refused); a run's hooks pair each block's MLP input norm
and MLP of one architecture."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from experiments.sae.circuits.attribute import Graph, attribute  # noqa: E402
from experiments.sae.circuits.cli import main  # noqa: E402
from experiments.sae.circuits.coders import CoderSet  # noqa: E402
from experiments.sae.circuits.frozen_hf import FrozenHF, prompt_tokens  # noqa: E402
from experiments.sae.circuits.hf_blocks import LAYOUTS  # noqa: E402
from experiments.sae.circuits.load import _layers, load_coders  # noqa: E402
from experiments.sae.coders.activations import ReLUSAE  # noqa: E402
from experiments.sae.coders.clt import CrossLayerTranscoder  # noqa: E402
from experiments.sae.formats import export  # noqa: E402
from runner import ConfigError  # noqa: E402
from runner.load import TRUSTED_TARGETS  # noqa: E402

D, LATENTS, LAYERS, VOCAB = 16, 32, 2, 40
PROMPT = torch.tensor([0, 7, 12, 3, 25, 7, 30, 9, 14])  # 0: the BOS
IDS = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
SHAPE = {"hidden_size": D, "num_hidden_layers": LAYERS, "intermediate_size": 2 * D, "max_position_embeddings": 16}
CONFIGS = {
    "gpt2": lambda: GPT2Config(n_layer=LAYERS, n_embd=D, n_head=2, n_positions=16, **IDS),
    # 4 query heads on 2 key-value heads (head_dim 4), untied or tied unembedding
    "llama": lambda: LlamaConfig(**SHAPE, num_attention_heads=4, num_key_value_heads=2, **IDS),
    "llama_tied": lambda: LlamaConfig(
        **SHAPE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **IDS
    ),
    # Pythia's partial rotary (a quarter of each head's 8 dims turn) with its parallel residual, and without it
    "gpt_neox": lambda: GPTNeoXConfig(**SHAPE, num_attention_heads=2, **IDS),
    "gpt_neox_serial": lambda: GPTNeoXConfig(**SHAPE, num_attention_heads=2, use_parallel_residual=False, **IDS),
}
ARCHS = ["gpt2", "llama", "gpt_neox", "gpt_neox_serial"]  # what the graph tests run on


def _model(arch: str = "gpt2", attention: str = "sdpa") -> PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    config.initializer_range = 0.3  # patterns far from uniform, MLPs far from linear
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def _rows(model: PreTrainedModel) -> torch.Tensor:
    # every layer's MLP inputs then outputs on random prompts, [rows, 2 L d]: what the coders start from
    frozen = FrozenHF(model, torch.randint(1, VOCAB, (16,)), 0)
    return torch.cat([*frozen.mlp_inputs, *frozen.mlp_outputs], 1).float()


def _transcoders(model: PreTrainedModel) -> list[ReLUSAE]:
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


def _clt(model: PreTrainedModel) -> CrossLayerTranscoder:
    torch.manual_seed(2)
    clt = CrossLayerTranscoder(partial(ReLUSAE, n_latents=LATENTS), layers=LAYERS, d_in=D, d_out=D)
    clt.initialize_from(_rows(model))
    with torch.no_grad():
        clt.coders[0].W_dec[:, D:].normal_(std=0.3)  # layer 0 writes to layer 1 too
    return clt.eval()


def _graph(kind: str, arch: str = "gpt2") -> tuple[FrozenHF, CoderSet, Graph]:
    model = _model(arch)
    coders = (
        CoderSet.of_transcoders([c.double() for c in _transcoders(model)], 1)
        if kind == "transcoders"
        else CoderSet.of_clt(_clt(model).double(), 1)
    )
    frozen = FrozenHF(model.double(), PROMPT, 1, coders.skip)
    return frozen, coders, attribute(frozen, coders, max_logits=5, batch_size=7)


def _rms_in_its_dtype(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm without its trip through float32 (made for half-precision models), which rounds a float64 stream
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _true_run(model: PreTrainedModel) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    # the model's own logits on the prompt, and every block's MLP input and output as hooks on its MLP see them
    layout, ins, outs = LAYOUTS[type(model).__name__], [], []
    blocks = model.get_submodule(f"{layout.base}.{layout.blocks}")

    def seen(_module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        ins.append(args[0][0])
        outs.append(out[0])

    hooks = [block.mlp.register_forward_hook(seen) for block in blocks]
    with torch.no_grad():
        logits = model(PROMPT[None]).logits[0]
    for hook in hooks:
        hook.remove()
    return logits, ins, outs


@pytest.mark.parametrize("arch", [*ARCHS, "llama_tied"])
def test_the_frozen_model_is_the_model_on_its_prompt(arch: str, monkeypatch) -> None:
    for attention in ("eager", "sdpa"):  # float32, as load.py loads a model: its attention either way
        model = _model(arch, attention)
        logits, _, _ = _true_run(model)
        assert float((FrozenHF(model, PROMPT).logits - logits).abs().max()) < 1e-5
    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_in_its_dtype)
    model = _model(arch).double()
    frozen = FrozenHF(model, PROMPT)
    logits, ins, outs = _true_run(model)
    assert float((frozen.logits - logits).abs().max()) < 1e-10 and float(logits.std()) > 0.1
    for ours, theirs in zip([*frozen.mlp_inputs, *frozen.mlp_outputs], [*ins, *outs], strict=True):
        assert float((ours - theirs).abs().max()) < 1e-10
    with pytest.raises(ConfigError, match="reads 1 to 16"):
        FrozenHF(model, torch.zeros(17, dtype=torch.long))


def test_another_architecture_is_refused_in_one_paragraph() -> None:
    shape = {**SHAPE, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB}
    mistral = AutoModelForCausalLM.from_config(MistralConfig(**shape))  # Llama's shape, but a sliding window
    with pytest.raises(ConfigError, match="MistralForCausalLM: attribution graphs read runner's GPT") as error:
        FrozenHF(mistral, PROMPT)
    assert "\n" not in str(error.value)
    for name in ("GPT2LMHeadModel (LayerNorm", "LlamaForCausalLM (RMSNorm", "GPTNeoXForCausalLM (Pythia"):
        assert name in str(error.value)


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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_edges_are_finite_differences_of_the_frozen_replacement_model(kind: str, arch: str) -> None:
    frozen, coders, graph = _graph(kind, arch)
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_a_target_s_edges_and_its_constant_part_sum_to_its_value(kind: str, arch: str) -> None:
    frozen, coders, graph = _graph(kind, arch)
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


@pytest.mark.parametrize("arch", ARCHS)
def test_a_skip_transcoder_s_linear_path_stays_at_the_bos(arch: str) -> None:
    # circuit-tracer holds the BOS's MLP outputs but for W_skip's path: layer 0's carries token 0's embedding on
    frozen, coders, graph = _graph("transcoders", arch)
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


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_the_command_reads_circuit_tracer_folders_on_a_model_folder(arch: str, tmp_path: Path, capsys) -> None:
    model, folders = _model(arch), []
    layout = LAYOUTS[type(model).__name__]
    model.save_pretrained(tmp_path / "model")
    _tokenizer(tmp_path / "model")
    for layer, coder in enumerate(_transcoders(model)):
        block = f"{layout.base}.{layout.blocks}.{layer}"
        hooks = (f"{block}.{layout.mlp_norm}", f"{block}.mlp")  # as a run on that model names them
        folders.append(
            str(export(coder, "circuit_tracer", tmp_path / f"l{layer}", hooks[0], str(tmp_path / "model"), hooks[1]))
        )
    out = tmp_path / "graph"
    assert main([*folders, "prompt=w7 w12 w3 w25 w7 w30 w9 w14", f"out={out}", "node_threshold=1"]) == 0
    data = json.loads((out / "graph.json").read_text())
    assert data["tokens"] == PROMPT.tolist() and data["model"] == str(tmp_path / "model")
    assert data["skip_positions"] == 1 and "feature" in {node["kind"] for node in data["nodes"]}
    # the same graph as the library's, circuit-tracer's folders read back to float rounding
    frozen, coders, graph = _graph("transcoders", arch)
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
    assert load_coders([Path(f) for f in folders], TRUSTED_TARGETS, source=str(tmp_path / "model")).coders.n_layers == 2


def test_a_run_s_hooks_pair_each_block_s_mlp_input_and_output_of_one_model() -> None:
    def cfg(module, target):
        return OmegaConf.create({"data": {"module": module, "target": target}})

    reads, writes = ["transformer.h.0.ln_2", "transformer.h.1.ln_2"], ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert _layers(Path("run"), cfg(reads, writes)) == [0, 1]
    for module, target in (("transformer.h.0.ln_2", "blocks.0.mlp"), ("transformer.h.0.ln_1", "transformer.h.0.mlp")):
        with pytest.raises(ConfigError, match="mixed hooks"):
            _layers(Path("run"), cfg(module, target))


def test_sae_eval_s_replacement_scores_are_the_graph_s_of_runner_attribute() -> None:
    # both freeze the prompt as one function does: a skip transcoder's path at the BOS kept in sae_eval's graphs too
    from experiments.sae.circuits.frozen_hf import freeze
    from experiments.sae.circuits.prune import scores
    from experiments.sae.evals.replacement import Circuits, graph_scores

    frozen, coders, _ = _graph("transcoders")
    graph = attribute(freeze(frozen.model, PROMPT, coders, transformers=True), coders, max_logits=5, batch_size=7)
    circuits = Circuits(frozen.model, coders, {}, tokenizer=object(), max_logits=5, batch_size=7)
    got = graph_scores(circuits, PROMPT[None])["per_prompt"][0]
    assert (got["replacement"], got["completeness"]) == scores(graph)
    held = attribute(FrozenHF(frozen.model, PROMPT, 1), coders, max_logits=5, batch_size=7)
    assert scores(held) != scores(graph)  # the skip path at the BOS moves the scores: what the shared freeze keeps
