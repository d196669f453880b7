"""Writing a run folder's files: atomic writes (write_atomic), the one staged-folder writer (staged_folder), and the
error a full disk makes (DiskFull).

A reader never sees half of anything: a file is written under a temporary name beside its own and renamed into place;
a folder (a checkpoint, an export, a cache) is written whole under a staging name beside its own, `.NAME.partial-PID`,
and renamed into place once the block that fills it ends without an exception.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.rundir.names import OUTPUTS, SET_ASIDE


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
        with open(tmp, "wb", opener=new_file) as f:
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


def new_file(path: str, flags: int) -> int:
    """open()'s opener for a temporary file made here, never one already there nor a symlink's target."""
    # a folder handed over by someone else (a run folder is data) cannot carry the bytes elsewhere; the rename then
    # replaces a link at the final path, never follows it
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


def write_png(path: str | Path, figure: Any, dpi: int) -> Path:
    """Write a matplotlib figure as a PNG, atomically: never through a link at the file's name (a run folder may be
    anybody's)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return write_atomic(path, buffer.getvalue())


def set_aside(run_dir: str | Path, *extra: Path) -> Path | None:
    """Move the run's OUTPUTS (and `extra` paths, such as a checkpoint folder elsewhere) that exist into
    <run_dir>/before-scratch-<time>/, so that a run trained again from step 0 deletes and overwrites nothing; the
    folder they went to, or None when there was nothing."""
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


# ---- the staged-folder writer ---------------------------------------------------------------------------------------
STAGING = ".{}.partial-{}"  # the final folder's name, the writing process's pid (and `.old`: a folder it replaces)


def alive(pid: str) -> bool:
    """A process of this pid runs (its temporary files are in use); a name that is no pid is no one's."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:  # another user's
        pass
    return True


def remove(path: Path) -> None:
    """Remove a file or a link (the link alone), or a whole real folder (rmtree removes the links in it, never what
    they name); what cannot be removed is left (a failed clean-up never hides the error that made it)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.is_symlink() or path.exists():
        path.unlink(missing_ok=True)


def staged_in(folder: Path, name: str | None = None) -> list[Path]:
    """The staging folders in `folder` of the final folder `name` (or of any): being written, or left by a crash."""
    return sorted(folder.glob(STAGING.format("*" if name is None else glob.escape(name), "*")))


def _clear_stale(final: Path) -> None:
    # the staging folders of `final` whose process is dead (a name that is no pid is no one's: a planted link)
    for stale in staged_in(final.parent, final.name):
        pid = stale.name.rpartition(".partial-")[2].removesuffix(".old")
        if not alive(pid):
            remove(stale)


@contextlib.contextmanager
def staged_folder(final: Path, *, replace: bool = False, shared: bool = False, fsync: bool = False) -> Iterator[Path]:
    """A new folder beside `final` to write into, renamed to `final` once the block ends without an exception; on any
    failure (a full disk, Ctrl-C) it is removed and `final` is left as it was. A reader sees the old folder or the
    whole new one, never half of one.

    The staging folder is `.NAME.partial-PID`: those of dead processes are removed first, and this pid's (a killed
    process's of the same pid, or a planted link) is replaced. It goes onto nothing or an empty folder; a folder with
    files at `final` is an OSError (ENOTEMPTY), unless `replace`: then it is replaced, and kept until the new one is
    whole. `shared`: several processes, on several machines maybe, write the same content at once (a cache named by
    what it holds): each stages under a name of its own that no one takes for stale, the first in place is kept and
    the others' copies are dropped. `fsync`: the rename is made durable (the parent folder is fsynced).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.partial-{os.getpid()}-"))
    else:
        _clear_stale(final)
        staging = final.parent / STAGING.format(final.name, os.getpid())
        remove(staging)
    old = final.parent / STAGING.format(final.name, f"{os.getpid()}.old")
    try:
        staging.mkdir(exist_ok=shared)
        yield staging
        try:
            _put(staging, final, old if replace else None)
        except OSError:
            if not shared:
                raise
            return  # another process finished first: its copy is the same content, and ours is dropped
        if fsync:
            fsync_dir(final.parent)
        remove(old)
    finally:
        remove(staging)


def _put(staging: Path, final: Path, old: Path | None) -> None:
    # rename the whole staging folder to `final`, onto nothing or an empty folder; a folder with files there is moved
    # to `old` first (the caller removes it once the new one is in), or without `old` the rename's error says so
    try:
        os.replace(staging, final)
        return
    except OSError as error:
        if old is None or error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
    remove(old)
    os.rename(final, old)
    try:
        os.replace(staging, final)
    except BaseException:
        os.rename(old, final)  # put back: `final` is left as it was
        raise
