"""The files of a text corpus (the user's files or globs, or the Python standard library's own sources), which of them
are held out for validation, and reading one as UTF-8 text: shared by data=text_bytes and data=text_stream."""

from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
from pathlib import Path

from experiments.lm.saved_dataset import file_kind
from runner import ConfigError, check_whole

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without tests and site-packages: ~12 MB of real text on every
    machine that runs Python, no download."""
    found = []
    for folder, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]  # not walked at all: site-packages may hold 100k files
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return sorted(p for p in found if p.is_file())


# Folder entries one glob may look at: a ** that starts too high (/**/*.parquet) walks the whole disk for minutes,
# saying nothing; a corpus of a million files is a rare one, and its user raises the limit (data.glob_limit)
GLOB_LIMIT = 1_000_000


def bounded_glob(pattern: str, limit: int, option: str, limit_option: str) -> list[Path]:
    """What glob.glob(pattern, recursive=True) finds (hidden names only where the pattern spells their dot), having
    looked at no more than `limit` folder entries; past that, a ConfigError naming the pattern and `limit_option`."""
    if not glob.has_magic(pattern):
        return [Path(pattern)] if os.path.lexists(pattern) else []
    seen = 0

    def listing(folder: Path) -> list[os.DirEntry]:
        nonlocal seen
        try:
            with os.scandir(folder) as entries:
                found = []
                for entry in entries:
                    seen += 1
                    if seen > limit:
                        raise ConfigError(
                            f"{option}: the glob {pattern!r} looked at more than {limit:,} files and folders without "
                            "finishing (a ** walks every folder below where it starts): start it at the data's own "
                            f"folder (data/**/*.parquet, not /**/*.parquet), or raise {limit_option} (now {limit}) if "
                            "the data really spans that many"
                        )
                    found.append(entry)
                return found
        except OSError:  # not a folder, or unreadable: nothing in it matches, as for glob
            return []

    def below(folder: Path, folders_only: bool) -> list[Path]:
        # `folder` and what is under it, hidden names left out (what ** matches)
        found, stack = [folder], [folder]
        while stack:
            for entry in listing(stack.pop()):
                is_dir = _is_dir(entry)
                if not entry.name.startswith(".") and (is_dir or not folders_only):
                    found.append(Path(entry.path))
                    if is_dir:
                        stack.append(Path(entry.path))
        return found

    parts = Path(pattern).parts
    found = [Path()]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if not glob.has_magic(part):
            found = [f / part for f in found]
        elif part == "**":
            found = [p for f in found for p in below(f, folders_only=not last)]
        else:
            found = [
                f / e.name
                for f in found
                for e in listing(f)
                if (part.startswith(".") or not e.name.startswith("."))
                and fnmatch.fnmatchcase(e.name, part)
                and (last or _is_dir(e))
            ]
    return [f for f in found if os.path.lexists(f)]


def _is_dir(entry: os.DirEntry) -> bool:
    # a folder, or a link to one (glob follows them too)
    try:
        return entry.is_dir()
    except OSError:
        return False


def expand_paths(paths: list[str], glob_limit: int = GLOB_LIMIT, option: str = "data") -> list[Path]:
    """The files that `paths` (files or globs) name, each pattern's sorted; a ConfigError for one that names none,
    or whose glob looks at more than `glob_limit` folder entries (`option`: the config node the messages name)."""
    check_whole(glob_limit, f"{option}.glob_limit")
    files: list[Path] = []
    for pattern in paths:
        if not isinstance(pattern, str):
            raise ConfigError(f"{option}.paths: {pattern!r} is not a path: e.g. {option}.paths=[notes/*.md,book.txt]")
        found = sorted(bounded_glob(os.path.expanduser(pattern), glob_limit, f"{option}.paths", f"{option}.glob_limit"))
        matches = [m for m in found if m.is_file()]
        if not matches and (others := [m for m in found if not m.is_dir()]):
            raise ConfigError(
                f"{option}.paths: {others[0]} is {file_kind(others[0])}, not a regular file; refused without opening "
                "it: name text files"
            )
        if not matches and found:
            raise ConfigError(
                f"{option}.paths: {pattern!r} names only folders ({found[0]}...): name the files in them, e.g. "
                f"{option}.paths=[{Path(pattern) / '**' / '*.txt'}]"
            )
        if not matches:
            raise ConfigError(f"{option}.paths: {pattern!r} matches no file (relative paths start at {os.getcwd()})")
        files += matches
    return files


def corpus_files(
    paths: list[str] | str | None, val_every: int, glob_limit: int = GLOB_LIMIT, option: str = "data"
) -> list[Path]:
    """The files of a text corpus: `paths` (files or globs, each looking at no more than `glob_limit` folder entries;
    one string is one of them) or the standard library's sources; `val_every` checked (`option`: the config node the
    messages name, data or source.inputs)."""
    if val_every == 1 or val_every < 0:
        raise ConfigError(f"{option}.val_every={val_every}: every n-th file is held out; n must be >= 2, or 0 (none)")
    if isinstance(paths, str):  # data.paths=book.txt: one path, not a list of its characters
        paths = [paths]
    return expand_paths(list(paths), glob_limit, option) if paths else stdlib_sources()


def held_out_files(n: int, val_every: int) -> list[bool]:
    """Which of `n` files are validation text: every `val_every`-th (none for 0), and the last one of 2 to
    `val_every` - 1 files, so that a small corpus (the few files of a LoRA fine-tune) validates too."""
    if val_every and 2 <= n < val_every:
        return [i == n - 1 for i in range(n)]
    return [bool(val_every) and i % val_every == val_every - 1 for i in range(n)]


def no_val_split(n: int, val_every: int) -> str | None:
    """Why `n` files hold none out for validation, and the setting that changes it (None when one is held out)."""
    if any(held_out_files(n, val_every)):
        return None
    if n < 2:
        return (
            f"data.paths names {n} file, and validation text is a whole file held out: add a second file to "
            "data.paths (one of 2 or more is held out)"
        )
    return (
        f"data.val_every={val_every} holds out none of the {n} files: data.val_every=N holds out every N-th file "
        "(N >= 2; the last one of fewer than N)"
    )


def read_text(path: Path) -> bytes:
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.paths: {path} is not UTF-8 text (byte {error.start} is not valid UTF-8): data=text_bytes reads "
            "text files; for pre-tokenized ids use data=tokens_file"
        ) from None
    if b"\0" in data:
        raise ConfigError(f"data.paths: {path} holds NUL bytes, a binary file: name text files only")
    return data
