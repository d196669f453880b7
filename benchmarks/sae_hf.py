"""A transformers model as an SAE's source: GPT-2 small's shape (124M parameters, random weights: no download; a
forward costs what the trained one's does), hooked after block `--layer` (transformer.h.8), windows of `--context`
tokens that start with BOS (<|endoftext|>), read from a tokens file as +experiment=sae_hf reads it.

    python benchmarks/sae_hf.py [--windows 128] [--batch 32] [--context 128] [--layer 8] [--device cpu|cuda]
                                [--threads 2] [--dtype float32|bfloat16] [--json out.json]

Prints activations (positions) per second through experiments.sae.sources.source.SourceModel (its hook, the
special-token mask, the forward stopped after the hooked block) beside a hand-written loop of the same model over the
same windows: `model(input_ids, output_hidden_states=True).hidden_states[layer + 1]`, what a user writes with
transformers alone (every block and the head run). And what a GPU must hold for the model with a 16x TopK SAE (GPT-2
small: 12,288 latents).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import default_device, device_name, synchronize  # noqa: E402

VOCAB, BOS = 50257, 50256


def make_gpt2(folder: Path, n_layer: int = 12, n_embd: int = 768) -> Path:
    """GPT-2's config (small's by default) with random weights and a word-level tokenizer of its vocabulary size,
    saved as a user's model folder is."""
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64))).save_pretrained(folder)
    words = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": BOS}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    ).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=128, help="windows timed (after one warm-up batch)")
    parser.add_argument("--batch", type=int, default=32, help="windows per forward (source.inputs.batch_size)")
    parser.add_argument("--context", type=int, default=128, help="tokens per window, BOS included")
    parser.add_argument("--layer", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=12, help="the model's blocks (GPT-2 small's 12)")
    parser.add_argument("--n-embd", type=int, default=768, help="its width (GPT-2 small's 768)")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="float32", help="the source's weights (source.inputs.torch_dtype)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from experiments.sae.sources.source import SourceModel

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_gpt2(Path(tmp) / "gpt2", args.n_layer, args.n_embd)
        tokens = Path(tmp) / "ids.npy"
        np.save(tokens, np.random.default_rng(0).integers(0, VOCAB - 1, args.windows * args.context * 4, np.uint32))
        inputs = {"tokens": str(tokens), "val_fraction": 0.5, "context": args.context, "batch_size": args.batch}
        inputs["torch_dtype"] = args.dtype
        source = SourceModel(str(folder), f"transformer.h.{args.layer}", args.device, inputs=inputs)
        batches = [b for _, b in zip(range(args.windows // args.batch + 1), source.data.train_loader(), strict=False)]
        model, device = source.model, torch.device(args.device)

        def ours() -> int:
            rows = 0
            for batch in batches[1:]:
                rows += len(source.activations(batch))
            return rows

        @torch.no_grad()
        def handwritten() -> int:
            rows = 0
            for batch in batches[1:]:
                ids = batch["tokens"][:, :-1].to(device)
                hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[args.layer + 1]
                rows += len(hidden[:, 1:].reshape(-1, hidden.shape[-1]))  # all but BOS, as the mask leaves
            return rows

        figures = {}
        source.activations(batches[0]), handwritten()  # warm-up (allocator, kernels)
        for name, fn in (("hand-written", handwritten), ("runner", ours), ("hand-written again", handwritten)):
            synchronize(device)
            start = time.perf_counter()
            rows = fn()
            synchronize(device)
            figures[name] = rows / (time.perf_counter() - start)
    hand = (figures["hand-written"] + figures["hand-written again"]) / 2
    d = args.n_embd
    latents = 16 * d
    sae_mb = 2 * d * latents * 4 / 1e6  # W_enc and W_dec in float32
    report = {
        "device": device_name(device),
        "threads": args.threads,
        "dtype": args.dtype,
        "positions_per_s": {k: round(v) for k, v in figures.items()},
        "ratio": round(figures["runner"] / hand, 2),
        "gpu_memory_mb": {
            "source_weights": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6),
            "sae_weights_grads_adam": round(4 * sae_mb),
            "activation_ring_65536": round(65536 * d * 4 / 1e6),
            "codes_of_4096_rows": round(4096 * latents * 4 / 1e6),
        },
    }
    shape = f"GPT-2 ({args.n_layer} x {d}), transformer.h.{args.layer}, context {args.context}, batch {args.batch}"
    print(f"{shape}: {report['device']}")
    for name, rate in report["positions_per_s"].items():
        print(f"  {name:<20} {rate:>10,} positions/s")
    print(f"  runner / hand-written: {report['ratio']}x (the forward stops after the hooked block)")
    print("  memory a GPU holds (MB): " + ", ".join(f"{k} {v:,}" for k, v in report["gpu_memory_mb"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
