"""`python -m runner.attribute RUN [RUN ...] prompt="..." [out=DIR] [node_threshold=0.8] [edge_threshold=0.98]
[max_logits=10] [logit_mass=0.95] [batch_size=64] [device=cpu] [source=MODEL] [--serve] [port=8000]`: the
attribution graph of a prompt on a replacement model (experiments/sae/circuits/). RUN is a cross-layer transcoder's
run (+experiment=clt_lm), one transcoder's run per block (+experiment=transcoder_lm, RUN0 RUN1 ...), or
circuit-tracer's folder (a CLT, or a transcoder set's layer_N files), on runner's GPT or a transformers GPT-2, Llama
or GPT-NeoX (source=: the model's folder, where a circuit-tracer folder names none here). The prompt is text: bytes
for runner's byte-level GPT, the tokenizer's tokens after a BOS for a transformers model. Nodes are pruned by influence
(node_threshold of the total kept), then edges (edge_threshold), as circuit-tracer prunes; the replacement and
completeness scores are the unpruned graph's. Writes DIR/graph.json and DIR/index.html, the graph's page (default
DIR: the first RUN's attribution/): open it from disk, or `--serve` it to this machine's browser with the run's
feature pages it links (runner.tools.features.PagesHandler: localhost only, no listing, nothing else of the run).
Exit codes: 0, or 2 with a one-paragraph message."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.sae.circuits.attribute import attribute
from experiments.sae.circuits.frozen_hf import freeze, model_window, prompt_tokens
from experiments.sae.circuits.load import load_coders
from experiments.sae.circuits.output import graph_data, write_graph
from experiments.sae.circuits.page import served_root, write_page
from experiments.sae.circuits.prune import prune, scores
from runner import ConfigError
from runner.load import trusted_here
from runner.rundir import DiskFull
from runner.rundir.outputs import output_folder, write_failed
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options
from runner.tools.features import serve as serve_pages

DEFAULTS: dict[str, Any] = {
    "prompt": None,
    "out": None,
    "node_threshold": 0.8,
    "edge_threshold": 0.98,
    "max_logits": 10,
    "logit_mass": 0.95,
    "batch_size": 64,
    "device": "cpu",
    "source": None,
    "port": 8000,
}
USAGE = (
    'usage: python -m runner.attribute RUN [RUN ...] prompt="..." [out=DIR] [node_threshold=0.8] '
    "[edge_threshold=0.98] [max_logits=10] [logit_mass=0.95] [batch_size=64] [device=cpu] [source=MODEL] [--serve] "
    "[port=8000]"
)


def _options(argv: list[str]) -> tuple[list[Path], dict[str, Any], bool]:
    argv = key_values(argv, DEFAULTS, ("--serve",))
    serve = "--serve" in argv
    argv = [a for a in argv if a != "--serve"]
    runs = [a for a in argv if "=" not in a and not a.startswith("-")]
    text = ("prompt", "out", "device", "source")
    options = read_options([a for a in argv if a not in runs], DEFAULTS, text, ", or --serve")
    if not runs:
        raise ConfigError(USAGE)
    if not options["prompt"]:
        raise ConfigError('prompt= is empty: give the text to attribute, e.g. prompt="def main("')
    for key in ("node_threshold", "edge_threshold", "logit_mass"):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"{key}={value!r}: give a fraction from 0 to 1")
    for key in ("max_logits", "batch_size"):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: give a whole number >= 1")
    port = options["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"port={port!r}: give a port from 1 to 65535, e.g. port=8000")
    return [Path(r) for r in runs], options, serve


def _tokens(model: torch.nn.Module, prompt: str, tokenizer: Any = None) -> torch.Tensor:
    if tokenizer is not None:  # a transformers model: its own tokens, after its BOS as circuit-tracer reads a prompt
        return prompt_tokens(tokenizer, prompt, model_window(model))
    vocab, window = getattr(model, "vocab_size", None), getattr(model, "seq_len", None)
    if vocab != 256:
        raise ConfigError(f"the model's vocab_size is {vocab}, not bytes: a prompt is read as bytes (the lm preset)")
    ids = list(prompt.encode())
    if len(ids) > window:
        raise ConfigError(f"the prompt is {len(ids)} bytes, longer than the model's window of {window} tokens")
    return torch.tensor(ids)


def graph_of(runs: list[Path], options: dict[str, Any]) -> dict[str, Any]:
    """The pruned graph's data for `runs` and a prompt, with the options of the command."""
    device = checked_device(options["device"])
    model, coders, meta, tokenizer = load_coders(runs, trusted_here(), device, options.get("source"))
    tokens = _tokens(model, options["prompt"], tokenizer).to(device)
    start = time.perf_counter()
    # a transformers model's first positions (its BOS), which its coders skip, are constants of its graph
    frozen = freeze(model, tokens, coders, transformers=tokenizer is not None)
    graph = attribute(frozen, coders, options["max_logits"], options["logit_mass"], options["batch_size"])
    pruned = prune(graph, options["node_threshold"], options["edge_threshold"])
    settings = {k: options[k] for k in ("node_threshold", "edge_threshold", "max_logits", "logit_mass")}
    meta = {**meta, "prompt": options["prompt"], **settings, "seconds": round(time.perf_counter() - start, 3)}
    data = graph_data(graph, pruned, scores(graph), meta)
    if tokenizer is not None:  # the page's labels: each token's text (a byte-level GPT's are the prompt's bytes)
        data["token_text"] = [tokenizer.decode([t]) for t in graph.tokens]
        for node in data["nodes"]:
            if node["kind"] == "logit":
                node["text"] = tokenizer.decode([node["token"]])
    return data


def main(argv: list[str] | None = None) -> int:
    """Build the graph, print its size and scores and where it is written, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        runs, options, serve = _options(argv)
        run_dir = runs[0] if runs[0].is_dir() else runs[0].parent
        out = output_folder(run_dir, options["out"] or None, "attribution", "out=")
        data = graph_of(runs, options)
        try:
            path = write_graph(out / "graph.json", data)
            page = write_page(out, data)
        except (OSError, DiskFull) as error:
            raise write_failed(error, f"writing the graph to {out}", "run the same command again") from None
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    score = data["scores"]
    print(
        f"{len(data['nodes'])} nodes, {len(data['edges'])} edges (of {data['unpruned']['nodes']} nodes); replacement "
        f"score {score['replacement']:.4f}, completeness {score['completeness']:.4f}; {data['seconds']} s"
    )
    print(f"wrote {path}")
    print(f"wrote {page}")
    if not serve:
        return 0
    root = served_root(out, data)
    only = (out.resolve().relative_to(root.resolve()).as_posix(), "features") if root != out else ()
    return serve_pages(root, options["port"], page, only)


if __name__ == "__main__":
    sys.exit(main())
