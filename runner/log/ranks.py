"""logs/rank-K.log in the run folder: this rank's warnings and errors (logging at WARNING and above, warnings.warn,
the exception that ends the run with its traceback), so that a failure on rank 5 of 8 is readable afterwards.

Rank 0's console is unchanged. The other ranks print errors only: their warnings go to their file alone, so N ranks do
not repeat one warning N times on the shared console. The file appears with its first record: a run with nothing to
report has no logs/ folder.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from runner.rundir import RANK_LOG

FAILED = "the run failed: "  # what starts the line record_failure writes (the torchrun launcher reads it back)
# Records meant for the file only: propagating them to the root logger would print them on rank 0's console too.
_FILE = logging.getLogger("runner.rank_log")
_FILE.propagate = False
_FILE.addHandler(logging.NullHandler())  # nowhere until wired (without a handler, logging would print it)
_wired: dict[str, Any] = {}  # this process's handlers and the hooks it replaced


class _FolderOnFirstRecord(logging.FileHandler):
    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:
        """A full disk (or the file-size limit) fails the file: the console says what stopped the run, without a
        traceback of logging's own."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)

    def close(self) -> None:
        """Close the file; what a full disk kept in its buffer is dropped (the console said why the run stopped)."""
        try:
            super().close()
        except OSError:
            pass


def log_rank(run_dir: str | Path, rank: int) -> None:
    """From now on, this process's warnings and errors also go to `run_dir`/logs/rank-`rank`.log; called again (the
    next job of a sweep), they go to the new folder's file instead."""
    handler = _FolderOnFirstRecord(Path(run_dir) / RANK_LOG.format(rank), delay=True, encoding="utf-8")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old = _wired.get("handler")
    if old is not None:
        root.removeHandler(old)
        _FILE.removeHandler(old)
        old.close()
    root.addHandler(handler)
    _FILE.addHandler(handler)
    _FILE.disabled = False  # a logging config with disable_existing_loggers turns off loggers made before it
    _wired["handler"] = handler
    if rank > 0 and "console" not in _wired:
        # Hydra's logging is off on these ranks, so a record would reach the console only through logging's
        # last-resort handler, which stays silent once the root has a handler: errors get a console of their own.
        _wired["console"] = logging.StreamHandler(sys.stderr)
        _wired["console"].setLevel(logging.ERROR)
        root.addHandler(_wired["console"])
    _hook(rank)


def record_failure(error: BaseException) -> None:
    """Write the exception that ends this rank's run, with its traceback, to the rank's file (not to the console:
    the command reports it there)."""
    _FILE.error(f"{FAILED}%s: %s", type(error).__name__, error, exc_info=(type(error), error, error.__traceback__))


def _hook(rank: int) -> None:
    # warnings.warn: to the file, and on rank 0 to the console as before. Uncaught exceptions (the main thread's,
    # a background thread's): to the file, then as before.
    if "showwarning" not in _wired:
        _wired.update(showwarning=warnings.showwarning, excepthook=sys.excepthook, thread_hook=threading.excepthook)
        sys.excepthook, threading.excepthook = _uncaught, _uncaught_in_thread
    shown = _wired["showwarning"]

    def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
        _FILE.warning(warnings.formatwarning(message, category, filename, lineno).rstrip())
        if rank == 0:
            shown(message, category, filename, lineno, *rest)

    warnings.showwarning = showwarning


def _uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    _FILE.error("uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, tb))
    _wired["excepthook"](kind, error, tb)


def _uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is not SystemExit:
        thread = args.thread.name if args.thread is not None else "?"
        _FILE.error("uncaught in thread %s", thread, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
    _wired["thread_hook"](args)
