"""data=text_stream: byte-level text read as a stream, never encoded up front. Each shard (rank x loader worker) reads
whole files of its own, in an order shuffled anew at every pass over the corpus, and cuts them into windows of
seq_len + 1 bytes; blocks of `block` consecutive windows (8192: ~1 MB, dozens of files) are handed out in a seeded
random order, so that a batch mixes many files (blocks of 256 windows, one or two files, trained the lm experiment's
GPT to 3.09 bits per byte at step 800 where a shuffle of the whole corpus reaches 2.35). A shard's place (pass, file,
byte offset of its block, windows taken) is a handful of integers: exact resume re-reads one block."""

from __future__ import annotations

import codecs
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.lm.corpus import GLOB_LIMIT, corpus_files, held_out_files, no_val_split, read_text
from experiments.lm.data import check_seq_len, windows_or_error
from runner import ConfigError
from runner.config.trust import buildable
from runner.data.streaming import ShardedStream, StreamingData

_SNIFF = 8192  # bytes of each training file checked before streaming: no NUL (a binary file), UTF-8


def sniff_text(path: Path, head: bytes) -> None:
    """Refuse a training file whose first bytes are not text (NUL bytes, or not UTF-8), as text_bytes refuses one
    anywhere in it: a stream reads no more than this before training."""
    if b"\0" in head:
        raise ConfigError(f"data.paths: {path} holds NUL bytes, a binary file: name text files only")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.paths: {path} is not UTF-8 text (byte {error.start} is not valid UTF-8): data=text_stream reads "
            "text files; for pre-tokenized ids use data=tokens_file"
        ) from None


def _utf8_error(data: bytes, offset: int) -> int | None:
    """The offset of the first byte of `data` (read from `offset` in its file) that is not UTF-8, or None; a character
    cut at either end of the read is not an error."""
    skip = 0
    while offset and skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:  # the tail of a character begun before
        skip += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data[skip:], final=False)
    except UnicodeDecodeError as error:
        return offset + skip + error.start
    return None


class TextStreamShards(ShardedStream):
    """Windows of seq_len + 1 bytes from `files`, each file followed by a NUL byte; endless (pass after pass)."""

    def __init__(self, files: list[Path], seq_len: int, seed: int = 0, shuffle: bool = True, block: int = 8192) -> None:
        self.files = [str(f) for f in files]
        self.sizes = [os.path.getsize(f) for f in files]
        self.seq_len, self.seed, self.shuffle, self.block = seq_len, seed, shuffle, block
        self.max_shards = len(files)
        listing = "\n".join(f"{f}\t{n}" for f, n in zip(self.files, self.sizes, strict=True))
        self.identity = hashlib.sha256(listing.encode()).hexdigest()[:16]  # names and sizes
        self._orders: dict[int, list[int]] = {}
        self._warned: set[str] = set()  # files found not to be UTF-8 past their first bytes, said once each
        # the place: the cursor (pass, file in this shard's list, byte offset) where the current block starts, the
        # block's number, and how many of its windows were handed out
        self.place = {"pass": 0, "file": 0, "offset": 0, "block": 0, "taken": 0}

    def state_dict(self) -> dict[str, Any]:
        """This shard's place (torchdata calls it in the worker, after each batch)."""
        return dict(self.place)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a state_dict() of this shard (StreamLoader checked that the corpus and the shards match)."""
        self.place = {k: int(state[k]) for k in self.place}

    def _mine(self, pass_: int) -> list[int]:
        # this shard's files in pass `pass_`: every count-th of the pass's order, starting at its index
        if pass_ not in self._orders:
            n = len(self.files)
            order = np.random.default_rng([self.seed, pass_]).permutation(n) if self.shuffle else np.arange(n)
            index, count = self.shard()
            self._orders = {pass_: order[index::count].tolist()}  # one pass at a time is all a shard reads
        return self._orders[pass_]

    def _read(self, cursor: tuple[int, int, int], n: int) -> tuple[bytes, tuple[int, int, int]]:
        """`n` bytes of this shard's stream from `cursor`, and the cursor after them."""
        pass_, i, offset = cursor
        out: list[bytes] = []
        while n > 0:
            mine = self._mine(pass_)
            if i == len(mine):
                pass_, i, offset = pass_ + 1, 0, 0
                continue
            path, size = self.files[mine[i]], self.sizes[mine[i]]
            if offset < size:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(min(n, size - offset))
                if len(data) != min(n, size - offset):
                    raise RuntimeError(f"data=text_stream: {path} changed while it was streamed (it was {size} bytes)")
                self._check_text(path, data, offset)
                out.append(data)
                n, offset = n - len(data), offset + len(data)
            else:  # the NUL byte that ends every file
                out.append(b"\0")
                n, i, offset = n - 1, i + 1, 0
        return b"".join(out), (pass_, i, offset)

    def _check_text(self, path: str, data: bytes, offset: int) -> None:
        # Only each file's first bytes are checked before training (reading a whole corpus up front is what a stream
        # avoids): a later byte that is not UTF-8 is trained on as a byte, and said loudly once per file.
        if path not in self._warned and (bad := _utf8_error(data, offset)) is not None:
            self._warned.add(path)
            print(
                f"warning: data=text_stream: {path} is not UTF-8 text at byte {bad} (its first {_SNIFF} bytes were); "
                "its bytes are trained on as they are. Remove or fix the file (text_bytes refuses such files)",
                file=sys.stderr,
            )

    def __iter__(self) -> Iterator[torch.Tensor]:
        T, place = self.seq_len, self.place
        while True:
            cursor = (place["pass"], place["file"], place["offset"])
            head, after = self._read(cursor, self.block * T)
            tokens = np.frombuffer(head + self._read(after, 1)[0], dtype=np.uint8)
            index, count = self.shard()
            rng = np.random.default_rng([self.seed, index, count, place["block"]])
            order = rng.permutation(self.block) if self.shuffle else np.arange(self.block)
            while place["taken"] < self.block:
                j = int(order[place["taken"]])
                place["taken"] += 1  # before the yield: the state then says what comes next
                yield torch.from_numpy(tokens[j * T : j * T + T + 1].astype(np.int64))
            place.update(zip(("pass", "file", "offset"), after, strict=True))
            place["block"], place["taken"] = place["block"] + 1, 0


def collate_windows(windows: list[torch.Tensor]) -> dict[str, Any]:
    """A batch of windows as the GPT reads it: tokens [B, T + 1] and the B x T tokens it predicts."""
    tokens = torch.stack(windows)
    return {"tokens": tokens, "num_tokens": tokens.shape[0] * (tokens.shape[1] - 1)}


@buildable("data")
class TextStream(StreamingData):
    """Byte-level text streamed from `paths` (files or globs; default: the standard library's sources); every
    `val_every`-th file held out for validation, read whole (`val_windows` windows spread over it)."""

    def __init__(
        self,
        seq_len: int,
        paths: list[str] | str | None = None,  # one string: one path (or glob)
        val_every: int = 20,
        val_windows: int | None = 512,
        block: int = 8192,
        bytes_per_token: float = 1.0,
        shuffle: bool = True,
        seed: int = 0,
        glob_limit: int = GLOB_LIMIT,  # folder entries a glob of `paths` may look at
        **loader: Any,
    ) -> None:
        check_seq_len(seq_len)
        files = corpus_files(paths, val_every, glob_limit)
        if block < 1:
            raise ConfigError(f"data.block={block}: windows shuffled together, at least 1")
        held = held_out_files(len(files), val_every)
        train = [f for f, h in zip(files, held, strict=True) if not h]
        for path in train:  # the validation files are read whole below, with the same checks
            with open(path, "rb") as f:
                sniff_text(path, f.read(_SNIFF))
        if train and not any(os.path.getsize(f) for f in train):
            raise ConfigError(
                f"data.paths: the training files are empty ({', '.join(map(str, train[:3]))}: 0 bytes): name files "
                "that hold text"
            )
        val = None
        if any(held):
            text = b"\0".join(read_text(f) for f, h in zip(files, held, strict=True) if h)
            val = windows_or_error(np.frombuffer(text, dtype=np.uint8), seq_len, "the validation files", val_windows)
        stream = TextStreamShards(train, seq_len, seed, shuffle, block)
        super().__init__(
            stream, val=val, collate=collate_windows, tokens_per_sample=seq_len, shuffle=shuffle, seed=seed, **loader
        )
        self.info = {
            "corpus": {
                "files": len(files),
                "train_files": len(train),
                "train_bytes": sum(stream.sizes),
                "val_files": sum(held),
                "listing_sha256": stream.identity,
            }
        }
        self.bytes_per_token = bytes_per_token  # read by the model's config (val/bits_per_byte)
        self.no_val_split = no_val_split(len(files), val_every)  # for the error when a monitor needs validation
