"""The run folder's runner.log: everything rank 0 prints (startup table, progress lines, warnings, the error) also
goes to the file, so a run is readable afterwards even when its console is gone."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import Any, TextIO

# A live progress bar redraws itself with cursor movements: the file gets its final lines, not every redraw.
_REDRAW = re.compile(r"\x1b\[(\d*[AK]|\?25[lh])")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Tee:
    """A text stream that writes to `stream` and, without colours or redraws, to `file`."""

    def __init__(self, stream: TextIO, file: TextIO) -> None:
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        """Write to both (the file without terminal control codes)."""
        if not _REDRAW.search(text):
            self._to_file(lambda: self.file.write(_ANSI.sub("", text)))
        return self.stream.write(text)

    def flush(self) -> None:
        """Flush both."""
        self.stream.flush()
        self._to_file(lambda: None)

    def _to_file(self, write: Any) -> None:
        # A full disk (or the file-size limit) fails the copy, not the console: the message that says so must still
        # be printed, so the copy stops and the console goes on
        if self.file.closed:
            return
        try:
            write()
            self.file.flush()
        except OSError:
            broken, self.file = self.file, _Closed()
            with contextlib.suppress(OSError):  # closed here: dropped, its buffer would fail again when collected
                broken.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)  # isatty, fileno, encoding...: the console's, so rich sees the terminal


class _Closed:
    """Where the copy goes once its file could not be written: nowhere."""

    closed = True

    def close(self) -> None:
        """Nothing to close."""


def tee_to(path: Path) -> None:
    """From now on, this process's stdout and stderr also go to `path` (appended: a resumed launch adds to it). A
    sweep's next job in the same process moves the copy to its own folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the rest of the process (or job)
    if isinstance(sys.stderr, Tee) and isinstance(sys.stdout, Tee):
        sys.stderr.file.close()
        sys.stdout.file = sys.stderr.file = file
    else:
        sys.stdout, sys.stderr = Tee(sys.stdout, file), Tee(sys.stderr, file)
