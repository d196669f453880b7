"""circuit-tracer's attribution graphs of a transformers GPT-2 with runner's exported transcoders (run in
circuit-tracer's virtualenv by tests/e2e/test_circuit_tracer_agreement.py and benchmarks/attribution_peers.py).

    python circuit_tracer_graph.py GPT2_FOLDER OUT SPECS_JSON

GPT2_FOLDER is a save_pretrained folder (model and tokenizer; nothing is downloaded). SPECS_JSON is a list of specs,
each {"name", "folders" (circuit-tracer folders: one per layer, or one CLT), "clt", "tokens" (ids, a BOS first),
"input_hook", "max_logits", "mass", "dtype" ("float64" or "float32"), "batch_size"} and optionally "repeats" (1) and
"arrays" (the names of the graph's arrays to save, ARRAYS by default: a graph of GPT-2 small's shape is a GiB of them).

For each spec: circuit-tracer's TransformerLensReplacementModel built as from_config builds it, from the folder's
weights (convert_gpt2_weights; no LayerNorm folding, no centring: the graph is of the model as saved, as
from_pretrained_and_transcoders loads it), the folders loaded by circuit-tracer's own loaders, and
circuit_tracer.attribute on the tokens. OUT/NAME gets the graph's arrays (.npy) and facts.json: the logit tokens, the
scores, the number of active features, the seconds of each attribute call (time.perf_counter around it alone), the
threads torch used and the process's peak RSS so far (MiB).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from circuit_tracer import attribute
from circuit_tracer.graph import compute_graph_scores
from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
from transformer_lens import HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

ARRAYS = ("adjacency_matrix", "active_features", "activation_values", "logit_probabilities", "input_tokens")


def tokenizer_of(folder: Path) -> PreTrainedTokenizerFast:
    """The folder's tokenizer.json with its BOS and EOS."""
    # runner's transformers (5) names the tokenizer class TokenizersBackend, which this one lacks; the file is the same
    special = json.loads((folder / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token=special["bos_token"], eos_token=special["eos_token"]
    )


def replacement_model(hf: GPT2LMHeadModel, tokenizer: object, spec: dict, dtype: torch.dtype) -> object:
    """circuit-tracer's replacement model of `hf` in `dtype` with the spec's folders as its transcoders."""
    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer,
        n_ctx=c.n_positions,
        eps=c.layer_norm_epsilon,
        d_vocab=c.vocab_size,
        act_fn=c.activation_function,
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
        model_name="tiny-gpt2",
        dtype=dtype,
        device="cpu",
    )
    hooks = dict(feature_input_hook=spec["input_hook"], feature_output_hook="hook_mlp_out")
    if spec["clt"]:
        coders = load_clt(spec["folders"][0], dtype=dtype, device="cpu", lazy_decoder=False, **hooks)
    else:
        paths = {i: str(Path(f) / f"layer_{i}.safetensors") for i, f in enumerate(spec["folders"])}
        coders = load_transcoder_set(
            paths,
            scan="runner",
            dtype=dtype,
            device=torch.device("cpu"),
            lazy_encoder=False,
            lazy_decoder=False,
            **hooks,
        )
    # from_config's steps, GPT-2's weights loaded as they are before the MLPs are wrapped; the tokenizer as given
    # (TransformerLens would load another by its name)
    model = TransformerLensReplacementModel(cfg)
    model.tokenizer = tokenizer
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf.to(dtype), cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    model._configure_replacement_model(coders)
    return model


def main() -> None:
    """Each spec's graph and facts under OUT/NAME."""
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    # the folder holds float32 weights: .to(float64) and back is exact, so one load serves every spec's dtype
    hf, tokenizer = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval(), tokenizer_of(folder)
    for spec in json.loads(sys.argv[3]):
        dtype = getattr(torch, spec["dtype"])
        torch.set_default_dtype(dtype)  # attribute makes its adjacency matrix in the default dtype
        model, tokens = replacement_model(hf, tokenizer, spec, dtype), torch.tensor(spec["tokens"])
        seconds = []
        for _ in range(spec.get("repeats", 1)):
            start = time.perf_counter()
            graph = attribute(
                tokens,
                model,
                max_n_logits=spec["max_logits"],
                desired_logit_prob=spec["mass"],
                batch_size=spec["batch_size"],
            )
            seconds.append(time.perf_counter() - start)
        where = out / spec["name"]
        where.mkdir()
        for name in spec.get("arrays", ARRAYS):
            np.save(where / f"{name}.npy", getattr(graph, name).numpy())
        facts = {
            "logit_tokens": [t.vocab_idx for t in graph.logit_targets],
            "scores": compute_graph_scores(graph),
            "n_features": len(graph.active_features),
            "seconds": seconds,
            "threads": torch.get_num_threads(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        (where / "facts.json").write_text(json.dumps(facts))
        del graph, model


if __name__ == "__main__":
    main()
