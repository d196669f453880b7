"""A Hugging Face dataset as a corpus of documents (data=text_bytes's `dataset`, an SAE source's
`source.inputs.dataset`): a local folder written by `save_to_disk`, or local parquet / jsonl / json / arrow / csv / txt
files (globs allowed) read through `load_dataset`, never a hub name (nothing is downloaded). Each row's `text_column`
is a document; every `val_every`-th row is held out for validation, as every `val_every`-th file is for files. Rows are
streamed one at a time (datasets' streaming mode for files, a save_to_disk folder's memory-mapped table), never the
whole table in memory: a corpus larger than memory streams into runner's encoded cache, which the windows then read
memory-mapped, so resume is exact as with files. The cache is named by the files' paths, sizes and modification
times, the column and the split (a file changed in place is encoded again).

    dataset: {path: corpus/, text_column: text, split: train}
    dataset: data/*.parquet        # a path alone: text_column `text`, split `train`
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner import ConfigError, require

SPEC = {"path": None, "text_column": "text", "split": "train"}
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def spec_of(value: Any, option: str) -> dict[str, Any]:
    """The dataset setting as a full mapping (a path alone is one), its keys checked."""
    spec = {"path": value} if isinstance(value, str) else dict(value or {})
    if unknown := sorted(set(spec) - set(SPEC)):
        raise ConfigError(f"{option}: unknown key(s) {unknown}; give {', '.join(SPEC)}")
    spec = {**SPEC, **spec}
    if not isinstance(spec["path"], str) or not spec["path"]:
        raise ConfigError(f"{option}.path: name a folder written by save_to_disk, or parquet/jsonl/arrow files")
    return spec


def _files(spec: dict[str, Any], option: str) -> tuple[Path | None, list[Path]]:
    # (a save_to_disk folder, or None; the data files)
    path = os.path.expanduser(spec["path"])
    if Path(path).is_dir():
        folder = Path(path)
        if not any((folder / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise ConfigError(
                f"{option}.path={path} is a folder, but not one written by save_to_disk (no dataset_info.json or "
                "dataset_dict.json): name its data files instead, e.g. {path}/*.parquet"
            )
        return folder, sorted(p for p in folder.rglob("*") if p.is_file())
    files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
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
    return None, files


def identity(spec: dict[str, Any], option: str) -> str:
    """What names the corpus for a cache: its files (paths, sizes, modification times), the column and the split."""
    _, files = _files(spec, option)
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.dumps([stats, spec["text_column"], spec["split"]])


def _open(spec: dict[str, Any], option: str) -> Any:
    require("datasets", "datasets", option)
    import datasets  # noqa: PLC0415 - an optional extra

    folder, files = _files(spec, option)
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only: no request for a builder or a hub copy
    datasets.disable_progress_bars()
    try:
        if folder is not None:
            loaded = datasets.load_from_disk(str(folder))
            if isinstance(loaded, datasets.DatasetDict):
                if spec["split"] not in loaded:
                    raise ConfigError(f"{option}.split={spec['split']}: {folder} has the splits {sorted(loaded)}")
                loaded = loaded[spec["split"]]
            return loaded
        # streamed: rows read from the files as they are iterated, with no Arrow copy in datasets' own cache
        builder = BUILDERS[files[0].suffix]
        return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{option}.path={spec['path']}: datasets cannot read it ({first})") from None


def documents(spec: dict[str, Any], option: str) -> Iterator[bytes]:
    """Each row's text, as UTF-8 bytes, in the dataset's order."""
    table = _open(spec, option)
    column = spec["text_column"]
    columns = list(getattr(table, "column_names", None) or [])
    if columns and column not in columns:
        raise ConfigError(f"{option}.text_column={column}: the dataset's columns are {columns}; name the text one")
    for index, row in enumerate(table):
        if column not in row:
            raise ConfigError(f"{option}.text_column={column}: the dataset's columns are {sorted(row)}")
        text = row[column]
        if not isinstance(text, str):
            raise ConfigError(f"{option}.text_column={column}: row {index} holds {type(text).__name__}, not text")
        data = text.encode()
        if b"\0" in data:
            raise ConfigError(f"{option}: row {index} holds a NUL character, which separates documents")
        yield data


def held_out(index: int, val_every: int) -> bool:
    """Whether row `index` is validation text: every `val_every`-th (none for 0)."""
    return bool(val_every) and index % val_every == val_every - 1
