"""Token data for the language model: byte-level text (the Python standard library's own sources by default, or the
user's files), encoded once into a memory-mapped cache (experiments.lm.text_cache), and pre-tokenized files (.bin as
nanoGPT writes them, .npy)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from experiments.lm import hf_datasets
from experiments.lm.corpus import (
    GLOB_LIMIT,
    corpus_files,
    no_val_split,
    stdlib_sources,  # noqa: F401 - where it was: experiments.lm.data.stdlib_sources
)
from experiments.lm.text_cache import (
    cache_root,  # noqa: F401 - where it was: experiments.lm.data.cache_root
    encode_corpus,
    encode_dataset,
    write_once,  # noqa: F401 - where it was: experiments.lm.data.write_once
)
from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data import DataModule, load_npy


class Windows(Dataset):
    """Windows of `seq_len + 1` consecutive tokens (inputs and their next tokens) tiling a flat token array.

    Window i starts at token i x seq_len; the training loader visits them in a seeded random order
    (runner.data.samplers.GlobalBatchSampler), so a resumed run sees exactly the windows the uninterrupted one would.
    `limit` keeps that many windows spread evenly over the array (a validation split that costs what it needs)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, limit: int | None = None) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        count = (len(tokens) - 1) // seq_len
        self.starts = np.arange(count) * seq_len
        if limit is not None and limit < count:
            self.starts = self.starts[np.linspace(0, count - 1, limit).round().astype(np.int64)]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in self.starts[indices]])
        return {"tokens": torch.from_numpy(rows.astype(np.int64)), "num_tokens": len(indices) * self.seq_len}


def windows_or_error(tokens: np.ndarray, seq_len: int, what: str, limit: int | None = None) -> Windows:
    """The windows of `tokens`, or a ConfigError when not even one fits (`what`: the split, for the message)."""
    check_seq_len(seq_len)
    if limit is not None:
        check_whole(limit, "data.val_windows")
    if len(tokens) < seq_len + 1:
        raise ConfigError(
            f"{what} holds {len(tokens):,} tokens, fewer than one window of model.seq_len + 1 = {seq_len + 1}: "
            f"lower model.seq_len, or give more data"
        )
    return Windows(tokens, seq_len, limit)


def check_seq_len(seq_len: int) -> None:
    """A ConfigError unless the window length (data.seq_len follows model.seq_len) is a whole number >= 1."""
    check_whole(seq_len, "model.seq_len")


class TokenData(DataModule):
    """Training windows in a seeded random order, validation windows in order; every batch counts its tokens."""

    def __init__(
        self, train: np.ndarray, val: np.ndarray | None, seq_len: int, val_windows: int | None, **loader: Any
    ) -> None:
        splits: dict[str, Dataset] = {"train": windows_or_error(train, seq_len, "the training split")}
        if val is not None:
            splits["val"] = windows_or_error(val, seq_len, "the validation split", val_windows)
        super().__init__(splits, tokens_per_sample=seq_len, **loader)


# ---- data=text_bytes ------------------------------------------------------------------------------------------------


def _mapped(path: Path) -> np.ndarray:
    # the bytes of a cache file, memory-mapped (numpy cannot map an empty file: an empty array)
    return np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)


@buildable("data")
class TextBytes(TokenData):
    """Byte-level text (vocab 256): the standard library's sources by default, or `paths` (files or globs)."""

    def __init__(
        self,
        seq_len: int,
        paths: list[str] | str | None = None,  # one string: one path (or glob)
        val_every: int = 20,
        val_windows: int | None = 512,
        cache_dir: str | None = None,
        bytes_per_token: float = 1.0,
        dataset: dict[str, Any] | str | None = None,
        glob_limit: int = GLOB_LIMIT,  # folder entries a glob of `paths` may look at (a dataset's: dataset.glob_limit)
        **loader: Any,
    ) -> None:
        check_seq_len(seq_len)
        if dataset is not None and paths:
            raise ConfigError("data.paths and data.dataset both name text: give one (data.paths=null for a dataset)")
        if dataset is not None:
            corpus_files(None, val_every)  # val_every checked as for files
            folder, corpus = encode_dataset(hf_datasets.spec_of(dataset, "data.dataset"), val_every, cache_dir)
            files = [None] * corpus["rows"]  # rows stand for files in what is held out, and in the messages
        else:
            files = corpus_files(paths, val_every, glob_limit)
            folder, corpus = encode_corpus(files, val_every, cache_dir)
        train, val = _mapped(folder / "train.u8"), _mapped(folder / "val.u8") if corpus["val_files"] else None
        if len(train) == 0 and dataset is not None:
            raise ConfigError(
                f"data.dataset: the training rows are empty ({corpus['rows']} row(s), 0 bytes of text in "
                f"text_column={hf_datasets.spec_of(dataset, 'data.dataset')['text_column']}): name data that holds text"
            )
        if len(train) == 0:
            empty = ", ".join(str(f) for f in files if f.stat().st_size == 0) or "its files"
            raise ConfigError(f"data.paths: the training text is empty ({empty}: 0 bytes): name files that hold text")
        super().__init__(train, val, seq_len, val_windows, **loader)
        self.info = {"corpus": {**corpus, "train_bytes": len(train), "val_bytes": 0 if val is None else len(val)}}
        self.bytes_per_token = bytes_per_token  # read by the model's config (val/bits_per_byte)
        # for the error when a monitor needs validation
        self.no_val_split = no_val_split(len(files), val_every) if dataset is None else _no_val_rows(corpus, val_every)


def _no_val_rows(corpus: dict[str, Any], val_every: int) -> str | None:
    # why a dataset's rows hold none out for validation (None when some are)
    if corpus["val_rows"]:
        return None
    return (
        f"data.dataset: {corpus['rows']} row(s) with data.val_every={val_every} hold none out for validation "
        "(every val_every-th row is): give more rows, or data.val_every=N with 2 <= N <= the rows"
    )


# ---- data=tokens_file -----------------------------------------------------------------------------------------------


def load_tokens(path: str | Path, vocab_size: int, dtype: str = "uint16") -> np.ndarray:
    """A flat array of token ids, memory-mapped: `.npy`, or raw `.bin` of `dtype` (nanoGPT writes uint16); every id
    must be < vocab_size."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"tokens file {path} is a folder: name the file of token ids in it (a .bin or .npy)")
    if not path.is_file():
        raise ConfigError(f"tokens file {path} does not exist (relative paths start at {os.getcwd()})")
    if path.stat().st_size == 0:
        raise ConfigError(f"tokens file {path} is empty (0 bytes): name a file of token ids")
    if path.suffix == ".npy":
        tokens = load_npy(path, f"tokens file {path}")
    else:
        try:
            width = np.dtype(dtype)
        except TypeError:
            width = None
        if width is None or width.kind != "u":
            raise ConfigError(f"data.dtype={dtype}: .bin token files hold unsigned ids: data.dtype=uint16 or uint32")
        if path.stat().st_size % width.itemsize:
            raise ConfigError(
                f"tokens file {path} is {path.stat().st_size:,} bytes, not a whole number of {width} ids "
                f"({width.itemsize} bytes each): a truncated file, or another width (data.dtype=uint16 or uint32)"
            )
        tokens = np.memmap(path, dtype=width, mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ConfigError(f"tokens file {path} must be a flat array of integer ids, got {tokens.dtype} {tokens.shape}")
    for start in range(0, len(tokens), 1 << 24):  # in chunks: a file of billions of tokens stays on disk
        chunk = tokens[start : start + (1 << 24)]
        if chunk.max(initial=0) >= vocab_size or chunk.min(initial=0) < 0:
            bad = int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
            raise ConfigError(
                f"tokens file {path}: token {start + bad} is {int(chunk[bad])}, outside model.vocab_size={vocab_size}: "
                "set model.vocab_size to the tokenizer's (rounded up to a multiple of 64 is faster), or check "
                f"data.dtype (now {dtype})"
            )
    return tokens


@buildable("data")
class TokensFile(TokenData):
    """Pre-tokenized ids from `train_path` and, optionally, `val_path` (else the last `val_fraction` of train)."""

    def __init__(
        self,
        train_path: str,
        seq_len: int,
        vocab_size: int,
        val_path: str | None = None,
        val_fraction: float = 0.0,
        val_windows: int | None = 512,
        dtype: str = "uint16",
        bytes_per_token: float | None = None,
        **loader: Any,
    ) -> None:
        check_seq_len(seq_len)
        train = load_tokens(train_path, vocab_size, dtype)
        val = load_tokens(val_path, vocab_size, dtype) if val_path else None
        if val is None and val_fraction:
            if not 0 < val_fraction < 1:
                raise ConfigError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
            cut = int(len(train) * (1 - val_fraction))
            train, val = train[:cut], train[cut:]
        super().__init__(train, val, seq_len, val_windows, **loader)
        self.info = {"tokens": {"train": len(train), "val": 0 if val is None else len(val), "path": str(train_path)}}
        self.bytes_per_token = bytes_per_token
