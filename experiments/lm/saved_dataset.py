"""A folder written by Hugging Face datasets' `save_to_disk`, checked before datasets opens anything in it: its JSON
files are small JSON objects, and the data files its state.json names are regular files inside it. A folder is data
from anywhere: a state.json naming a FIFO would block the read for ever, a device (/dev/zero) never end it, and
`../` or an absolute name would read files elsewhere."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from runner import ConfigError
from runner.rundir import MAX_CONFIG_BYTES


def saved_folder(folder: Path, split: str, option: str) -> tuple[Path, list[Path]]:
    """The folder of one save_to_disk dataset (a DatasetDict's `split`) and the files that loading it reads (state,
    info, data), each checked to be a regular file inside it before anything is opened: a forged state.json that
    names a FIFO, a device or a file elsewhere is refused by name."""
    names = ("dataset_info.json", "dataset_dict.json", "state.json")
    if not any(os.path.lexists(folder / name) for name in names):
        raise ConfigError(
            f"{option}.path={folder} is a folder, but not one written by save_to_disk (no dataset_info.json or "
            f"dataset_dict.json): name its data files instead, e.g. {folder}/*.parquet"
        )
    if os.path.lexists(folder / "dataset_dict.json"):
        splits = _small_json(folder / "dataset_dict.json", option).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) and _inside(s) for s in splits):
            raise _forged(
                folder / "dataset_dict.json", f"its splits are {repr(splits)[:200]}, not a list of folder names", option
            )
        if split not in splits:
            raise ConfigError(f"{option}.split={split}: {folder} has the splits {sorted(splits)}")
        folder = folder / split
    state = _small_json(folder / "state.json", option)
    _regular(folder / "dataset_info.json", option, MAX_CONFIG_BYTES)
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise _forged(folder / "state.json", "it lists no data files (_data_files: [{filename: ...}])", option)
    data = []
    for entry in entries:
        name = entry.get("filename")
        if not isinstance(name, str) or not _inside(name):
            raise _forged(
                folder / "state.json", f"it names the data file {repr(name)[:200]}, not a file in {folder}", option
            )
        data.append(_regular(folder / name, option))
    return folder, [folder / "state.json", folder / "dataset_info.json", *data]


def _inside(name: str) -> bool:
    # a relative name with no way out of the folder it is joined to
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and path != PurePosixPath(".")


def file_kind(path: Path) -> str:
    """What `path` is, told by stat: a folder, a FIFO, a socket, a device (or why stat failed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        return error.strerror or "unreadable"
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    kinds += [(stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((what for test, what in kinds if test(mode)), "not a plain file")


def _regular(path: Path, option: str, most: int | None = None) -> Path:
    # `path` if it is a regular file (a link to one too) of at most `most` bytes; told by stat, never by opening it
    # (a FIFO would block the read for ever, a device never end it)
    try:
        info = os.stat(path)
    except OSError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        if info is None and not os.path.lexists(path):
            raise _forged(path, "it is missing", option)
        raise _forged(path, f"it is {file_kind(path)}, not a regular file; refused without opening it", option)
    if most is not None and info.st_size > most:
        raise _forged(path, f"it is {info.st_size:,} bytes, more than the {most >> 20} MB save_to_disk writes", option)
    return path


def _small_json(path: Path, option: str) -> dict[str, Any]:
    # a save_to_disk folder's JSON file, read whole once it is known to be a small regular file
    _regular(path, option, MAX_CONFIG_BYTES)
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep
        raise _forged(path, f"it is not readable JSON ({str(error).splitlines()[0][:200]})", option) from None
    if not isinstance(value, dict):
        raise _forged(path, f"it holds a {type(value).__name__}, not a JSON object", option)
    return value


def _forged(path: Path, why: str, option: str) -> ConfigError:
    return ConfigError(
        f"{option}.path: {path} is not as dataset.save_to_disk writes it ({why}): write the dataset again with "
        "dataset.save_to_disk(DIR), or name its data files (parquet, jsonl, arrow) instead"
    )
