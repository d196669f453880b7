"""The folders written by the tools that read a run folder (runner.tools.features, runner.tools.export). A run folder
is data: anyone can hand one over, with symlinks in it, so none of them carries the tools' output elsewhere.

- A folder the user typed (out=DIR, --out DIR) is theirs, wherever it is. The default one (RUN_DIR/features,
  RUN_DIR/export-FORMAT), or a typed one inside the run folder, must resolve to a place inside the run folder.
- Inside an output folder nothing is followed: files are renamed into place (runner.rundir.write_atomic), which replaces
  a link at a file's name, and make_dir replaces a link at a folder's name with a real folder; a folder is made real
  before anything in it is listed or removed (what a link names is someone else's, never stale output).
- An export is written into a folder beside its own and renamed into place once whole (runner.rundir.staged_folder):
  a killed export leaves nothing in the way of the next, which clears what the dead one left beside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from runner import ConfigError
from runner.rundir.files import DiskFull, alive, disk_full, is_disk_full, remove


def output_folder(run_dir: Path, typed: str | Path | None, default: str, flag: str) -> Path:
    """The folder a tool writes, resolved: `typed` (what the user gave as `flag`, e.g. "out=") or run_dir/`default`;
    a ConfigError for a file there, or for a symlink in the run folder that leads out of it."""
    out = Path(typed) if typed is not None else run_dir / default
    try:
        return _checked(out, run_dir, typed is None, flag)
    except OSError as error:  # a name too long, a folder that cannot be read
        raise ConfigError(f"{out} cannot be written ({error.strerror}): give another folder with {flag}DIR") from None


def _checked(out: Path, run_dir: Path, default: bool, flag: str) -> Path:
    run, real = Path(os.path.abspath(run_dir)).resolve(), out.resolve()
    # inside the run folder however it is spelled (RUN through a link, or its real path): some folder on the way to
    # `out` is the run folder or in it, and from there on the run folder's links are its author's
    typed = Path(os.path.abspath(out))
    if default or any(p.resolve().is_relative_to(run) for p in (typed, *typed.parents) if p.exists()):
        if not real.is_relative_to(run):
            raise ConfigError(
                f"{out} leads to {real}, outside the run folder {run_dir}, through a symlink in the run folder: a run "
                "folder is data (whoever made it chose its links), so the tools do not write through them. Give "
                f"{flag}DIR to write to a folder of your choice, or remove the link (nothing was written)"
            )
    if real.exists() and not real.is_dir():
        raise ConfigError(f"{out} is a file, not a folder: give a folder with {flag}DIR (a new one is made)")
    return real


def make_dir(path: Path) -> Path:
    """Make the folder `path` inside an output folder; a symlink at its name is replaced by a real folder, never
    followed (the output folder itself comes resolved from output_folder)."""
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def within(out: Path, name: str) -> Path:
    """The folder `name` (one plain name, or "" for `out` itself) in the output folder `out`: a name from a run's
    config (an SAE of a family) that would lead elsewhere (`/x`, `..`, `a/b`) is a ConfigError."""
    if name and (name in (".", "..") or "/" in name or "\0" in name or os.sep in name):
        raise ConfigError(f"{name!r} (a name from the run's config) is not a plain folder name to write {out}/NAME")
    return out / name


def clear_temporaries(folder: Path) -> None:
    """Remove the temporary files (write_atomic's `.NAME.PID.tmp`) that killed processes left in `folder`."""
    for stale in folder.glob(".*.tmp"):
        if (pid := re.fullmatch(r"\..+\.(\d+)\.tmp", stale.name)) and not alive(pid[1]):
            remove(stale)


def write_failed(error: OSError | DiskFull, what: str, kept: str) -> ConfigError:
    """The one-paragraph error for a tool's write that failed (`what`: what it was writing, `kept`: what is left): a
    full disk is a DiskFull, exit 2 as everywhere in runner."""
    if is_disk_full(error):
        return disk_full(what, kept, "run the same command again")
    return ConfigError(f"{what} failed: {error}; {kept}")
