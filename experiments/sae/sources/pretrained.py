"""A transformers causal LM as an SAE's source: `source.checkpoint` names a folder written by `save_pretrained` (or
`hf:NAME`, a hub name, where there is network or a hub cache). Its modules are hooked by the names the model gives
them (`transformer.h.8`, `model.layers.6`, `gpt_neox.layers.6`); it reads text tokenized with its own tokenizer
(`source.inputs`), in windows that start with its BOS token (hf_text.py), and its special tokens (BOS, EOS, PAD...)
are masked out of the SAE's rows and left as they are when the SAE is spliced in.

Weights load from .safetensors only and never with the model's own code: a folder is data. Its config.json and
tokenizer_config.json are read as JSON first and refused when they ask for code of their own (`auto_map`) or name a
model_type transformers does not implement; every load passes trust_remote_code=False (and local_files_only for a
folder), with standard input closed, so no prompt of transformers' can be answered yes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.lm.corpus import GLOB_LIMIT
from experiments.sae.sources.hf_code import hub_offline, loaded, model_weights, refuse_own_code
from experiments.sae.sources.hf_text import text_windows
from runner import ConfigError, require
from runner.config.confine import HUB, HUB_CACHED
from runner.data import DataModule
from runner.rundir import CONFIG

# What source.inputs may hold, with the defaults a transformers source reads with.
INPUTS: dict[str, Any] = {
    "paths": None,  # text files or globs; null: the Python standard library's sources (~12 MB, no download)
    "tokens": None,  # or a flat file of the tokenizer's ids (.npy, or .bin of `dtype`), instead of text
    "dataset": None,  # or a Hugging Face dataset on disk (experiments/lm/hf_datasets.py): {path, text_column, split}
    "dtype": "uint32",  # of a .bin tokens file
    "context": 128,  # tokens per window, BOS included
    "prepend_bos": True,  # each window starts with the tokenizer's BOS (where it has one), as the model was trained
    "batch_size": 32,  # windows per forward of the source
    "val_every": 20,  # text: every n-th file held out for validation
    "glob_limit": GLOB_LIMIT,  # folder entries a glob of `paths` may look at before it is refused
    "val_fraction": 0.05,  # a tokens file: its last fraction held out
    "val_windows": 256,  # validation windows (spread evenly over the held-out tokens)
    "torch_dtype": "float32",  # the source's weights: bfloat16 halves a large model on a GPU
    "cache_dir": None,  # where tokenized text is kept (null: ~/.cache/runner/tokens), named by its content
    "seed": 0,
}


def is_pretrained(checkpoint: str | Path) -> bool:
    """Whether `checkpoint` names a transformers model: hf:NAME, or a folder with a config.json that runner did not
    write (a run folder has .hydra/config.yaml)."""
    path = Path(str(checkpoint))
    if str(checkpoint).startswith((HUB, HUB_CACHED)):
        return True
    return path.is_dir() and (path / "config.json").is_file() and not (path / CONFIG).is_file()


@dataclass
class Pretrained:
    """A loaded transformers source: its frozen model, its text as windows, and what its rows leave out."""

    model: nn.Module
    tokenizer: Any
    data: DataModule
    special: torch.Tensor  # token ids whose positions are masked out
    folder: Path  # where its files are (a hub model's cache snapshot)
    inputs: dict[str, Any]  # what it reads, for a cache's identity
    weights: list[Path]  # the files its weights load from (model.safetensors, or its index's shards)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean next-token loss of a batch of windows, and the logits it came from."""
        tokens = batch["tokens"]
        logits = self.model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()), logits

    def mask(self, batch: dict[str, torch.Tensor], skip: int) -> torch.Tensor:
        """[windows, positions]: True where a position gives a row (not a special token, nor among the first `skip`)."""
        inputs = batch["tokens"][:, :-1]
        keep = ~torch.isin(inputs, self.special.to(inputs.device))
        keep[:, :skip] = False
        return keep

    def weight_files(self) -> list[Path]:
        """The files its weights came from."""
        return self.weights

    def vocab(self) -> list[str]:
        """Each token id's text, for the feature pages."""
        size = max(len(self.tokenizer), int(self.model.get_output_embeddings().weight.shape[0]))
        return [self.tokenizer.decode([i]) if i < len(self.tokenizer) else "" for i in range(size)]

    def unembedding(self) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(unembedding [vocab, d], the final norm's gain, tied to the embedding), for the logit lens."""
        head = self.model.get_output_embeddings().weight
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        norm = next((getattr(base, n) for n in ("ln_f", "norm", "final_layer_norm") if hasattr(base, n)), None)
        tied = head is self.model.get_input_embeddings().weight
        return head.detach(), getattr(norm, "weight", None), tied


@contextlib.contextmanager
def opened(checkpoint: str, what: str) -> Iterator[tuple[str, Path, dict[str, Any], bool]]:
    """Within the hub's offline rule for `checkpoint` (no request, transformers and the hub asking on their own, but
    for hf:NAME): its name for transformers, its folder once its configs are checked (refuse_own_code), where
    from_pretrained reads (a folder from disk alone; a hub name's files at the commit whose configs were just checked),
    and whether it is a hub name."""
    cached = str(checkpoint).startswith(HUB_CACHED)  # a hub name a run folder gave: no request, the cache alone
    hub = cached or str(checkpoint).startswith(HUB)
    name = str(checkpoint).split(":", 1)[1] if hub else str(checkpoint)
    with hub_offline(not hub or cached):
        folder, revision = refuse_own_code(name, hub, what, offline=cached)
        where = {"trust_remote_code": False, "local_files_only": not hub or cached, "revision": revision}
        yield name, folder, where, hub


def model_and_tokenizer(checkpoint: str, what: str, **options: Any) -> tuple[nn.Module, Any]:
    """The transformers model `checkpoint` names, frozen, and its tokenizer, checked and loaded as `load` loads a
    source, without its text (`options`: INPUTS' model keys, e.g. torch_dtype)."""
    require("transformers", "hf", f"{what} (a transformers model)")
    with opened(checkpoint, what) as (name, folder, where, hub):
        if not hub:
            model_weights(folder, folder, what)  # its weight files lie in it
        model, tokenizer, _ = _load(name, where, {**INPUTS, **options}, what)
    return model, tokenizer


def load(checkpoint: str, inputs: dict[str, Any] | None) -> Pretrained:
    """The transformers model named by `checkpoint`, frozen, with its tokenizer and the windows of `inputs`."""
    require("transformers", "hf", f"source.checkpoint={checkpoint} (a transformers model)")
    unknown = sorted(set(inputs or {}) - set(INPUTS))
    if unknown:
        raise ConfigError(f"source.inputs: unknown key(s) {unknown}; known: {sorted(INPUTS)}")
    options = {**INPUTS, **(inputs or {})}
    what = f"source.checkpoint={checkpoint}"
    with opened(checkpoint, what) as (name, folder, where, hub):
        weights = None if hub else model_weights(folder, folder, what)  # a hub model's come with the model's load
        model, tokenizer, config = _load(name, where, options, what)
    if weights is None:
        weights = model_weights(folder, folder.parents[1], what)  # a snapshot's files link into the repository's blobs
    tokenizer.model_max_length = 1 << 62  # whole files are tokenized at once, then cut into windows
    data, facts = text_windows(tokenizer, options, int(config.vocab_size))
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    return Pretrained(model, tokenizer, data, special, folder, facts, weights)


def _adapter(where: dict[str, Any]) -> dict[str, Any]:
    # transformers looks for a peft adapter beside the model with settings of its own (a request to the hub for a
    # local folder's name); hf_code refuses a folder that has one, so the look is local
    return {"local_files_only": where["local_files_only"], "revision": where["revision"]}


def _load(name: str, where: dict[str, Any], options: dict[str, Any], what: str) -> tuple[nn.Module, Any, Any]:
    # the model (frozen), its tokenizer and its config, by transformers, each with standard input closed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    config = loaded(
        lambda: AutoConfig.from_pretrained(name, **where),
        f"{what}: transformers cannot read its config",
        "Name a folder written by save_pretrained, or hf:NAME for a hub model (that needs network or the hub's "
        "cache); models that need their own code (trust_remote_code) are refused",
    )
    dtype = getattr(torch, str(options["torch_dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"source.inputs.torch_dtype={options['torch_dtype']!r}: float32, bfloat16 or float16")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per load of a model's tensors says nothing to an SAE's user
    try:
        model = loaded(
            lambda: AutoModelForCausalLM.from_pretrained(
                name, config=config, use_safetensors=True, dtype=dtype, **where, adapter_kwargs=_adapter(where)
            ),
            f"{what}: no causal LM with .safetensors weights loads from it",
            "runner never unpickles weights (pytorch_model.bin): convert them once with "
            "model.save_pretrained(folder, safe_serialization=True)",
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = loaded(
        lambda: AutoTokenizer.from_pretrained(name, **where),
        f"{what}: transformers cannot load its tokenizer",
        "Save the model's tokenizer beside it with tokenizer.save_pretrained(folder); tokenizers that need their own "
        "code are refused",
    )
    if not isinstance(tokenizer, PreTrainedTokenizerBase):  # a tokenizer_class naming another of transformers' names
        raise ConfigError(f"{what}: its tokenizer loads as a {type(tokenizer).__name__}, not a tokenizer")
    return model.eval().requires_grad_(False), tokenizer, config


def meta_model(checkpoint: str) -> nn.Module:
    """The transformers model `checkpoint` names, built from its config alone on the meta device (no weights are
    read: its module names and config), after the same checks as `load`."""
    require("transformers", "hf", f"source={checkpoint} (a transformers model)")
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    what = f"source={checkpoint}"
    with opened(checkpoint, what) as (name, _, where, _):
        config = loaded(lambda: AutoConfig.from_pretrained(name, **where), f"{what}: cannot read its config", "")
    with torch.device("meta"):
        return loaded(
            lambda: AutoModelForCausalLM.from_config(config, trust_remote_code=False),
            f"{what}: no causal LM of transformers is built from its config",
            "",
        )


def max_positions(config: Any) -> int | None:
    """How many positions a transformers model reads (None: its config does not say)."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
