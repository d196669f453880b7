"""Token data for the language model: byte-level text (the Python standard library's own sources by default, or the
user's files), encoded once into a memory-mapped cache, and pre-tokenized files (.bin as nanoGPT writes them, .npy)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from runner import ConfigError
from runner.data import DataModule

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_FORMAT = 1  # of the cache's files: a change makes new keys, never reads an old layout


class Windows(Dataset):
    """Windows of `seq_len + 1` consecutive tokens (inputs and their next tokens) tiling a flat token array.

    Window i starts at token i x seq_len; the training loader visits them in a seeded random order
    (runner.samplers.GlobalBatchSampler), so a resumed run sees exactly the windows the uninterrupted one would.
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
    if len(tokens) < seq_len + 1:
        raise ConfigError(
            f"{what} holds {len(tokens):,} tokens, fewer than one window of model.seq_len + 1 = {seq_len + 1}: "
            f"lower model.seq_len, or give more data"
        )
    return Windows(tokens, seq_len, limit)


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


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without tests and site-packages: ~12 MB of real text on every
    machine that runs Python, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts) and p.is_file()
    )


def expand_paths(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in paths:
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(str(pattern)), recursive=True))
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise ConfigError(f"data.paths: {pattern!r} matches no file (relative paths start at {os.getcwd()})")
        files += matches
    return files


def corpus_files(paths: list[str] | None, val_every: int) -> list[Path]:
    """The files of a text corpus: `paths` (files or globs) or the standard library's sources; `val_every` checked."""
    if val_every == 1 or val_every < 0:
        raise ConfigError(f"data.val_every={val_every}: every n-th file is held out; n must be >= 2, or 0 (none)")
    return expand_paths(list(paths)) if paths else stdlib_sources()


def held_out_files(n: int, val_every: int) -> list[bool]:
    """Which of `n` files are validation text: every `val_every`-th (none for 0)."""
    return [bool(val_every) and i % val_every == val_every - 1 for i in range(n)]


def read_text(path: Path) -> bytes:
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.paths: {path} is not UTF-8 text (byte {error.start} is not valid UTF-8): data=text_bytes reads "
            "text files; for pre-tokenized ids use data=tokens_file"
        ) from None
    if b"\0" in data:
        raise ConfigError(f"data.paths: {path} holds NUL bytes, a binary file: name text files only")
    return data


def _cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runner" / "text_bytes"


def encode_corpus(files: list[Path], val_every: int, cache_dir: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Encode the files as bytes into <cache>/<content hash>/{train,val}.u8 (every `val_every`-th file held out for
    validation, files separated by a NUL byte) unless that folder exists; return it and the corpus's facts."""
    texts = [read_text(f) for f in files]
    digest = hashlib.sha256(f"{_FORMAT}:{val_every}:".encode())
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
    key = digest.hexdigest()
    folder = _cache_root(cache_dir) / key[:16]
    if not (folder / "meta.json").is_file():
        held_out = held_out_files(len(texts), val_every)
        val = [t for t, held in zip(texts, held_out, strict=True) if held]
        train = [t for t, held in zip(texts, held_out, strict=True) if not held]
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed into place: a killed or concurrent encoding (every rank of a torchrun job) never
        # leaves a half-written cache that a later run would trust.
        scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".encoding-"))
        (scratch / "train.u8").write_bytes(b"\0".join(train))
        (scratch / "val.u8").write_bytes(b"\0".join(val))
        meta = {"sha256": key, "files": len(files), "bytes": sum(map(len, texts)), "val_files": len(val)}
        (scratch / "meta.json").write_text(json.dumps(meta))
        try:
            scratch.rename(folder)
        except OSError:  # another process finished first: its copy is the same bytes
            shutil.rmtree(scratch, ignore_errors=True)
    meta = json.loads((folder / "meta.json").read_text())
    return folder, {**meta, "cache": str(folder)}


class TextBytes(TokenData):
    """Byte-level text (vocab 256): the standard library's sources by default, or `paths` (files or globs)."""

    def __init__(
        self,
        seq_len: int,
        paths: list[str] | None = None,
        val_every: int = 20,
        val_windows: int | None = 512,
        cache_dir: str | None = None,
        bytes_per_token: float = 1.0,
        **loader: Any,
    ) -> None:
        files = corpus_files(paths, val_every)
        folder, corpus = encode_corpus(files, val_every, cache_dir)
        train = np.memmap(folder / "train.u8", dtype=np.uint8, mode="r")
        val = np.memmap(folder / "val.u8", dtype=np.uint8, mode="r") if corpus["val_files"] else None
        super().__init__(train, val, seq_len, val_windows, **loader)
        self.info = {"corpus": {**corpus, "train_bytes": len(train), "val_bytes": 0 if val is None else len(val)}}
        self.bytes_per_token = bytes_per_token  # read by the model's config (val/bits_per_byte)


# ---- data=tokens_file -----------------------------------------------------------------------------------------------


def load_tokens(path: str | Path, vocab_size: int, dtype: str = "uint16") -> np.ndarray:
    """A flat array of token ids, memory-mapped: `.npy`, or raw `.bin` of `dtype` (nanoGPT writes uint16); every id
    must be < vocab_size."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokens file {path} does not exist (relative paths start at {os.getcwd()})")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise ConfigError(f"tokens file {path} is not a plain .npy array ({error})") from None
    else:
        if np.dtype(dtype).kind != "u":
            raise ConfigError(f"data.dtype={dtype}: .bin token files hold unsigned ids (uint16 or uint32)")
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
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
