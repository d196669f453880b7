"""Ranks that stop together, with one exit code.

A rank that is refused (exit 2: a full disk on rank 0, a file missing on one node) cannot wake the others: they wait
for it in a collective until it exits, then fail with the collective's traceback (exit 1), unless torchrun's SIGTERM
(sent once one rank has exited) kills them first. So the refused rank leaves a note in the job's store; every rank
watches for one, and a rank that another's refusal stops says one line and exits 2 too; and no rank exits before every
rank is ready to (STOP_WAIT_S at most), so that the launcher's SIGTERM cuts no rank short. A failure that is no
refusal (exit 1) stops as it always did: nobody waits for a rank that crashed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runner.distributed.env import environment, exit_without_teardown, job_store, restart_count

STOP_WAIT_S = 10.0  # how long a stopping rank waits for the others: one stuck elsewhere never answers
_POLL_S, _GRACE_S = 0.2, 0.5  # the watcher's interval; its wait for a rank refused by the same thing to say so itself
_stopping: dict[str, Any] = {"lock": threading.Lock()}  # `code` once this rank stops, its `cause`


@dataclass(frozen=True)
class Stop:
    """Another rank's refusal: its rank, its one-paragraph message, and whether it was a full disk
    (runner.rundir.DiskFull, whose run folder is kept for resume=auto)."""

    rank: int
    message: str
    disk_full: bool


def _key(name: str) -> str:
    return f"runner/stop/{restart_count()}/{name}"  # each elastic restart's own


def _refusal(store: Any) -> Stop | None:
    # the first refusal of another rank, if one was noted
    if not store.check([_key("refused")]):
        return None
    note = json.loads(store.get(_key("refused")))
    return Stop(**note) if note["rank"] != environment()["rank"] else None


def stop_together(code: int, message: str, disk_full: bool = False) -> Stop | None:
    """Under several processes, as this rank stops with `code` (`message`: why; `disk_full`: a full disk): a refusal
    (code 2) is noted for the other ranks; any other failure may be another rank's refusal seen from here (a
    collective that lost that rank), which this returns (None: this rank's own failure, or one process). The answer
    of the first call is kept."""
    store, info = job_store(), environment()
    if store is None or info["world_size"] < 2:
        return None
    with _stopping["lock"]:
        watched, said = _stopping.get("watcher", False), "code" in _stopping
        if not said:
            _stopping["code"] = code
    while watched:  # the watcher thread is stopping this rank: it ends the process (exit 2) once every rank is ready
        time.sleep(1)
    if said:
        return _stopping.get("cause")
    _exit_on_sigterm()
    cause = None
    try:
        if code == 2:
            note = json.dumps({"rank": info["rank"], "message": message, "disk_full": disk_full})
            store.compare_set(_key("refused"), "", note)  # the first refusal is the one the others name
        if torch.distributed.is_initialized():  # a rank waiting for this one in a collective fails at once, if it can
            torch.distributed.destroy_process_group()
        if code != 2:  # a refused rank notes it a moment after leaving the group, which may be what failed here
            deadline = time.monotonic() + 0.5
            while (cause := _refusal(store)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # the store is gone with its host (rank 0 outside torchrun): this rank decides alone
        cause = None
    _stopping["cause"] = cause
    if cause is not None:
        _stopping["code"] = 2
    return cause


def stopping_ranks_at(stage: str) -> None:
    """Under several processes, as this rank stops: wait (STOP_WAIT_S at most) until every rank has reached `stage`
    of stopping (every rank's log written, say, before rank 0 removes a refused run's folder)."""
    store, info = job_store(), environment()
    if store is None or info["world_size"] < 2:
        return
    try:
        store.add(_key(stage), 1)
        deadline = time.monotonic() + STOP_WAIT_S
        while store.add(_key(stage), 0) < info["world_size"] and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone with its host: nobody is left to wait for
        pass


def leave_together(code: int) -> None:
    """Under several processes, once this rank has written what it writes: wait (STOP_WAIT_S at most) until every
    rank is ready to exit; from now on a SIGTERM exits with `code`."""
    if job_store() is None or environment()["world_size"] < 2:
        return
    _stopping["code"] = code
    _exit_on_sigterm()
    stopping_ranks_at("leaving")


def watch_for_refusals(on_refusal: Callable[[Stop], None]) -> None:
    """Under several processes: from now on, once another rank is refused while this one is not stopping itself,
    `on_refusal` (what this rank says and records) runs in a thread and this rank exits 2, even while its main
    thread waits in a collective for the refused rank."""
    store, info = job_store(), environment()
    if store is None or info["world_size"] < 2:
        return
    _exit_on_sigterm()  # (training's own handler stands in while it trains: runner.train._preemptible)

    def watch() -> None:
        cause = None
        while cause is None:
            time.sleep(_POLL_S)
            try:
                cause = _refusal(store)
            except Exception:  # the store is gone: the job is over
                return
        time.sleep(_GRACE_S)
        with _stopping["lock"]:
            if "code" in _stopping:
                return
            _stopping.update(code=2, cause=cause, watcher=True)
        try:
            on_refusal(cause)
        finally:  # (a full disk may fail what it writes too: this rank still exits, with the others)
            leave_together(2)
            exit_without_teardown(2)

    threading.Thread(target=watch, name="runner-refusals", daemon=True).start()


def _exit_on_sigterm() -> None:
    # torchrun's SIGTERM to the ranks still running once one has exited: a rank that has chosen its code exits with
    # it; any other does what it did before (by default, dies of the signal)
    previous = signal.getsignal(signal.SIGTERM)
    if previous is _on_sigterm or threading.current_thread() is not threading.main_thread():
        return
    _stopping["previous"] = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if "code" in _stopping:
        exit_without_teardown(_stopping["code"])
    previous = _stopping.get("previous")
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
