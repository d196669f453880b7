"""The file-size limit (`ulimit -f`: EFBIG; Python ignores SIGXFSZ, so the write fails instead of the process dying) is
a full disk: the same one paragraph, naming the limit, exit 2, no temporary file left, and resume=auto goes on
bit-exact once the limit is raised. The console copy (runner.log) and the rank logs never turn a full disk into a
traceback of their own."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import DIGITS_12, assert_same_weights, child_env, metric_rows

from runner import ConfigError
from runner.ckpt.callback import Checkpoint
from runner.ckpt.files import checkpoints
from runner.run import Callback
from runner.rundir import DiskFull, disk_full, is_disk_full, write_atomic
from runner.train import train

LIMIT = 512 << 10  # bytes: metrics.jsonl, runner.log and the config fit; a checkpoint of digits' MLP (1.2 MB) does not
FULL = "/dev/full"  # a device whose every write fails with ENOSPC: a full disk without filling one


class FileSizeLimitFrom(Callback):
    """From optimizer step `step` on, this process may write no file past LIMIT bytes (`ulimit -f`), once the save in
    flight is on disk: the next checkpoint is the one that fails."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.step:
            for callback in run.callbacks:
                if isinstance(callback, Checkpoint):
                    callback.wait()
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.fixture
def limits_restored() -> None:
    """The process's file-size limit as it was, whatever the test did to it."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield
    resource.setrlimit(resource.RLIMIT_FSIZE, before)


def test_the_file_size_limit_is_a_full_disk_and_the_resume_is_bit_exact(
    compose_cfg: Callable, tmp_path: Path, limits_restored: None
) -> None:
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    train(compose_cfg(*DIGITS_12, run_dir=reference))
    with pytest.raises(DiskFull) as caught:
        train(compose_cfg(*DIGITS_12, run_dir=run_dir), extra_callbacks=[FileSizeLimitFrom(6)])
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    message = str(caught.value)
    assert message.startswith(f"disk full: saving checkpoint {run_dir / 'checkpoints' / 'step-00000008'} failed")
    assert "(file too large: it reached this process's file-size limit, `ulimit -f`)" in message, message
    assert "Raise the limit (ulimit -f unlimited" in message and "resume=auto" in message, message
    assert "\n" not in message
    assert [p.name for p in checkpoints(run_dir / "checkpoints")] == ["step-00000004"]
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]  # the half-written checkpoint is gone
    resumed = train(compose_cfg(*DIGITS_12, "resume=auto", run_dir=run_dir))
    assert resumed.progress.step == 12
    assert_same_weights(run_dir, reference)
    assert metric_rows(run_dir) == metric_rows(reference)


def _limited(size: int) -> Callable[[], None]:
    # for preexec_fn: the child's files stop at `size` bytes, as under `ulimit -f`
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def test_the_cli_under_ulimit_f_exits_2_with_one_paragraph(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "runner", *DIGITS_12, "threads=1", f"hydra.run.dir={run_dir}"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited(LIMIT),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert line.startswith("error: disk full: saving checkpoint") and "step-00000004" in line, line
    assert "file-size limit, `ulimit -f`" in line and "resume=auto" in line, line
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    assert "file too large" in (run_dir / "summary.json").read_text()  # summary.json says why too
    assert line in (run_dir / "runner.log").read_text()


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        (errno.ENOSPC, "(no space left on device); kept. Free space on that disk, then go on"),
        (errno.EDQUOT, "(disk quota exceeded); kept. Free space on that disk, then go on"),
        (errno.EFBIG, "(file too large: it reached this process's file-size limit, `ulimit -f`); kept. Raise the"),
    ],
)
def test_each_way_a_disk_fills_is_a_full_disk(code: int, fragment: str) -> None:
    error = OSError(code, os.strerror(code))
    assert is_disk_full(error)
    made = disk_full("writing x", "kept", "go on", error)
    assert isinstance(made, DiskFull) and isinstance(made, ConfigError)
    assert str(made).startswith("disk full: writing x failed ") and fragment in str(made), str(made)
    try:  # the error being handled, when none is given; and a DiskFull made of one keeps what it was
        raise error
    except OSError:
        again = disk_full("saving y", "kept", "go on")
    assert fragment.split(";")[0] in str(disk_full("saving z", "kept", "go on", again))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_write_atomic_under_the_file_size_limit_removes_its_temporary_file(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom runner.rundir import write_atomic\n"
        "try:\n    write_atomic(sys.argv[1], b'x' * 100_000)\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n"
    )
    (tmp_path / "victim.bin").write_bytes(b"before")
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "victim.bin")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited(10_000),
    )
    assert done.stdout.startswith(f"DiskFull disk full: writing {tmp_path / 'victim.bin'} failed (file too large"), done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.bin"]
    assert (tmp_path / "victim.bin").read_bytes() == b"before"  # the file it was to replace, whole


@pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full")
def test_the_console_goes_on_when_its_copy_in_runner_log_cannot_be_written() -> None:
    from runner.log.tee import Tee

    console = io.StringIO()
    tee = Tee(console, open(FULL, "a", encoding="utf-8"))  # noqa: SIM115 - closed by the Tee when it fails
    for line in ("step 10\n", "error: disk full: ...\n", "after\n"):
        tee.write(line)
    tee.flush()
    assert console.getvalue() == "step 10\nerror: disk full: ...\nafter\n"


@pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full")
def test_a_rank_log_on_a_full_disk_prints_no_logging_traceback(capsys: pytest.CaptureFixture) -> None:
    from runner.log.ranks import _FolderOnFirstRecord

    handler = _FolderOnFirstRecord(FULL, delay=True, encoding="utf-8")
    logger = logging.getLogger("test_disk_limits.full")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("the run failed: DiskFull: disk full")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "Logging error" not in capsys.readouterr().err
    plain = logging.FileHandler(FULL, delay=True, encoding="utf-8")  # the same record without runner's handler
    logger.addHandler(plain)
    try:
        logger.error("the run failed")
    finally:
        logger.removeHandler(plain)
        with contextlib.suppress(OSError):  # (its buffer fails again)
            plain.close()
    assert "Logging error" in capsys.readouterr().err  # what a plain FileHandler prints there: the case is real


def test_write_atomic_names_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr("runner.rundir.files.os.fsync", full)
    with pytest.raises(DiskFull, match=r"writing .*x\.json failed \(file too large"):
        write_atomic(tmp_path / "x.json", b"{}", fsync=True)
    assert list(tmp_path.iterdir()) == []
