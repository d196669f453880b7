"""A Hugging Face dataset as a corpus of documents (data=text_bytes's `dataset`, an SAE source's
`source.inputs.dataset`): a local folder written by `save_to_disk`, or local parquet / jsonl / json / arrow / csv / txt
files (globs allowed) read through `load_dataset`, never a hub name (nothing is downloaded). Each row's `text_column`
is a document; every `val_every`-th row is held out for validation, as every `val_every`-th file is for files. Rows are
streamed one at a time (datasets' streaming mode for files, a save_to_disk folder's memory-mapped table), never the
whole table in memory: a corpus larger than memory streams into runner's encoded cache, which the windows then read
memory-mapped, so resume is exact as with files. The cache is named by the files' paths, sizes and modification
times, the column and the split (a file changed in place is encoded again).

Data is anybody's: a save_to_disk folder is checked before anything in it is opened (experiments.lm.saved_dataset), a
glob looks at no more than `glob_limit` folder entries, and a file the readers cannot read is a ConfigError naming it
(and its line, where one is to blame), never their traceback.

    dataset: {path: corpus/, text_column: text, split: train}
    dataset: data/*.parquet        # a path alone: text_column `text`, split `train`
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.lm.corpus import GLOB_LIMIT, bounded_glob
from experiments.lm.saved_dataset import file_kind, saved_folder
from runner import ConfigError, check_whole, require

# glob_limit: the folder entries a glob in `path` may look at (experiments.lm.corpus.bounded_glob)
SPEC = {"path": None, "text_column": "text", "split": "train", "glob_limit": GLOB_LIMIT}
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def spec_of(value: Any, option: str) -> dict[str, Any]:
    """The dataset setting as a full mapping (a path alone is one), its keys checked."""
    spec = {"path": value} if isinstance(value, str) else dict(value or {})
    if unknown := sorted(set(spec) - set(SPEC)):
        raise ConfigError(f"{option}: unknown key(s) {unknown}; give {', '.join(SPEC)}")
    spec = {**SPEC, **spec}
    if not isinstance(spec["path"], str) or not spec["path"]:
        raise ConfigError(f"{option}.path: name a folder written by save_to_disk, or parquet/jsonl/arrow files")
    check_whole(spec["glob_limit"], f"{option}.glob_limit")
    return spec


def _files(spec: dict[str, Any], option: str) -> tuple[Path | None, list[Path]]:
    # (a save_to_disk folder, or None; the files that are read: the folder's state, info and data files, or the data
    # files that `path` names)
    path = os.path.expanduser(spec["path"])
    if Path(path).is_dir():
        return saved_folder(Path(path), spec["split"], option)
    found = bounded_glob(path, spec["glob_limit"], f"{option}.path", f"{option}.glob_limit")
    files = sorted(p for p in found if p.is_file())
    if not files and any(not p.is_dir() for p in found):
        other = next(p for p in found if not p.is_dir())
        raise ConfigError(
            f"{option}.path={path}: {other} is {file_kind(other)}, not a regular file; refused without opening it: "
            "name data files (parquet, jsonl, arrow, csv, txt)"
        )
    if not files:
        raise ConfigError(
            f"{option}.path={path} names no local file or folder (relative paths start at {os.getcwd()}); runner "
            "reads datasets from disk only: save one with dataset.save_to_disk(DIR), or name its parquet/jsonl files"
        )
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise ConfigError(
            f"{option}.path={path}: files of one kind, {', '.join(sorted(BUILDERS))}; got "
            f"{sorted({p.suffix or p.name for p in files})}"
        )
    if empty := [p for p in files if p.stat().st_size == 0]:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ConfigError(
            f"{option}.path={path}: {empty[0]}{more} is empty (0 bytes), and a data file must hold rows: remove it, "
            f"or narrow {option}.path to the files that hold data"
        )
    return None, files


def identity(spec: dict[str, Any], option: str) -> str:
    """What names the corpus for a cache: its files (paths, sizes, modification times), the column and the split."""
    _, files = _files(spec, option)
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.dumps([stats, spec["text_column"], spec["split"]])


def _open(folder: Path | None, files: list[Path]) -> Any:
    # the rows: a save_to_disk dataset memory-mapped (read as plain Python values, whatever format its state.json
    # asks), or the files streamed: read as they are iterated, with no Arrow copy in datasets' own cache
    import datasets  # noqa: PLC0415 - an optional extra

    if folder is not None:
        return datasets.load_from_disk(str(folder)).with_format(None)
    return _stream(files)


def _stream(files: list[Path]) -> Any:
    import datasets  # noqa: PLC0415 - an optional extra

    builder = BUILDERS[files[0].suffix]
    return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True)


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    # Local files only (no request for a builder or a hub copy), no progress bars, and none of datasets' own error
    # lines: each says again, less clearly, what the ConfigError says
    import datasets  # noqa: PLC0415 - an optional extra

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets.disable_progress_bars()
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def documents(spec: dict[str, Any], option: str) -> Iterator[bytes]:
    """Each row's text, as UTF-8 bytes, in the dataset's order; a file that cannot be read is a ConfigError naming
    it (and its line, where one line is to blame)."""
    require("datasets", "datasets", option)
    folder, files = _files(spec, option)
    with _reading():
        try:
            table = _open(folder, files)
            rows = iter(table)
        except Exception as error:  # datasets and pyarrow raise many kinds for a folder they cannot read
            raise _unreadable(spec, option, folder, files, error) from None
        yield from _texts(table, rows, spec, option, folder, files)


def _texts(
    table: Any, rows: Iterator, spec: dict[str, Any], option: str, folder: Path | None, files: list[Path]
) -> Iterator[bytes]:
    # each row's text, checked; a row the reader cannot give is a ConfigError naming where
    column = spec["text_column"]
    columns = list(getattr(table, "column_names", None) or [])
    if columns and column not in columns:
        raise ConfigError(f"{option}.text_column={column}: the dataset's columns are {columns}; name the text one")
    index = -1
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as error:  # pyarrow, pandas and datasets raise many kinds for a file they cannot read
            raise _unreadable(spec, option, folder, files, error) from None
        index += 1
        if column not in row:
            raise ConfigError(f"{option}.text_column={column}: the dataset's columns are {sorted(row)}")
        text = row[column]
        if not isinstance(text, str):
            raise ConfigError(f"{option}.text_column={column}: row {index} holds {type(text).__name__}, not text")
        data = text.encode()
        if b"\0" in data:
            raise ConfigError(f"{option}: row {index} holds a NUL character, which separates documents")
        yield data


def _unreadable(
    spec: dict[str, Any], option: str, folder: Path | None, files: list[Path], error: Exception
) -> ConfigError:
    """What to say when datasets cannot read the data: the file to blame (each file is read alone to find it) and,
    for text files, its first line that is not UTF-8 or not a JSON object."""
    head = f"{option}.path={spec['path']}"
    if isinstance(error, ConfigError):
        return error
    if folder is not None:
        return ConfigError(
            f"{head}: datasets cannot read the save_to_disk folder {folder} ({_first_line(error)}): write the dataset "
            "again with dataset.save_to_disk(DIR), or name its data files instead"
        )
    builder = BUILDERS[files[0].suffix]
    culprit = (files[0], error) if len(files) == 1 else _culprit(files)
    if culprit is None:  # each file reads alone: they do not fit together (columns of other types, say)
        return ConfigError(
            f"{head}: datasets cannot read these {len(files)} {builder} files together ({_first_line(error)}): "
            f"give files of the same columns and types, or narrow {option}.path"
        )
    path, why = culprit
    line = _bad_line(path) if builder in ("json", "csv", "text") else None
    if line is not None:
        number, what, fix = line
        return ConfigError(f"{head}: {path} line {number} is {what}: {fix}, or leave that file out of {option}.path")
    return ConfigError(
        f"{head}: {path} cannot be read as {builder} ({_first_line(why)}): fix or replace that file, or leave it out "
        f"of {option}.path"
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__


def _culprit(files: list[Path]) -> tuple[Path, Exception] | None:
    # the first file that fails read alone, with its error (the reader's error of several files names none)
    for path in files:
        try:
            for _ in _stream([path]):
                pass
        except Exception as error:  # one try per file: the point is which one fails
            return path, error
    return None


def _bad_line(path: Path) -> tuple[int, str, str] | None:
    # (line number, what is wrong, the fix) of the first line of a text file that is not UTF-8, or, in a .jsonl file,
    # not one JSON object
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as error:
                return (
                    number,
                    f"not UTF-8 text (at byte {error.start + 1} of the line)",
                    "datasets reads UTF-8: convert the file",
                )
            if path.suffix != ".jsonl" or not text.strip():
                continue
            try:
                row = json.loads(text.rstrip("\r\n"))
            except (ValueError, RecursionError) as error:
                return number, f"not JSON ({_first_line(error)})", 'each line must be one JSON object ({"text": ...})'
            if not isinstance(row, dict):
                kind = type(row).__name__
                return number, f"a JSON {kind}, not an object", 'each line must be one JSON object ({"text": ...})'
    return None


def held_out(index: int, val_every: int) -> bool:
    """Whether row `index` is validation text: every `val_every`-th (none for 0)."""
    return bool(val_every) and index % val_every == val_every - 1
