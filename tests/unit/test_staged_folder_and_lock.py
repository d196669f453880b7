"""The one staged-folder writer (runner.rundir.staged_folder) and the one folder lock (runner.rundir.lock, locked)
themselves; their callers' behaviour is tested with each caller (checkpoints, exports, caches, sweeps), and a second run
refused at the command line in tests/e2e/test_rundir.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, popen, wait_for

from runner.rundir import LOCK, FolderInUse, lock, locked, staged_folder, staged_in, unlock


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


# ---- staged_folder ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("failure", [OSError("disk"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_block_that_raises_leaves_nothing_at_the_final_path_and_no_staging_folder(
    failure: BaseException, tmp_path: Path
) -> None:
    final = tmp_path / "out" / "step-1"
    with pytest.raises(type(failure)), staged_folder(final) as staging:
        assert staging.parent == final.parent and staging.name == f".step-1.partial-{os.getpid()}"
        (staging / "half").write_text("written")
        raise failure
    assert not final.exists() and list(final.parent.iterdir()) == []


def test_a_whole_folder_is_renamed_into_place_and_an_old_one_is_kept_until_then(tmp_path: Path) -> None:
    final = tmp_path / "step-1"
    with staged_folder(final, replace=True, fsync=True) as staging:
        (staging / "a").write_text("1")
        assert not final.exists()  # nothing at the final name until the block ends
    assert _tree(final) == {"a": "1"} and staged_in(tmp_path) == []
    with staged_folder(final, replace=True) as staging:  # the same folder written again: the old one whole till then
        (staging / "b").write_text("2")
        assert _tree(final) == {"a": "1"}
    assert _tree(final) == {"b": "2"} and sorted(os.listdir(tmp_path)) == ["step-1"]
    with pytest.raises(RuntimeError), staged_folder(final, replace=True) as staging:  # a failed rewrite keeps it
        (staging / "c").write_text("3")
        raise RuntimeError
    assert _tree(final) == {"b": "2"} and sorted(os.listdir(tmp_path)) == ["step-1"]


def test_without_replace_a_folder_with_files_is_never_replaced(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    with staged_folder(final) as staging:  # an empty folder is taken
        (staging / "a").write_text("1")
    assert _tree(final) == {"a": "1"}
    with pytest.raises(OSError), staged_folder(final) as staging:  # one with files (someone's, meanwhile) is not
        (staging / "b").write_text("2")
    assert _tree(final) == {"a": "1"} and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_dead_writer_s_staging_folder_is_removed_and_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".x.partial-999999999").mkdir()  # a killed writer's
    (out / ".x.partial-999999999" / "half").write_text("half")
    (out / f".x.partial-{os.getpid()}").symlink_to(victim)  # this process's staging name, planted
    with staged_folder(out / "x") as staging:
        assert not staging.is_symlink() and list(staging.iterdir()) == []
        (staging / "a").write_text("1")
    assert sorted(os.listdir(out)) == ["x"] and _tree(victim) == {"keep": "mine"}


def test_shared_writers_keep_the_first_copy_in_place(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "key"
    with staged_folder(final, shared=True) as first, staged_folder(final, shared=True) as second:
        assert first != second and {first.parent, second.parent} == {final.parent}
        (first / "meta.json").write_text("first")
        (second / "meta.json").write_text("second")
    # the inner block ended first: its copy is the cache; the other one's is dropped
    assert _tree(final) == {"meta.json": "second"} and sorted(os.listdir(final.parent)) == ["key"]


# ---- lock, locked ----------------------------------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from runner.rundir import lock
folder, held, release = map(Path, sys.argv[1:])
lock(folder, "run folder")
held.touch()
while not release.exists():
    time.sleep(0.01)
"""


def _holder(tmp_path: Path, folder: Path):
    proc = popen("-c", HOLD, str(folder), str(tmp_path / "held"), str(tmp_path / "release"), cwd=ROOT)
    wait_for(proc, "held", tmp_path, timeout=60)
    return proc


def test_a_second_lock_in_another_process_is_refused_naming_the_pid(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc = _holder(tmp_path, folder)
    try:
        with pytest.raises(FolderInUse, match=rf"run folder {folder} is in use by another process \(pid {proc.pid}\)"):
            lock(folder, "run folder")
    finally:
        (tmp_path / "release").touch()
        proc.wait(timeout=60)
    lock(folder, "run folder")  # the holder's exit released it; its file is taken over
    assert (folder / LOCK).read_text() == f"{os.getpid()}\n"
    lock(folder, "run folder")  # this process's already: no-op
    with locked(folder):  # inside this process's lock(): that lock, not a wait on itself
        pass
    unlock(folder)
    assert list(folder.iterdir()) == []  # a finished folder holds only its results


def test_a_killed_holder_s_folder_is_free_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc = _holder(tmp_path, folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (folder / LOCK).read_text() == f"{proc.pid}\n"  # its file is left; the kernel dropped its lock
    lock(folder, "run folder")
    unlock(folder)


def test_locked_waits_for_the_holder_then_holds_the_folder_for_the_block(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    proc = _holder(tmp_path, folder)
    entered: list[float] = []

    def wait_and_hold() -> None:
        with locked(folder):
            entered.append(time.monotonic())
            assert (folder / LOCK).read_text() == f"{os.getpid()}\n"

    waiter = threading.Thread(target=wait_and_hold)
    waiter.start()
    time.sleep(0.3)
    assert entered == [] and waiter.is_alive()  # waiting its turn
    released = time.monotonic()
    (tmp_path / "release").touch()
    waiter.join(timeout=60)
    proc.wait(timeout=60)
    assert len(entered) == 1 and entered[0] >= released
    assert not (folder / LOCK).exists()  # released at the block's end, its file removed
