"""The run folder: the names of its files, atomic writes, and the readers of what runs wrote (JSON, JSONL, YAML)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The files of a run folder (checkpoints/ holds checkpoint folders: runner.ckpt.files)
CONFIG = ".hydra/config.yaml"
OVERRIDES = ".hydra/overrides.yaml"
RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
MODEL = "model.safetensors"
CHECKPOINTS = "checkpoints"
LOG = "runner.log"  # what rank 0 printed (runner.log.tee); Hydra names it after hydra.job.name


def write_atomic(path: str | Path, data: bytes, fsync: bool = False) -> Path:
    """Write `data` under a temporary name beside `path`, then rename it into place: a reader never sees half a file.

    With `fsync` the data is on disk before the rename, so a crash (not only a killed process) leaves the old file or
    the new one. The temporary name is unique to this process, so parallel writers cannot clobber each other's.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def fsync_dir(path: str | Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write `data` as indented JSON, atomically."""
    return write_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON file's contents, or None if it is missing or unreadable (not there yet, or being replaced)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (metrics.jsonl); a line cut in half (a run still writing, or killed) is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_yaml(path: str | Path) -> Any:
    """A YAML file's contents (plain data only: safe_load), or None if it is missing or unreadable."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
