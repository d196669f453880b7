"""Where a launch's wall time goes: named phases before, between and after the training steps, recorded by whoever does
the work (the command, the build, a data module's source model, validation, checkpoints), for summary.json's
`startup` table and the console's last line.

Phases nest and are recorded exclusively (a source model built inside the data's build counts under its own name,
not twice), so the table's phases, the training steps and what no phase claimed add up to the launch's wall time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

TRAINING = "training"  # the phase around fit(): what no nested phase claims of it is the steps themselves


class Timeline:
    """Exclusive wall time per named phase, with counts; one per process (TIMELINE), reset at each launch."""

    def __init__(self) -> None:
        self.local = threading.local()  # a checkpoint writer's or heartbeat's thread keeps its own (unrecorded) stack
        self.reset()

    def reset(self, started: float | None = None) -> None:
        """Forget every phase; the launch began at `started` (perf_counter seconds; default: now)."""
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.local.stack = []
        self.pending = False

    def command_started(self, imported_at: float, config_s: float = 0.0) -> None:
        """The command began this launch when runner was imported (`imported_at`, perf_counter seconds): what it spent
        before main() ran (imports, then Hydra's composition: `config_s`) are the first phases. The next begin() keeps
        them."""
        now = time.perf_counter()
        self.reset(min(imported_at, now - config_s))
        self.add("imports", max(0.0, now - imported_at - config_s))
        self.add("config", config_s)
        self.pending = True

    def begin(self) -> None:
        """A run starts: a fresh table, unless the command that started this process has just opened it."""
        if not self.pending:
            self.reset()
        self.pending = False

    def __getstate__(self) -> dict[str, Any]:
        # a launcher (joblib, submitit) pickles the job's function with what it refers to: the phases travel, the
        # per-thread stacks cannot and need not
        return {k: v for k, v in self.__dict__.items() if k != "local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.local = threading.local()

    def _stack(self) -> list[list[Any]]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        """Record `seconds` under `name`, outside any phase (imports and config, timed before the timeline starts)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block under `name`, less the phases nested in it."""
        stack = self._stack()
        # [name, start of the part not yet recorded, nested seconds within that part]
        frame = [name, time.perf_counter(), 0.0]
        stack.append(frame)
        started = frame[1]
        try:
            yield
        finally:
            stack.pop()
            now = time.perf_counter()
            self.add(name, now - frame[1] - frame[2])
            if stack:
                stack[-1][2] += now - started

    def lap(self, name: str) -> None:
        """Record the enclosing phase's time since it began (or since its last lap), less what nested in it, under
        `name` instead: the first optimizer step inside the training phase."""
        stack = self._stack()
        if not stack:
            return
        frame, now = stack[-1], time.perf_counter()
        self.add(name, now - frame[1] - frame[2])
        frame[1], frame[2] = now, 0.0

    def table(self) -> dict[str, Any]:
        """summary.json's `startup`: the launch's wall time, each phase's seconds (and count where several), the
        training steps' share, and what no phase claimed."""
        wall = time.perf_counter() - self.started
        phases = {
            name: round(s, 3) if self.counts[name] == 1 else {"s": round(s, 3), "count": self.counts[name]}
            for name, s in self.seconds.items()
            if name != TRAINING
        }
        training = self.seconds.get(TRAINING, 0.0)
        return {
            "wall_s": round(wall, 3),
            "training_s": round(training, 3),
            "training_fraction": round(training / wall, 4) if wall > 0 else None,
            "phases": phases,
            "other_s": round(max(0.0, wall - sum(self.seconds.values())), 3),
        }


TIMELINE = Timeline()


def command_started(imported_at: float, config_s: float = 0.0) -> None:
    """TIMELINE.command_started: referred to by name, so that a launcher pickling the command's main() pickles no
    Timeline."""
    TIMELINE.command_started(imported_at, config_s)


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """TIMELINE.phase(name): a block of a launch's wall time recorded under `name`."""
    return TIMELINE.phase(name)
