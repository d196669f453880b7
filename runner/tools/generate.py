"""`python -m runner.generate RUN_DIR [prompt=TEXT | prompt_ids=[1,2]] [max_new_tokens=200] [temperature=0.8]
[top_k=40] [num_samples=4] [seed=0] [device=cpu] [weights=PATH]`: text from a finished language-model run, as nanoGPT's
sample.py gives it, by the model's own `generate` (runner's GPT: top-k and temperature sampling with a KV cache).

A byte-level model (vocab_size 256) takes `prompt` as text and prints text; a tokenized one takes `prompt_ids` and
prints ids (its tokenizer is not runner's). The weights are the run's model.safetensors, or `weights=` (a checkpoint
folder, or the file restore_best left). The same seed gives the same samples. Exit codes: 0, or 2 with one line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError
from runner.load import load_trained, trusted_here
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options

DEFAULTS: dict[str, Any] = {
    "prompt": "\n",
    "prompt_ids": None,
    "max_new_tokens": 200,
    "temperature": 0.8,
    "top_k": 40,
    "num_samples": 4,
    "seed": 0,
    "device": "cpu",
    "weights": None,
}
WHOLE = ("max_new_tokens", "num_samples", "seed")
USAGE = "usage: python -m runner.generate RUN_DIR [prompt=TEXT] [max_new_tokens=200] [temperature=0.8] [top_k=40] ..."


def _options(argv: list[str]) -> tuple[Path, dict[str, Any]]:
    argv = key_values(argv, DEFAULTS)
    if not argv or "=" in argv[0] or argv[0] in ("-h", "--help"):
        raise ConfigError(USAGE)
    options = read_options(argv[1:], DEFAULTS, ("prompt", "device", "weights"), "")
    for key in WHOLE:
        if isinstance(options[key], bool) or not isinstance(options[key], int) or options[key] < (key != "seed"):
            raise ConfigError(f"{key}={options[key]!r}: give a whole number{' >= 1' if key != 'seed' else ''}")
    if options["seed"] > 2**64 - 1:  # what torch.Generator.manual_seed takes (more: an overflow traceback)
        raise ConfigError(f"seed={options['seed']}: give a whole number in [0, 2**64 - 1], e.g. seed=0")
    if not isinstance(options["temperature"], (int, float)) or not 0 < options["temperature"] < float("inf"):
        raise ConfigError(f"temperature={options['temperature']!r}: give a number > 0, e.g. temperature=0.8")
    top_k = options["top_k"]
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"top_k={top_k!r}: give a whole number >= 1, or top_k=null for no cut")
    return Path(argv[0]), options


def _prompt(model: torch.nn.Module, options: dict[str, Any]) -> torch.Tensor:
    vocab = getattr(model, "vocab_size", None)
    ids = options["prompt_ids"]
    if ids is None:
        if vocab != 256:
            raise ConfigError(f"the model's vocab_size is {vocab}, not bytes: give prompt_ids=[...] (its token ids)")
        ids = list(options["prompt"].encode())
    if not ids or not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt_ids={ids!r}: give a non-empty list of token ids below vocab_size {vocab}")
    return torch.tensor([ids] * options["num_samples"])


def main(argv: list[str] | None = None) -> int:
    """Sample, print each sample and the rate, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        path, options = _options(argv)
        device = torch.device(checked_device(options["device"]))
        model, _ = load_trained(path, trusted_here(), weights=options["weights"])
        if not hasattr(model, "generate"):
            raise ConfigError(f"{path}'s model ({type(model).__name__}) does not generate (runner's GPT does)")
        prompt = _prompt(model, options).to(device)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model.to(device)
    generator = torch.Generator(device=device).manual_seed(options["seed"])
    started = time.perf_counter()
    tokens = model.generate(prompt, options["max_new_tokens"], options["temperature"], options["top_k"], generator)
    seconds = time.perf_counter() - started
    width = prompt.shape[1]
    for i, row in enumerate(tokens.tolist()):
        if model.vocab_size == 256:
            text = bytes(row).decode("utf-8", "replace")  # an invalid UTF-8 sequence shows as U+FFFD
        else:
            text = f"{' '.join(map(str, row[:width]))} | {' '.join(map(str, row[width:]))}"
        print(f"=== sample {i} ===\n{text}")
    new = options["max_new_tokens"] * options["num_samples"]
    print(f"{new} tokens in {seconds:.2f} s: {new / seconds:.0f} tokens/s on {device}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
