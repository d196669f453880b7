"""The text a transformers source reads (source.inputs): text files, a Hugging Face dataset or a flat file of token
ids, tokenized with the model's own tokenizer into a cache named by the tokenizer and the text, and cut into windows
that start with its BOS token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.lm import hf_datasets
from experiments.lm.corpus import corpus_files, held_out_files, read_text
from experiments.lm.data import Windows, load_tokens
from experiments.lm.text_cache import cache_root, content_key, write_once
from runner import ConfigError, check_whole
from runner.data import DataModule

_FORMAT = 1  # of the token cache's files: a change makes new keys, never reads an old layout


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


def text_windows(tokenizer: Any, options: dict[str, Any], vocab_size: int) -> tuple[DataModule, dict[str, Any]]:
    """The source's training and validation windows of `options` (source.inputs, defaults filled in), and the facts
    of what they are made from (a cache's identity)."""
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
