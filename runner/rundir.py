"""The run folder: the names of its files, atomic writes, and the readers of what runs wrote (JSON, JSONL, YAML)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any

from runner import ConfigError

# The files of a run folder (checkpoints/ holds checkpoint folders: runner.ckpt.files)
CONFIG = ".hydra/config.yaml"
OVERRIDES = ".hydra/overrides.yaml"
RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
MODEL = "model.safetensors"
MODEL_PART = "model.{}.safetensors"  # one part of a task made of several models (an SAE of a family)
CHECKPOINTS = "checkpoints"
LOG = "runner.log"  # what rank 0 printed (runner.log.tee); Hydra names it after hydra.job.name
RANK_LOG = "logs/rank-{}.log"  # each rank's warnings and errors (runner.log.ranks), the only file other ranks write


class DiskFull(ConfigError):
    """A write failed for lack of space (ENOSPC, a quota's EDQUOT, or EFBIG: a file over the process's size limit).
    A ConfigError, so the CLI exits 2 with one paragraph: a full disk needs a person to free space; an automatic
    requeue (exit 75) would only fail the same way again. Atomic writes leave the earlier files whole, so resume=auto
    goes on from the newest checkpoint once there is room."""

    errno = errno.ENOSPC  # which of the three: the advice differs (free space, or raise the size limit)


# EFBIG is a full disk for this purpose: the write stops at the same point, and only a person can give it room (Python
# ignores SIGXFSZ, so the write fails with EFBIG instead of the process being killed)
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_FULL[errno.EFBIG] = "file too large: it reached this process's file-size limit, `ulimit -f`"


def disk_full(
    what: str,
    kept: str = "what was written before is intact",
    then: str = "continue the run with resume=auto hydra.run.dir=<the run folder>",
    error: BaseException | None = None,
) -> DiskFull:
    """The error for a write that found no space left (`what`: what was being written), naming the way out (`then`:
    what to do once there is room; the tools that read a run folder say to run them again). `error`: the failed
    write's (default: the exception being handled), which tells a full disk from a quota or the file-size limit."""
    cause = sys.exc_info()[1] if error is None else error
    code = cause.errno if isinstance(cause, DiskFull | OSError) and cause.errno in _FULL else errno.ENOSPC
    fix = "Raise the limit (ulimit -f unlimited, or the job scheduler's file-size setting)"
    made = DiskFull(
        f"disk full: {what} failed ({_FULL[code]}); {kept}. "
        f"{fix if code == errno.EFBIG else 'Free space on that disk'}, then {then}"
    )
    made.errno = code
    return made


def is_disk_full(error: BaseException) -> bool:
    """`error` says the disk is full (an ENOSPC, EDQUOT or EFBIG, or the DiskFull that write_atomic made of one)."""
    return isinstance(error, DiskFull) or (isinstance(error, OSError) and error.errno in _FULL)


def write_atomic(path: str | Path, data: bytes, fsync: bool = False) -> Path:
    """Write `data` under a temporary name beside `path`, then rename it into place: a reader never sees half a file.

    With `fsync` the data is on disk before the rename, so a crash (not only a killed process) leaves the old file or
    the new one. The temporary name is unique to this process, so parallel writers cannot clobber each other's; it is
    removed on any failure. Neither name is followed if it is a symlink (the rename replaces a link at `path`). A full
    disk raises DiskFull.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a killed process of the same pid, or planted: a link is removed, not followed
    try:
        with open(tmp, "wb", opener=_new_file) as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(error):
            raise
        # A full disk fails every write after the first (the CLI's summary.json of the failure too): the first
        # report names what was being saved, so it is the one to read
        earlier = error.__context__
        raise (earlier if isinstance(earlier, DiskFull) else disk_full(f"writing {path}")) from None
    return path


def _new_file(path: str, flags: int) -> int:
    # a file made here, never one already there nor a symlink's target: a folder handed over by someone else (a run
    # folder is data) cannot carry the bytes elsewhere; the rename then replaces a link at `path`, never follows it
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW, 0o666)


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


MAX_JSON_BYTES = 64 << 20  # a run folder's JSON files are small; a larger one is not what a run wrote


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


# What a run leaves in its folder; resume=scratch moves these aside before training again from step 0
OUTPUTS = (CHECKPOINTS, f"{METRICS}*", SUMMARY, RUN_INFO, "run-resumed-at-*.json", "model*.safetensors*")
SET_ASIDE = "before-scratch-{}"


def set_aside(run_dir: str | Path, *extra: Path) -> Path | None:
    """Move the run's OUTPUTS (and `extra` paths, such as a checkpoint folder elsewhere) that exist into
    <run_dir>/before-scratch-<time>/, so that a run trained again from step 0 deletes and overwrites nothing; the
    folder they went to, or None when there was nothing."""
    import shutil

    run_dir = Path(run_dir)
    found = [p for pattern in OUTPUTS for p in sorted(run_dir.glob(pattern))] + [p for p in extra if p.exists()]
    if not found:
        return None
    aside = run_dir / SET_ASIDE.format(time.strftime("%Y%m%d-%H%M%S"))
    aside.mkdir()
    for path in dict.fromkeys(found):
        if path.exists():  # an `extra` path may be one of OUTPUTS, moved already
            shutil.move(path, aside / path.name)
    return aside


def read_yaml(path: str | Path) -> Any:
    """A YAML file's contents (plain data only: safe_load), or None if it is missing or unreadable."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


# Shipped tasks' modules that moved (experiments/sae grouped into coders/, sources/, pages/ and formats, 2026-11-27): an
# older run folder's config names a class by its old module; it is read as the new one, so the folder still loads (and
# is still checked as data: the new name must be marked buildable like any other).
MOVED = {
    "experiments.sae.base": "experiments.sae.coders.base",
    "experiments.sae.model": "experiments.sae.coders.activations",
    "experiments.sae.jumprelu": "experiments.sae.coders.jumprelu",
    "experiments.sae.matryoshka": "experiments.sae.coders.matryoshka",
    "experiments.sae.multi": "experiments.sae.coders.multi",
    "experiments.sae.clt": "experiments.sae.coders.clt",
    "experiments.sae.hooked": "experiments.sae.sources.hooked",
    "experiments.sae.files": "experiments.sae.sources.files",
    "experiments.sae.data": "experiments.sae.sources.synthetic",
}
_MOVED_TARGET = re.compile(r"^(\s*(?:- )?_target_:\s*['\"]?)(experiments\.sae\.\w+)(\.\w+['\"]?\s*)$", re.MULTILINE)


def moved(text: str) -> str:
    """A run config's text with each `_target_` of a moved module named by its new one (MOVED)."""
    return _MOVED_TARGET.sub(lambda m: m.group(1) + MOVED.get(m.group(2), m.group(2)) + m.group(3), text)


def moved_target(target: Any) -> Any:
    """A `_target_` value named by its module's new name (MOVED); any other value as it is."""
    if not isinstance(target, str):
        return target
    module, _, name = target.rpartition(".")
    return f"{MOVED[module]}.{name}" if module in MOVED else target


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
    if "run_dir" in cfg:
        cfg.run_dir = str(run_dir)
    return cfg


MAX_CONFIG_BYTES = 16 << 20  # a composed config is kilobytes; this bounds what a run folder from elsewhere costs


def _bounded_yaml(config: Path) -> str:
    # A run folder may be anybody's: a YAML alias (*x) names a node again, and a kilobyte of nested aliases expands to
    # billions of nodes when the config is built. OmegaConf.save never writes one, so a config that has one is refused.
    import yaml

    with open(config, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{config} is over {MAX_CONFIG_BYTES >> 20} MB: not a config runner wrote")
    text = data.decode("utf-8")
    if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
        raise ConfigError(
            f"{config} uses YAML aliases (*name), which runner never writes: refused (a few lines of them "
            "can expand to billions of values)"
        )
    return text


LOCK = ".lock"
CLASH = "clash"  # runner.resolvers writes a refused launch's Hydra files to .hydra/clash-*


class FolderInUse(ConfigError):
    """A run (or sweep) folder that another run holds, or holds a finished run this launch would mix into."""


_held: dict[str, Any] = {}  # the open lock files of this process: a lock lives as long as its file stays open


def lock(folder: str | Path, what: str) -> None:
    """Hold an exclusive lock on `folder` for the rest of this process (or until unlock), or raise ConfigError naming
    the pid that holds it. The kernel drops the lock when its holder dies: a killed run's folder can be resumed at
    once (its stale .lock file is taken over)."""
    import fcntl

    path = Path(folder) / LOCK
    if str(path) in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        file = open(path, "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise FolderInUse(
                f"{what} {folder} is in use by another process (pid {holder}), which would interleave its files with "
                "this one's: wait for it to finish, or choose another folder (a new run gets one of its own by default)"
            ) from None
        # unlock removes the file: a lock taken on a file its holder had just removed guards nothing, so take the
        # one now at `path` instead
        try:
            if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        file.close()
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    _held[str(path)] = file


def unlock(folder: str | Path) -> None:
    """Release lock(folder) and remove its file, so that a finished run's folder holds only its results."""
    path = Path(folder) / LOCK
    file = _held.pop(str(path), None)
    if file is not None:
        path.unlink(missing_ok=True)  # while still holding it: no one can take a lock on a file about to vanish
        file.close()


def claim(run_dir: str | Path, hydra_subdir: str | None) -> None:
    """Make `run_dir` this launch's: refuse a new run pointed at a folder that holds another run (Hydra then wrote
    this launch's files under .hydra/clash-*, removed here), and lock it against a second writer."""
    import shutil

    if hydra_subdir and Path(hydra_subdir).name.startswith(CLASH):
        shutil.rmtree(Path(run_dir) / hydra_subdir, ignore_errors=True)
        raise FolderInUse(
            f"run folder {run_dir} already holds a run: continue it with resume=auto, or leave hydra.run.dir out "
            "(a new run gets a folder of its own), or name a new folder"
        )
    lock(run_dir, "run folder")
