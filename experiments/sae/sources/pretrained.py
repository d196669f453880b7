"""A transformers causal LM as an SAE's source: `source.checkpoint` names a folder written by `save_pretrained` (or
`hf:NAME`, a hub name, where there is network or a hub cache). Its modules are hooked by the names the model gives
them (`transformer.h.8`, `model.layers.6`, `gpt_neox.layers.6`); it reads text tokenized with its own tokenizer
(`source.inputs`), in windows that start with its BOS token, and its special tokens (BOS, EOS, PAD...) are masked out
of the SAE's rows and left as they are when the SAE is spliced in.

Weights load from .safetensors only and never with the model's own code: a folder is data. Its config.json and
tokenizer_config.json are read as JSON first and refused when they ask for code of their own (`auto_map`) or name a
model_type transformers does not implement; every load passes trust_remote_code=False (and local_files_only for a
folder), with standard input closed, so no prompt of transformers' can be answered yes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from experiments.lm import hf_datasets
from experiments.lm.corpus import GLOB_LIMIT, corpus_files, held_out_files, read_text
from experiments.lm.data import Windows, cache_root, content_key, load_tokens, write_once
from experiments.sae.sources.hf_code import hub_offline, loaded, model_weights, refuse_own_code
from runner import ConfigError, check_whole, require
from runner.data import DataModule
from runner.rundir import CONFIG
from runner.trained import HUB, HUB_CACHED

_FORMAT = 1  # of the token cache's files: a change makes new keys, never reads an old layout
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


def load(checkpoint: str, inputs: dict[str, Any] | None) -> Pretrained:
    """The transformers model named by `checkpoint`, frozen, with its tokenizer and the windows of `inputs`."""
    require("transformers", "hf", f"source.checkpoint={checkpoint} (a transformers model)")
    unknown = sorted(set(inputs or {}) - set(INPUTS))
    if unknown:
        raise ConfigError(f"source.inputs: unknown key(s) {unknown}; known: {sorted(INPUTS)}")
    options = {**INPUTS, **(inputs or {})}
    cached = str(checkpoint).startswith(HUB_CACHED)  # a hub name a run folder gave: no request, the cache alone
    hub = cached or str(checkpoint).startswith(HUB)
    name = str(checkpoint).split(":", 1)[1] if hub else str(checkpoint)
    what = f"source.checkpoint={checkpoint}"
    with hub_offline(not hub or cached):  # no request (transformers and the hub ask on their own) but for hf:NAME
        folder, revision = refuse_own_code(name, hub, what, offline=cached)
        weights = None if hub else model_weights(folder, folder, what)  # a hub model's come with the model's load
        # a folder is read from disk alone; a hub name's files are read at the commit whose configs were just checked
        where = {"trust_remote_code": False, "local_files_only": not hub or cached, "revision": revision}
        model, tokenizer, config = _load(name, where, options, what)
    if weights is None:
        weights = model_weights(folder, folder.parents[1], what)  # a snapshot's files link into the repository's blobs
    tokenizer.model_max_length = 1 << 62  # whole files are tokenized at once, then cut into windows
    data, facts = _windows(tokenizer, options, int(config.vocab_size))
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


class BosWindows(Windows):
    """Windows of `context` tokens whose first is `bos`, then `context` consecutive tokens of the array (the inputs and
    their next tokens: `context + 1` in all); without a BOS, plain windows."""

    def __init__(self, tokens: np.ndarray, context: int, bos: int | None, limit: int | None = None) -> None:
        super().__init__(tokens, context - 1 if bos is not None else context, limit)
        self.bos = bos

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        batch = super().__getitems__(indices)
        if self.bos is not None:
            rows = batch["tokens"]
            batch["tokens"] = torch.cat([torch.full((len(rows), 1), self.bos, dtype=rows.dtype), rows], dim=1)
            batch["num_tokens"] = len(indices) * (self.seq_len + 1)
        return batch


def _windows(tokenizer: Any, options: dict[str, Any], vocab_size: int) -> tuple[DataModule, dict[str, Any]]:
    # the source's training and validation windows, and what they are made from
    context, batch_size = check_whole(options["context"], "source.inputs.context"), options["batch_size"]
    bos = tokenizer.bos_token_id if options["prepend_bos"] else None
    if options["tokens"] and (options["paths"] or options["dataset"] is not None):
        raise ConfigError("source.inputs.tokens and source.inputs.paths (or .dataset) both name the text: give one")
    if options["tokens"]:
        fraction = options["val_fraction"]
        if not 0 < fraction < 1:
            raise ConfigError(f"source.inputs.val_fraction must be in (0, 1), got {fraction}")
        tokens = load_tokens(options["tokens"], vocab_size, options["dtype"])
        cut = int(len(tokens) * (1 - fraction))
        train, val = tokens[:cut], tokens[cut:]
        facts = {"tokens": str(Path(options["tokens"]).resolve()), "bytes": Path(options["tokens"]).stat().st_size}
    else:
        train, val, facts = _tokenized(tokenizer, options)
    need = context if bos is not None else context + 1
    for split, array in (("training", train), ("validation", val)):
        if len(array) < need:
            raise ConfigError(
                f"the source's {split} text holds {len(array):,} tokens, fewer than one window of {need}: lower "
                "source.inputs.context, or give more text (source.inputs.paths, source.inputs.val_every)"
            )
    splits = {
        "train": BosWindows(train, context, bos),
        "val": BosWindows(val, context, bos, check_whole(options["val_windows"], "source.inputs.val_windows")),
    }
    data = DataModule(splits, check_whole(batch_size, "source.inputs.batch_size"), seed=options["seed"])
    facts = {**facts, "context": context, "bos": bos, "train_tokens": len(train), "val_tokens": len(val)}
    return data, facts


def _tokenized(tokenizer: Any, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    # the text of source.inputs.paths in the tokenizer's ids, files joined by its EOS (or BOS), every val_every-th
    # file held out; kept in a cache folder named by the tokenizer and the text, so a second run reads it back
    val_every = options["val_every"]
    if options["dataset"] is not None:
        return _tokenized_dataset(tokenizer, options)
    files = corpus_files(options["paths"], val_every, options["glob_limit"], "source.inputs")
    if not any(held_out_files(len(files), val_every)):
        raise ConfigError(
            f"source.inputs: {len(files)} text file(s) with val_every={val_every} hold none out for validation, "
            "which the SAE validates (and splices) on: give 2 files or more, with source.inputs.val_every >= 2"
        )
    texts = [read_text(f) for f in files]
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    key = content_key(f"{_FORMAT}:{val_every}:{type(tokenizer).__name__}:{vocab}{specials}", texts)
    folder = cache_root(options["cache_dir"], "tokens") / key[:16]
    if not (folder / "meta.json").is_file():
        between = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        separator = [] if between is None else [between]
        held = held_out_files(len(texts), val_every)

        def ids(keep: bool) -> np.ndarray:
            parts = [
                tokenizer(t.decode(), add_special_tokens=False)["input_ids"] + separator
                for t, h in zip(texts, held, strict=True)
                if h == keep
            ]
            return np.asarray([i for part in parts for i in part], dtype=np.int64).astype(np.uint32)

        def fill(scratch: Path) -> None:
            np.save(scratch / "train.npy", ids(False))
            np.save(scratch / "val.npy", ids(True))
            (scratch / "meta.json").write_text(json.dumps({"sha256": key, "files": len(files), "val_files": sum(held)}))

        write_once(folder, fill, "source.inputs.cache_dir")
    train = np.load(folder / "train.npy", mmap_mode="r")
    val = np.load(folder / "val.npy", mmap_mode="r")
    return train, val, {**json.loads((folder / "meta.json").read_text()), "cache": str(folder)}


def _tokenized_dataset(tokenizer: Any, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    # _tokenized for a Hugging Face dataset: its rows streamed through the tokenizer, every val_every-th held out
    if options["paths"]:
        raise ConfigError("source.inputs.paths and source.inputs.dataset both name text: give one")
    option, val_every = "source.inputs.dataset", options["val_every"]
    spec = hf_datasets.spec_of(options["dataset"], option)
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    key = content_key(f"{_FORMAT}:{val_every}:dataset:{hf_datasets.identity(spec, option)}:{vocab}", [])
    folder = cache_root(options["cache_dir"], "tokens") / key[:16]
    if not (folder / "meta.json").is_file():
        between = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        separator = [] if between is None else [between]

        def fill(scratch: Path) -> None:
            parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
            rows = 0
            for rows, text in enumerate(hf_datasets.documents(spec, option), 1):
                ids = tokenizer(text.decode(), add_special_tokens=False)["input_ids"] + separator
                parts[hf_datasets.held_out(rows - 1, val_every)].append(np.asarray(ids, dtype=np.uint32))
            for name, held in (("train", False), ("val", True)):
                np.save(scratch / f"{name}.npy", np.concatenate(parts[held] or [np.zeros(0, np.uint32)]))
            (scratch / "meta.json").write_text(json.dumps({"sha256": key, "rows": rows, "val_rows": len(parts[True])}))

        write_once(folder, fill, "source.inputs.cache_dir")
    meta = json.loads((folder / "meta.json").read_text())
    if not meta["val_rows"]:
        raise ConfigError(
            f"{option}: {meta['rows']} row(s) with val_every={val_every} hold none out for validation, which the SAE "
            "validates (and splices) on: give more rows, or source.inputs.val_every=N with 2 <= N <= the rows"
        )
    train, val = np.load(folder / "train.npy", mmap_mode="r"), np.load(folder / "val.npy", mmap_mode="r")
    return train, val, {**meta, "cache": str(folder)}


def meta_model(checkpoint: str) -> nn.Module:
    """The transformers model `checkpoint` names, built from its config alone on the meta device (no weights are
    read: its module names and config), after the same checks as `load`."""
    require("transformers", "hf", f"source={checkpoint} (a transformers model)")
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    cached = str(checkpoint).startswith(HUB_CACHED)
    hub = cached or str(checkpoint).startswith(HUB)
    name, what = (str(checkpoint).split(":", 1)[1] if hub else str(checkpoint)), f"source={checkpoint}"
    with hub_offline(not hub or cached):
        folder, revision = refuse_own_code(name, hub, what, offline=cached)
        where = {"trust_remote_code": False, "local_files_only": not hub or cached, "revision": revision}
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
