"""`python -m runner.attribute RUN [RUN ...] prompt="..." [out=DIR] [node_threshold=0.8] [edge_threshold=0.98]
[max_logits=10] [logit_mass=0.95] [batch_size=64] [device=cpu]`: the attribution graph of a prompt on the replacement
model of a runner GPT (experiments/sae/circuits/): RUN is a cross-layer transcoder's run (+experiment=clt_lm), or one
transcoder's run per block (+experiment=transcoder_lm, RUN0 RUN1 ...). The prompt is text, read as bytes (the lm
preset's tokens). Nodes are pruned by influence (node_threshold of the total kept), then edges (edge_threshold), as
circuit-tracer prunes; the replacement and completeness scores are the unpruned graph's. Writes DIR/graph.json
(default: the first RUN's attribution/). Exit codes: 0, or 2 with a one-paragraph message."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.sae.circuits.attribute import attribute
from experiments.sae.circuits.frozen import FrozenGPT
from experiments.sae.circuits.load import load_coders
from experiments.sae.circuits.output import graph_data, write_graph
from experiments.sae.circuits.prune import prune, scores
from runner import ConfigError
from runner.load import trusted_here
from runner.rundir import DiskFull
from runner.rundir.outputs import output_folder, write_failed
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options

DEFAULTS: dict[str, Any] = {
    "prompt": None,
    "out": None,
    "node_threshold": 0.8,
    "edge_threshold": 0.98,
    "max_logits": 10,
    "logit_mass": 0.95,
    "batch_size": 64,
    "device": "cpu",
}
USAGE = (
    'usage: python -m runner.attribute RUN [RUN ...] prompt="..." [out=DIR] [node_threshold=0.8] '
    "[edge_threshold=0.98] [max_logits=10] [logit_mass=0.95] [batch_size=64] [device=cpu]"
)


def _options(argv: list[str]) -> tuple[list[Path], dict[str, Any]]:
    argv = key_values(argv, DEFAULTS)
    runs = [a for a in argv if "=" not in a and not a.startswith("-")]
    options = read_options([a for a in argv if a not in runs], DEFAULTS, ("prompt", "out", "device"), "")
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
    return [Path(r) for r in runs], options


def _tokens(model: torch.nn.Module, prompt: str) -> torch.Tensor:
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
    gpt, coders, meta = load_coders(runs, trusted_here(), device)
    tokens = _tokens(gpt, options["prompt"])
    start = time.perf_counter()
    frozen = FrozenGPT(gpt, tokens.to(device))
    graph = attribute(frozen, coders, options["max_logits"], options["logit_mass"], options["batch_size"])
    pruned = prune(graph, options["node_threshold"], options["edge_threshold"])
    settings = {k: options[k] for k in ("node_threshold", "edge_threshold", "max_logits", "logit_mass")}
    meta = {**meta, "prompt": options["prompt"], **settings, "seconds": round(time.perf_counter() - start, 3)}
    return graph_data(graph, pruned, scores(graph), meta)


def main(argv: list[str] | None = None) -> int:
    """Build the graph, print its size and scores and where it is written, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        runs, options = _options(argv)
        run_dir = runs[0] if runs[0].is_dir() else runs[0].parent
        out = output_folder(run_dir, options["out"] or None, "attribution", "out=")
        data = graph_of(runs, options)
        try:
            path = write_graph(out / "graph.json", data)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
