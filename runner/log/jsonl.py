"""metrics.jsonl: one JSON object per logged step, flushed at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.run import Logger
from runner.rundir import read_jsonl, write_atomic


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
            # rows cut in half by the crash are dropped; the kept ones are written back as they were
            kept = [row for row in read_jsonl(self.path) if row.get("step", self.resumed_at + 1) <= self.resumed_at]
            write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept).encode())
        self.file = self.path.open("a" if self.resumed_at is not None else "w", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write {'step': step, **metrics} as one line."""
        if self.file is None:
            self.start({})
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
