"""metrics.jsonl: one JSON object per logged step, flushed at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from runner.interfaces import Logger
from runner.rundir import disk_full, is_disk_full, jsonl_lines, write_atomic

UNREADABLE = ".unreadable"  # metrics.jsonl.unreadable: lines a resume could not read, byte for byte


def _step(row: dict[str, Any]) -> float:
    # a row with no number for its step (not one this logger wrote) sorts first: a resume keeps it
    step = row.get("step")
    return step if isinstance(step, (int, float)) and step == step else float("-inf")


class JsonlLogger(Logger):
    """Writes one JSON object per logged step to `path`, flushed at once so a crash loses nothing logged.

    A new run starts a new file; a resumed run keeps the rows up to the checkpoint's step and appends after them.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.file = None
        self.resumed_at: int | None = None

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Keep rows up to `step`; later ones belong to the interrupted attempt and are written again."""
        self.resumed_at = step

    def start(self, info: dict[str, Any]) -> None:
        """Open the file (truncated after the resume step when resuming)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resumed_at is not None and self.path.exists():
            self._keep_up_to(self.resumed_at)
        self.file = self.path.open("a" if self.resumed_at is not None else "w", encoding="utf-8")

    def _keep_up_to(self, step: int) -> None:
        # Rows after `step` are written again by the resumed run. A line that is not a row (corrupted, or cut in half
        # by a crash) has no step to judge it by: its bytes go to metrics.jsonl.unreadable, never silently away, and
        # first, so that a crash between the two writes duplicates a line rather than losing it.
        lines = [
            (line.rstrip(b"\r\n") + b"\n", row) for line, row in jsonl_lines(self.path.read_bytes()) if line.strip()
        ]
        unreadable = [line for line, row in lines if row is None]
        if unreadable:
            side = self.path.with_name(self.path.name + UNREADABLE)
            old = side.read_bytes() if side.exists() else b""
            write_atomic(side, old + b"".join(unreadable), fsync=True)
            print(
                f"warning: {len(unreadable)} line(s) of {self.path} are not JSON rows (corrupted, or cut short by a "
                f"crash); kept, byte for byte, in {side}",
                file=sys.stderr,
            )
        # the kept rows byte for byte as they were; a row without a step is kept too (it is not the resumed run's)
        kept = [line for line, row in lines if row is not None and _step(row) <= step]
        write_atomic(self.path, b"".join(kept), fsync=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write {'step': step, **metrics} as one line."""
        if self.file is None:
            self.start({})
        try:
            self.file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.file.flush()
        except OSError as error:
            if is_disk_full(error):
                raise disk_full(f"writing a row of {self.path}") from None
            raise

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the file."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError as error:  # what a full disk left in the buffer: log() reported the disk full already
                if not is_disk_full(error):
                    raise
