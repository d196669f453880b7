"""Reading what runs wrote: JSON, JSONL and YAML files, and a run folder's config. A run folder may be anybody's, so
each reader is bounded: a FIFO, a device, a huge file or a YAML alias bomb is refused, never read."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.rundir.names import CONFIG
from runner.rundir.old_names import moved, upgraded, upgrades

MAX_JSON_BYTES = 64 << 20  # a run folder's JSON files are small; a larger one is not what a run wrote
MAX_CONFIG_BYTES = 16 << 20  # a composed config is kilobytes; this bounds what a run folder from elsewhere costs


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON file's contents, or None if it is missing or unreadable (not there yet, being replaced, or not a file a
    run wrote: a FIFO or a device would block or never end, JSON nested past Python's recursion limit)."""
    try:
        with open(path, "rb", opener=_nonblocking) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_JSON_BYTES:
                return None
            return json.loads(f.read(MAX_JSON_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _nonblocking(path: str, flags: int) -> int:
    # opening a FIFO for reading blocks until a writer comes; O_NONBLOCK returns at once (and is harmless on a file)
    return os.open(path, flags | os.O_NONBLOCK)


def jsonl_lines(data: bytes) -> list[tuple[bytes, dict[str, Any] | None]]:
    """Each line of a JSONL file's bytes with its row, or None where the line is not a JSON object in UTF-8."""
    lines = []
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
            row = None
        lines.append((line, row if isinstance(row, dict) else None))
    return lines


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (metrics.jsonl). A last line cut in half (a run still writing it) is skipped quietly;
    any other unreadable line is skipped with a warning (a resume keeps its bytes: runner.log.jsonl)."""
    try:
        lines = jsonl_lines(Path(path).read_bytes())
    except OSError:
        return []
    bad = [n for n, (line, row) in enumerate(lines, 1) if row is None and line.strip() and line.endswith(b"\n")]
    if bad:
        print(f"warning: {path}: line(s) {bad[:5]} are not JSON rows; skipped", file=sys.stderr)
    return [row for _, row in lines if row is not None]


def read_yaml(path: str | Path) -> Any:
    """A YAML file's contents (plain data only: safe_load), or None if it is missing or unreadable."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def read_run_config(run_dir: Path) -> Any:
    """A run folder's .hydra/config.yaml as a DictConfig, unresolved, with `run_dir` as the folder the run is in now
    (Hydra's output folder when it ran); a ConfigError if it is not a readable YAML mapping."""
    from omegaconf import DictConfig, OmegaConf

    config = run_dir / CONFIG
    if not config.is_file():  # a FIFO or a device would hang the read or never end it
        raise ConfigError(f"{config} is not a file: is {run_dir} the folder of a runner run?")
    try:
        text = _bounded_yaml(config)
        cfg = OmegaConf.create(moved(text))
    except ConfigError:
        raise
    except Exception as error:  # not UTF-8, not YAML, a bare value: omegaconf and yaml raise several kinds
        raise ConfigError(f"{config} is not a readable YAML config ({' '.join(str(error).split())})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{config} holds a list, not a config mapping: is {run_dir} the folder of a runner run?")
    if any(f".{name.rpartition('.')[2]}" in text for name in upgrades()):  # a class whose options changed shape
        cfg = OmegaConf.create(upgraded(OmegaConf.to_container(cfg, resolve=False)))
    if "run_dir" in cfg:
        cfg.run_dir = str(run_dir)
    return cfg


def _bounded_yaml(config: Path) -> str:
    # A run folder may be anybody's: a YAML alias (*x) names a node again, and a kilobyte of nested aliases expands to
    # billions of nodes when the config is built. OmegaConf.save never writes one, so a config that has one is refused.
    import yaml

    with open(config, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{config} is over {MAX_CONFIG_BYTES >> 20} MB: not a config runner wrote")
    text = data.decode("utf-8")
    # libyaml's parser where PyYAML was built with it: the same events, ten times sooner than the Python one
    parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=parser)):
        raise ConfigError(
            f"{config} uses YAML aliases (*name), which runner never writes: refused (a few lines of them "
            "can expand to billions of values)"
        )
    return text
