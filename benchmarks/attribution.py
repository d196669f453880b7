"""The attribution graph of a prompt (experiments/sae/circuits/): seconds and peak memory.

    python benchmarks/attribution.py [RUN ...] [--tokens 32] [--batch-size 64] [--threads 2] [--repeats 2]
    python benchmarks/attribution.py --gpt2-small [--tokens 16] [--latents 24576] [--k 64] [--repeats 1]

With RUN (a clt_lm run, or one transcoder_lm run per block), its coders and the GPT it read; without, the lm preset's
GPT (+experiment=lm defaults: 6 blocks, d_model 128, window 128) and a CLT over all its layers with clt_lm's coders
(TopK, 2048 latents a layer, k = 32), both at their initialisation: the cost depends on the shapes and on k (every
position has k active features a layer), not on what the weights learnt. With --gpt2-small: a transformers
GPT2LMHeadModel of GPT-2 small's shape (12 blocks, d 768, vocab 50257) at its initialisation, one TopK transcoder
per block (--latents, --k) at its own, and --tokens random tokens after the BOS (circuit-tracer's prompt). Prints
the seconds of the graph (the frozen forward, one backward pass per target in batches), of pruning and scores, and
the peak RSS of the process.
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from experiments.lm.model import GPT  # noqa: E402
from experiments.sae.circuits.attribute import attribute  # noqa: E402
from experiments.sae.circuits.coders import CoderSet  # noqa: E402
from experiments.sae.circuits.frozen import FrozenGPT  # noqa: E402
from experiments.sae.circuits.frozen_hf import FrozenHF  # noqa: E402
from experiments.sae.circuits.load import load_coders  # noqa: E402
from experiments.sae.circuits.prune import prune, scores  # noqa: E402
from experiments.sae.coders.activations import TopKSAE  # noqa: E402
from experiments.sae.coders.clt import CrossLayerTranscoder  # noqa: E402
from runner.load import trusted_here  # noqa: E402

TEXT = b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"


def preset() -> tuple[GPT, CoderSet]:
    """The lm preset's GPT and a CLT over its 6 layers (clt_lm's coders), at their initialisation."""
    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, seq_len=128, n_layer=6, n_head=4, d_model=128).eval()
    coder = functools.partial(TopKSAE, n_latents=2048, k=32, tied_init=False, encoder_init=0.5)
    clt = CrossLayerTranscoder(coder, layers=6, d_in=128, d_out=128).eval()
    return gpt, CoderSet.of_clt(clt, skip_positions=1)


def gpt2_small(latents: int, k: int) -> tuple[torch.nn.Module, CoderSet]:
    """GPT-2 small's shape (transformers, random weights) and a TopK transcoder per block, at their initialisation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    coder = functools.partial(TopKSAE, d_in=768, n_latents=latents, k=k, d_out=768, tied_init=False)
    return model, CoderSet.of_transcoders([coder().eval() for _ in model.transformer.h], skip_positions=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--tokens", type=int, default=None, help="32; with --gpt2-small 16 (after the BOS)")
    parser.add_argument("--gpt2-small", action="store_true")
    parser.add_argument("--latents", type=int, default=24576)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.gpt2_small:
        gpt, coders = gpt2_small(args.latents, args.k)
        n = args.tokens or 16
        tokens = torch.cat(
            [torch.tensor([50256]), torch.randint(0, 50256, (n,), generator=torch.Generator().manual_seed(0))]
        )
        frozen = lambda: FrozenHF(gpt, tokens, coders.skip_positions, coders.skip)  # noqa: E731
    else:
        gpt, coders = load_coders(args.runs, trusted_here())[:2] if args.runs else preset()
        tokens = torch.tensor(list((TEXT * 4)[: args.tokens or 32]))
        frozen = lambda: FrozenGPT(gpt, tokens)  # noqa: E731
    for repeat in range(args.repeats):
        start = time.perf_counter()
        graph = attribute(frozen(), coders, batch_size=args.batch_size)
        built = time.perf_counter()
        pruned = prune(graph)
        replacement, completeness = scores(graph)
        done = time.perf_counter()
        print(
            f"repeat {repeat}: {len(tokens)} tokens, {graph.n_features} features, {len(graph.adjacency)} nodes: graph "
            f"{built - start:.2f} s, pruning and scores {done - built:.2f} s, total {done - start:.2f} s; kept "
            f"{int(pruned.nodes.sum())} nodes, {int(pruned.edges.sum())} edges; replacement {replacement:.3f}, "
            f"completeness {completeness:.3f}"
        )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, threads {args.threads}")


if __name__ == "__main__":
    main()
