"""How long `python -m runner.sae_eval` takes, whole processes, on two SAEs:

- `--run RUN`: an SAE run of runner's (the lm preset's: +experiment=sae_lm on +experiment=lm), every evaluation at the
  command's defaults (core on 1M positions with the losses on 200k, probing on 300k positions of held-out Python);
- `--gpt2 DIR`: an SAE folder in SAELens's layout, GPT-2-small-shaped (768 -> 24,576, TopK k 32, random weights; it is
  written by runner's SAELens export, so its format is the one the real SAELens loads: tests/e2e/test_sae_peers_load)
  hooked after block `--layer` of a transformers GPT-2 small made here (124M parameters, random weights, a byte-level
  BPE tokenizer of GPT-2's vocabulary size trained on the standard library's sources: no download), read as an
  imported SAE (`source=`); `--tokens` positions (GPT-2 small runs at ~1-2k tokens/s on 2 cores: 1M positions is
  hours, not minutes).

    python benchmarks/sae_eval.py --run outputs/DATE/TIME [--gpt2 outputs/bench-gpt2] [--tokens 20000] [--json F]
        [--n-layer 12 --n-embd 768 --vocab 50257 --latents 24576 --k 32 --corpus FILES...]   (the smoke test's shape)

Prints each evaluation's seconds (from its own clock) and the command's wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import cpu_model, machine, write_json  # noqa: E402
from experiments.lm.corpus import stdlib_sources  # noqa: E402

EOT = "<|endoftext|>"


def make_gpt2(folder: Path, layer: int, shape: dict[str, int], corpus: list[Path]) -> tuple[Path, Path]:
    """(a GPT-2-shaped model folder, a SAELens SAE folder on its block `layer`), made once in `folder`: `shape` holds
    n_layer, n_embd, vocab (the tokenizer's BPE, trained on `corpus`), latents and k."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from experiments.sae.coders.activations import TopKSAE
    from experiments.sae.formats import export

    model, sae = folder / "gpt2", folder / f"sae-saelens-h{layer}"
    if not (model / "config.json").is_file():
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=shape["vocab"], special_tokens=[EOT], initial_alphabet=alphabet)
        bpe.train_from_iterator((p.read_text(errors="replace") for p in corpus), trainer)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT)
        torch.manual_seed(0)
        heads = max(1, shape["n_embd"] // 64)
        config = GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=heads, vocab_size=len(tokenizer))
        config.bos_token_id = config.eos_token_id = tokenizer.bos_token_id
        GPT2LMHeadModel(config).save_pretrained(model)
        tokenizer.save_pretrained(model)
    if not (sae / "cfg.json").is_file():
        torch.manual_seed(0)
        coder = TopKSAE(d_in=shape["n_embd"], n_latents=shape["latents"], k=shape["k"])
        coder.initialized.fill_(True)
        export(coder, "saelens", sae, hook=f"blocks.{layer}", model="gpt2-shaped")
    return model, sae


def timed(command: list[str], out: Path) -> dict:
    """Run one evaluation command; its eval.json's seconds per evaluation, the wall time and peak RSS."""
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    result = json.loads((out / "eval.json").read_text())
    seconds = {name: got.get("read", {}).get("seconds") for name, got in result["evals"].items()}
    reads = {name: got.get("read", {}) for name, got in result["evals"].items()}
    return {
        "wall_s": round(time.time() - started, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
        "seconds": seconds,
        "read": {name: {k: v for k, v in read.items() if k != "seconds"} for name, read in reads.items()},
        "skipped": {name: got["skipped"] for name, got in result["evals"].items() if "skipped" in got},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="an SAE run folder of runner's (the lm preset's SAE)")
    parser.add_argument("--gpt2", help="a folder for the GPT-2-small-shaped model and SAE (made once)")
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=20000, help="the GPT-2 case's positions (core)")
    parser.add_argument("--n-layer", type=int, default=12, help="GPT-2 small's 12 blocks")
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257, help="the BPE tokenizer's size")
    parser.add_argument("--latents", type=int, default=24576)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--corpus", nargs="*", help="text files for the tokenizer and the source (default: stdlib)")
    parser.add_argument("--device", default="cpu", help="cpu (the GPU figures come from benchmarks/gpu_check.py)")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"machine": machine(), "cpu": cpu_model(), "device": args.device}
    command = [sys.executable, "-m", "runner.sae_eval"]
    if args.run:
        out = Path(args.run) / "evals-bench"
        results["lm_preset"] = timed([*command, args.run, f"device={args.device}", f"out={out}"], out)
        print(f"lm preset's SAE, 1M positions: {json.dumps(results['lm_preset'])}")
    if args.gpt2:
        made = time.time()
        shape = {k: getattr(args, k) for k in ("n_layer", "n_embd", "vocab", "latents", "k")}
        corpus = [Path(p) for p in args.corpus] if args.corpus else stdlib_sources()
        model, sae = make_gpt2(Path(args.gpt2), args.layer, shape, corpus)
        out = Path(args.gpt2) / "evals"
        tokens = [f"tokens={args.tokens}", f"splice_tokens={args.tokens // 4}", f"probe_tokens={args.tokens}"]
        if args.corpus:  # the source reads these too (by default: the standard library's sources)
            tokens.append(f"inputs={{paths: [{','.join(args.corpus)}], val_every: 2}}")
        results["made_s"] = round(time.time() - made, 1)
        options = [f"source={model}", f"device={args.device}", *tokens, f"out={out}"]
        results["gpt2"] = timed([*command, str(sae), *options], out)
        shape = f"{args.n_layer} x {args.n_embd}"
        print(f"GPT-2-shaped ({shape}) SAELens SAE, {args.tokens} positions: {json.dumps(results['gpt2'])}")
    print(results["machine"])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
