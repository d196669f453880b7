"""The caches of encoded text (data=text_bytes' corpus, a transformers source's tokens): each a folder named by its
content's hash, written once by a staged rename, so a second run reads it back and a killed one leaves nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.lm import hf_datasets
from experiments.lm.corpus import held_out_files, read_text
from runner import ConfigError
from runner.rundir import disk_full, is_disk_full, staged_folder

_FORMAT = 2  # of text_bytes' cache files: a change makes new keys, never reads an old layout (2: held_out_files' rule)


def cache_root(cache_dir: str | None, kind: str) -> Path:
    """Where a cache of `kind` (text_bytes, tokens) lives: `cache_dir`, else ~/.cache/runner/<kind> (XDG_CACHE_HOME)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runner" / kind


def content_key(prefix: str, texts: list[bytes]) -> str:
    """The sha256 of `prefix` (what else decides the cache's content) and the texts, each with its length."""
    digest = hashlib.sha256(prefix.encode())
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
    return digest.hexdigest()


def encode_corpus(
    files: list[str | Path] | str | Path, val_every: int, cache_dir: str | None = None
) -> tuple[Path, dict[str, Any]]:
    """Encode the files as bytes into <cache>/<content hash>/{train,val}.u8 (every `val_every`-th file held out for
    validation, files separated by a NUL byte) unless that folder exists; return it and the corpus's facts. One path
    (a str or a Path) is one file."""
    # a str is iterable too: iterated, it was a list of one-character paths (an AttributeError on the first)
    files = [Path(files)] if isinstance(files, str | os.PathLike) else [Path(f) for f in files]
    texts = [read_text(f) for f in files]
    key = content_key(f"{_FORMAT}:{val_every}:", texts)
    folder = cache_root(cache_dir, "text_bytes") / key[:16]
    if not (folder / "meta.json").is_file():
        held_out = held_out_files(len(texts), val_every)
        val = [t for t, held in zip(texts, held_out, strict=True) if held]
        train = [t for t, held in zip(texts, held_out, strict=True) if not held]

        def fill(scratch: Path) -> None:
            (scratch / "train.u8").write_bytes(b"\0".join(train))
            (scratch / "val.u8").write_bytes(b"\0".join(val))
            meta = {"sha256": key, "files": len(files), "bytes": sum(map(len, texts)), "val_files": len(val)}
            (scratch / "meta.json").write_text(json.dumps(meta))

        write_once(folder, fill, "data.cache_dir")
    meta = json.loads((folder / "meta.json").read_text())
    return folder, {**meta, "cache": str(folder)}


def encode_dataset(spec: dict[str, Any], val_every: int, cache_dir: str | None = None) -> tuple[Path, dict[str, Any]]:
    """encode_corpus for a Hugging Face dataset (experiments/lm/hf_datasets.py): its rows streamed into
    <cache>/<key>/{train,val}.u8, every `val_every`-th row held out, rows separated by a NUL byte; the cache is named
    by the dataset's files, column and split."""
    key = content_key(f"{_FORMAT}:{val_every}:dataset:{hf_datasets.identity(spec, 'data.dataset')}", [])
    folder = cache_root(cache_dir, "text_bytes") / key[:16]
    if not (folder / "meta.json").is_file():

        def fill(scratch: Path) -> None:
            rows = held = size = 0
            with open(scratch / "train.u8", "wb") as train, open(scratch / "val.u8", "wb") as val:
                for rows, text in enumerate(hf_datasets.documents(spec, "data.dataset"), 1):
                    out = val if hf_datasets.held_out(rows - 1, val_every) else train
                    out.write(text if out.tell() == 0 else b"\0" + text)
                    held, size = held + (out is val), size + len(text)
            meta = {"sha256": key, "rows": rows, "bytes": size, "val_files": held, "val_rows": held}
            (scratch / "meta.json").write_text(json.dumps(meta))

        write_once(folder, fill, "data.cache_dir")
    meta = json.loads((folder / "meta.json").read_text())
    return folder, {**meta, "cache": str(folder)}


def write_once(folder: Path, fill: Callable[[Path], None], option: str) -> None:
    """Make `folder` (a cache named by its content) by `fill`ing a scratch folder staged beside it and renaming it into
    place (runner.rundir.staged_folder, shared: every rank of a torchrun job may write it at once, and the first copy
    in place is kept): a killed or concurrent writer never leaves a half-written cache that a later run would trust.
    `option` names the setting that chose where, for the error when it cannot be written."""
    with contextlib.ExitStack() as stack:
        try:
            scratch = stack.enter_context(staged_folder(folder, shared=True))
        except OSError as error:
            raise ConfigError(
                f"{option}: cannot make the cache folder {folder.parent} ({error.strerror}): name a folder you can "
                f"write, or {option}=null (~/.cache/runner)"
            ) from None
        try:
            fill(scratch)
        except BaseException as error:  # a refused row, a full disk, Ctrl-C: the cache is left as it was
            if is_disk_full(error):
                raise disk_full(
                    f"writing the cache {folder}",
                    "nothing was left in the cache",
                    f"run the same command again (or put the cache on another disk: {option}=DIR)",
                ) from None
            raise
