"""runner's attribution graph against circuit-tracer 0.5.0's, on one transformers GPT-2, the same transcoders and the
same tokens: seconds, features and peak RSS of each.

    python benchmarks/attribution_peers.py [--small] [--layers 12] [--d-model 768] [--heads 12] [--latents 24576]
        [--k 64] [--tokens 16] [--batch-size 64] [--threads 2] [--repeats 2] [--circuit-tracer-python PATH]

The model is a GPT2LMHeadModel of the given shape (GPT-2 small's by default; vocab 50257) at its initialisation,
saved by save_pretrained with a word-level tokenizer built here (no download). Each block gets a TopK transcoder
(runner's TopKSAE, d_out = d; its scales and biases from initialize_from on the model's MLP rows of random tokens),
exported by runner's circuit_tracer export, which writes a TopK as a JumpReLU calibrated to its mean L0 on held-out
rows (another draw of random tokens). Both sides read the same exported folders as circuit-tracer reads them: the
JumpReLU at its written threshold (runner's own reader, load_coders, gives a per-layer TopK back its exact top-k,
which would be another graph). The tokens are --tokens random ids after the BOS (50256).

runner: transformers_model (load.py) and the layer files loaded once in this process; FrozenHF + attribute timed,
float32. circuit-tracer: benchmarks/peers/circuit_tracer_graph.py in its virtualenv (.venv-circuit-tracer, or
--circuit-tracer-python), a fresh process each round, which times circuit_tracer.attribute alone on its
TransformerLensReplacementModel, float32. Same batch size (targets per backward pass), max logits 10 and logit mass
0.95, threads and OpenMP wait policy on both. --repeats rounds of one graph a side, interleaved (a change in the
machine's load falls on both); the medians are compared. The model and folders are made in a child process first, so
that each side's peak RSS is its own imports, load and attribution (and scores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# both sides under one OpenMP wait policy, read when torch loads OpenMP: PASSIVE unless the caller sets one, as
# benchmarks/common.py runs its contenders (runner's tools would otherwise choose by the load at their start)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.sae.circuits.attribute import attribute  # noqa: E402
from experiments.sae.circuits.coders import CoderSet  # noqa: E402
from experiments.sae.circuits.frozen_hf import FrozenHF  # noqa: E402
from experiments.sae.circuits.load import transformers_model  # noqa: E402
from experiments.sae.circuits.prune import scores  # noqa: E402
from experiments.sae.formats import circuit_tracer as ct  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "benchmarks" / "peers" / "circuit_tracer_graph.py"
VOCAB, BOS = 50257, 50256  # GPT-2's: <|endoftext|> is the last id
SMALL = {"layers": 4, "d_model": 256, "heads": 4, "latents": 4096}
MAX_LOGITS, MASS = 10, 0.95
WINDOWS, WINDOW = 8, 128  # random-token windows for initialize_from, and as many again held out for calibration


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of VOCAB ids (BOS = EOS = <|endoftext|>, the last), saved into `folder`."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": BOS}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    PreTrainedTokenizerFast(tokenizer_object=words, **special).save_pretrained(folder)


@torch.no_grad()
def mlp_rows(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    """Each block's [MLP input | MLP output] rows on WINDOWS windows of random tokens after a BOS (the BOS's left out,
    as the graph leaves position 0 out)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((WINDOWS, 1), BOS), torch.randint(0, BOS, (WINDOWS, WINDOW - 1), generator=g)], 1)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.transformer.h):
        for part in ("ln_2", "mlp"):
            store = lambda _m, _in, out, key=f"{part}{i}": seen.__setitem__(key, out[:, 1:].flatten(0, 1))  # noqa: E731
            hooks.append(getattr(block, part).register_forward_hook(store))
    model.transformer(input_ids=ids)  # no logits: the rows are all it needs
    for hook in hooks:
        hook.remove()
    return [torch.cat([seen[f"ln_2{i}"], seen[f"mlp{i}"]], 1) for i in range(len(model.transformer.h))]


def prepare(args: argparse.Namespace, tmp: Path) -> None:
    """The model folder (tmp/gpt2) and one exported circuit-tracer folder per block (tmp/layerN)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from experiments.sae.coders.activations import TopKSAE
    from experiments.sae.formats import export

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, vocab_size=VOCAB)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp / "gpt2")
    save_tokenizer(tmp / "gpt2")
    fit, held = mlp_rows(model, 1), mlp_rows(model, 2)
    for layer in range(args.layers):
        d = args.d_model
        coder = TopKSAE(d_in=d, n_latents=args.latents, k=args.k, d_out=d, tied_init=False)
        coder.initialize_from(fit[layer])
        hooks = (f"transformer.h.{layer}.ln_2", f"transformer.h.{layer}.mlp")
        export(
            coder.eval(), "circuit_tracer", tmp / f"layer{layer}", hooks[0], str(tmp / "gpt2"), hooks[1], held[layer]
        )


class Ours:
    """runner's side: the model and the folders' coders loaded once in this process, a graph timed per call."""

    def __init__(self, tmp: Path, layers: int) -> None:
        self.model, _ = transformers_model(str(tmp / "gpt2"))
        # the layer files as circuit-tracer reads them: without runner's mapping, a calibrated TopK is its JumpReLU
        read = [
            ct.read_layer(tmp / f"layer{i}" / ct.LAYER_FILE.format(i=i), {}).eval().requires_grad_(False)
            for i in range(layers)
        ]
        self.coders = CoderSet.of_transcoders(read, skip_positions=1)

    def graph(self, tokens: torch.Tensor, batch_size: int) -> dict:
        """The seconds of FrozenHF + attribute on `tokens`, and the graph's features and scores."""
        start = time.perf_counter()
        frozen = FrozenHF(self.model, tokens, self.coders.skip_positions, self.coders.skip)
        graph = attribute(frozen, self.coders, MAX_LOGITS, MASS, batch_size)
        seconds = time.perf_counter() - start
        return {
            "seconds": [seconds],
            "n_features": graph.n_features,
            "features": graph.features,
            "nodes": len(graph.adjacency),
            "scores": scores(graph),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def theirs(tmp: Path, tokens: torch.Tensor, args: argparse.Namespace, name: str) -> dict:
    """circuit-tracer's graph of the same folders, one attribute call in a fresh process of the peer script: its
    facts and active features."""
    folders = [str(tmp / f"layer{i}") for i in range(args.layers)]
    spec = {"name": name, "folders": folders, "clt": False, "tokens": tokens.tolist(), "input_hook": ct.INPUT_HOOK}
    spec |= {"max_logits": MAX_LOGITS, "mass": MASS, "dtype": "float32", "batch_size": args.batch_size}
    spec |= {"arrays": ["active_features"]}
    out = tmp / "theirs"
    out.mkdir(exist_ok=True)
    threads = {key: str(args.threads) for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(
        [args.circuit_tracer_python, str(PEER), str(tmp / "gpt2"), str(out), json.dumps([spec])],
        capture_output=True,
        text=True,
        env=os.environ | threads,
    )
    if done.returncode != 0:
        raise SystemExit(f"circuit-tracer's run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    facts = json.loads((out / name / "facts.json").read_text())
    return facts | {"features": torch.from_numpy(np.load(out / name / "active_features.npy"))}


def merged(runs: list[dict]) -> dict:
    """The rounds of one side as one: every round's seconds, the peak RSS of its largest process, the last graph."""
    return runs[-1] | {
        "seconds": [s for r in runs for s in r["seconds"]],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
    }


def main() -> None:
    """Make the model and folders, time both sides' graphs in interleaved rounds, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="4 layers, d 256, 4 heads, 4096 latents")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--latents", type=int, default=24576)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16, help="random tokens after the BOS")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--circuit-tracer-python", default=str(ROOT / ".venv-circuit-tracer" / "bin" / "python"))
    args = parser.parse_args()
    if args.small:
        vars(args).update(SMALL)
    if not Path(args.circuit_tracer_python).exists():
        raise SystemExit(f"no {args.circuit_tracer_python}: benchmarks/peers/install.sh makes .venv-circuit-tracer")
    torch.set_num_threads(args.threads)
    tokens = torch.cat(
        [torch.tensor([BOS]), torch.randint(0, BOS, (args.tokens,), generator=torch.Generator().manual_seed(0))]
    )
    with tempfile.TemporaryDirectory(prefix="attribution_peers_") as name:
        tmp = Path(name)
        start = time.perf_counter()
        child = multiprocessing.get_context("spawn").Process(target=prepare, args=(args, tmp))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"making the model and folders failed ({child.exitcode})")
        print(f"model and {args.layers} exported transcoders made in {time.perf_counter() - start:.1f} s")
        ours, mine, peer = Ours(tmp, args.layers), [], []
        for i in range(args.repeats):
            peer.append(theirs(tmp, tokens, args, f"graph{i}"))
            mine.append(ours.graph(tokens, args.batch_size))
        mine, peer = merged(mine), merged(peer)
    print(
        f"GPT-2 {args.layers} layers, d {args.d_model}, {args.heads} heads, vocab {VOCAB}; a TopK transcoder a block "
        f"({args.latents} latents, k {args.k}) as circuit-tracer's calibrated JumpReLU; {len(tokens)} tokens (BOS "
        f"first); batch {args.batch_size}, max logits {MAX_LOGITS}, mass {MASS}; float32, {args.threads} threads "
        f"(circuit-tracer's: {peer['threads']}), OMP_WAIT_POLICY {os.environ['OMP_WAIT_POLICY']}"
    )
    for who, got in (("runner", mine), ("circuit-tracer", peer)):
        each = ", ".join(f"{s:.2f}" for s in got["seconds"])
        print(
            f"{who:>14}: median {statistics.median(got['seconds']):.2f} s ({each}); {got['n_features']} features; "
            f"replacement {got['scores'][0]:.4f}, completeness {got['scores'][1]:.4f}; peak RSS "
            f"{got['peak_rss_mib']:.0f} MiB"
        )
    ratio = statistics.median(peer["seconds"]) / statistics.median(mine["seconds"])
    print(f"circuit-tracer / runner: {ratio:.2f}x the seconds of a graph")
    same = peer["features"].shape == mine["features"].shape and torch.equal(peer["features"], mine["features"])
    print(f"active features (layer, position, latent): {'identical' if same else 'DIFFERENT'}; {mine['nodes']} nodes")
    assert mine["n_features"] == peer["n_features"], (mine["n_features"], peer["n_features"])


if __name__ == "__main__":
    main()
