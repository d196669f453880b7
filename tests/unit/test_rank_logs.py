"""runner.log.ranks in one process: a rank's warnings (warnings.warn, logging) and the error that ends its run go to
logs/rank-K.log; rank 0 still shows its warnings on the console, the other ranks only their errors."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.log import ranks


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh wiring, undone afterwards: the hooks and root handlers it replaces are put back."""
    monkeypatch.setattr(ranks, "_wired", {})
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    # Python's own hooks, not what earlier tests in this process left: each wandb.init wraps sys.excepthook, and an
    # exception walked through dozens of those wrappers (each printing its traceback) took 17 s here
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    root.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
            handler.close()
    for handler in ranks._FILE.handlers[1:]:
        ranks._FILE.removeHandler(handler)
    root.setLevel(level)


def _warn_and_fail(rank: int) -> None:
    warnings.warn(f"warned on rank {rank}", UserWarning, stacklevel=1)
    logging.getLogger("some.library").warning("logged on rank %d", rank)
    logging.getLogger("some.library").info("not a warning on rank %d", rank)
    try:
        raise ValueError(f"failed on rank {rank}")
    except ValueError as error:
        ranks.record_failure(error)


def test_a_rank_s_warnings_and_its_failure_go_to_its_file_and_only_errors_to_the_console(
    wired: None, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    ranks.log_rank(tmp_path, 1)
    assert not (tmp_path / "logs").exists()  # nothing to report yet
    _warn_and_fail(1)
    logging.getLogger("some.library").error("an error on rank 1")
    text = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "UserWarning: warned on rank 1" in text and "logged on rank 1" in text
    assert "not a warning" not in text
    assert "the run failed: ValueError: failed on rank 1" in text and "Traceback (most recent call last)" in text
    assert 'raise ValueError(f"failed on rank {rank}")' in text
    out, err = capfd.readouterr()
    assert "rank 1" not in (out + err).replace("an error on rank 1", "")  # warnings and the failure: the file only
    assert "an error on rank 1" in err


def test_rank_0_keeps_its_console_and_a_second_job_writes_to_its_own_folder(
    wired: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    console: list[str] = []  # what shows a warning on the console (pytest records them instead of printing)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: console.append(str(message)))
    ranks.log_rank(tmp_path / "job0", 0)
    warnings.warn("warned in job 0", UserWarning, stacklevel=1)
    assert console == ["warned in job 0"]  # as without rank logs
    ranks.log_rank(tmp_path / "job1", 0)  # a sweep's next job in the same process
    warnings.warn("warned in job 1", UserWarning, stacklevel=1)
    assert "warned in job 0" in (tmp_path / "job0" / "logs" / "rank-0.log").read_text()
    second = (tmp_path / "job1" / "logs" / "rank-0.log").read_text()
    assert "warned in job 1" in second and "job 0" not in second
    assert "warned in job 1" not in (tmp_path / "job0" / "logs" / "rank-0.log").read_text()
    assert console == ["warned in job 0", "warned in job 1"]  # each shown once: the hook is not wrapped twice


def test_an_exception_in_a_background_thread_is_recorded(wired: None, tmp_path: Path) -> None:
    ranks.log_rank(tmp_path, 3)

    def fail() -> None:
        raise OSError("the disk is full")

    thread = threading.Thread(target=fail, name="writer")
    thread.start()
    thread.join()
    text = (tmp_path / "logs" / "rank-3.log").read_text()
    assert "uncaught in thread writer" in text and "OSError: the disk is full" in text
