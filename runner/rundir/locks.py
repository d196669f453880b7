"""The one folder lock: an flock on a file in the folder (`.lock`) that holds its holder's pid. The kernel drops it when
its holder dies, so a killed process's folder is free at once (its stale file is taken over); the file is removed when
the lock is released, so a finished folder holds only its results.

- lock(folder, what) / unlock(folder): a run or a sweep holds its folder for the rest of the process; a second one is
  refused at once (FolderInUse, naming the pid that holds it).
- locked(folder): one writer at a time for the block, the others waiting their turn (an activation cache's writer,
  a sweep's results.csv).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from runner import ConfigError
from runner.rundir.names import CLASH, LOCK


class FolderInUse(ConfigError):
    """A run (or sweep) folder that another run holds, or holds a finished run this launch would mix into."""


class _Held(Exception):
    # another process holds the lock (a non-waiting take): its pid as its file says, or "unknown"
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


_held: dict[str, IO[str]] = {}  # the open lock files of this process: a lock lives as long as its file stays open


def _take(path: Path, wait: bool) -> IO[str]:
    """flock `path` (made if missing) for this process and write its pid in it: the open file, which holds the lock
    until it is closed. Waits while another process holds it, or (not `wait`) raises _Held naming that process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        file = open(path, "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise _Held(holder) from None
        except BaseException:  # Ctrl-C while waiting
            file.close()
            raise
        # _release removes the file: a lock taken on a file its holder had just removed guards nothing, so take the
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
    return file


def _release(path: Path, file: IO[str]) -> None:
    path.unlink(missing_ok=True)  # while still holding it: no one can take a lock on a file about to vanish
    file.close()


def lock(folder: str | Path, what: str) -> None:
    """Hold an exclusive lock on `folder` for the rest of this process (or until unlock), or raise ConfigError naming
    the pid that holds it. The kernel drops the lock when its holder dies: a killed run's folder can be resumed at
    once (its stale .lock file is taken over)."""
    path = Path(folder) / LOCK
    if str(path) in _held:
        return
    try:
        _held[str(path)] = _take(path, wait=False)
    except _Held as held:
        raise FolderInUse(
            f"{what} {folder} is in use by another process (pid {held.holder}), which would interleave its files with "
            "this one's: wait for it to finish, or choose another folder (a new run gets one of its own by default)"
        ) from None


def unlock(folder: str | Path) -> None:
    """Release lock(folder) and remove its file, so that a finished run's folder holds only its results."""
    path = Path(folder) / LOCK
    file = _held.pop(str(path), None)
    if file is not None:
        _release(path, file)


@contextlib.contextmanager
def locked(folder: str | Path, name: str = LOCK) -> Iterator[None]:
    """Hold the lock `name` on `folder` for the block, waiting while another process holds it (the kernel releases
    a dead holder's). Inside a lock(folder) of this process already, it is that one's."""
    path = Path(folder) / name
    if str(path) in _held:
        yield
        return
    file = _take(path, wait=True)
    try:
        yield
    finally:
        _release(path, file)


def claim(run_dir: str | Path, hydra_subdir: str | None) -> None:
    """Make `run_dir` this launch's: refuse a new run pointed at a folder that holds another run (Hydra then wrote
    this launch's files under .hydra/clash-*, removed here), and lock it against a second writer."""
    if hydra_subdir and Path(hydra_subdir).name.startswith(CLASH):
        shutil.rmtree(Path(run_dir) / hydra_subdir, ignore_errors=True)
        raise FolderInUse(
            f"run folder {run_dir} already holds a run: continue it with resume=auto, or leave hydra.run.dir out "
            "(a new run gets a folder of its own), or name a new folder"
        )
    lock(run_dir, "run folder")
