"""The checkpoint callback: when to save (interval, best, end of training), snapshots to CPU, a background writer,
rotation (keep_last and keep_best)."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError
from runner.ckpt.dcp_writer import ShardedWriter, checkpoint_format
from runner.ckpt.files import (
    DCP,
    MANIFEST_SHA256,
    PREFIX,
    CheckpointError,
    bare_names,
    checkpoints,
    read_manifest,
    verify,
    write_checkpoint,
)
from runner.ckpt.state import model_weights, training_state
from runner.durations import parse_duration
from runner.run import Best, Callback, Run, StopReason
from runner.rundir import disk_full, is_disk_full, staged_in
from runner.timeline import phase


def _snapshot(value: Any, buffers: dict[str, torch.Tensor], path: str = "", copy: bool = True) -> Any:
    """A copy of `value` whose tensors live in reusable CPU buffers: the only part of a save the loop waits for.

    With copy=False only make sure the buffers exist, with their pages touched (prepare() does it off the loop).
    """
    if isinstance(value, torch.Tensor):
        buffer = buffers.get(path)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            # the full shape also for an FSDP shard (a DTensor's shape): prepare() sizes the buffers of a gathered save
            buffer = buffers[path] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            if not copy:
                buffer.zero_()
        return buffer.copy_(value.detach(), non_blocking=value.is_cuda) if copy else buffer
    if isinstance(value, dict):
        return {k: _snapshot(v, buffers, f"{path}/{k}", copy) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v, buffers, f"{path}/{i}", copy) for i, v in enumerate(value))
    return value


class Checkpoint(Callback):
    """Saves the full training state every `interval`, at the best validations, and at the end of training.

    Keeps the `keep_last` newest checkpoints and, apart from them, the `keep_best` best by `monitor`; `save_last`
    maintains a `last` symlink to the newest. Saving blocks the loop only while tensors are copied to CPU buffers;
    serialisation, checksums, fsync and rotation run in a background thread, one save at a time. With format=dcp and
    async, the copy itself overlaps the next step's forward and backward (runner.ckpt.dcp_writer).
    """

    monitor_off = "checkpoint.keep_best=0 (no best checkpoint kept apart; the newest ones still are)"

    def __init__(
        self,
        dir: str,
        interval: str = "1ep",
        keep_last: int = 2,
        keep_best: int = 1,
        monitor: str | None = None,
        mode: str = "min",
        save_last: bool = True,
        format: str = "auto",
        **options: bool,
    ) -> None:
        if keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 (resume needs one), got {keep_last}")
        if keep_best < 0:  # was read as 0: a typo for a count silently kept no best checkpoint
            raise ConfigError(
                f"checkpoint.keep_best must be >= 0 (how many best checkpoints to keep apart; 0: none), got "
                f"{keep_best}: e.g. checkpoint.keep_best=3"
            )
        self.dir, self.interval = Path(dir), parse_duration(interval)
        if self.interval.value <= 0:
            raise ConfigError(f"checkpoint.interval={interval} must be longer than zero")
        self.keep_last, self.keep_best, self.save_last = keep_last, keep_best, save_last
        self.format, self.sharded = checkpoint_format(format, options), ShardedWriter(options.get("async", False))
        self.monitor = monitor if keep_best > 0 else None
        self.order = Best(mode)  # which values are better (it checks that mode is 'min' or 'max')
        # (value, step) of every checkpoint saved with a fresh monitored value: every rank decides the same saves
        # from it (a save is collective), without reading the disk that rank 0's writer is changing.
        self.scored: list[list[float]] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.fresh: float | None = None  # the monitored value of a validation at the current step
        # folder -> (its manifest's checksum, its manifest, or None if it failed verification): rotation hashes each
        # checkpoint once per process, not at every save; the writer records the folders it writes as verified
        self.verified: dict[Path, tuple[str | None, dict[str, Any] | None]] = {}
        self.started = time.time()

    def on_fit_start(self, run: Run) -> None:
        """Remove the half-written folders of a save that a crash interrupted (this run alone writes them)."""
        if run.strategy.is_main:
            # (.tmp-*: a runner from before runner.rundir.staged_folder named them so)
            for stale in [*staged_in(self.dir), *self.dir.glob(".tmp-*")]:
                shutil.rmtree(stale, ignore_errors=True)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Remember this step's monitored value (checkpoints record it; the best ones are kept)."""
        if self.monitor is not None:
            self.fresh = metrics[self.monitor]

    def on_step_end(self, run: Run) -> None:
        """Save when the interval ticks, when training ends, or when this step's validation is among the best."""
        self.check()
        if not self.buffers and self.thread is None and run.strategy.is_main and self.format_of(run) == "files":
            self.prepare(run)
        p, fresh, self.fresh = run.progress, self.fresh, None
        ends = p.finished or run.stop_reason is not None
        if p.ticked(self.interval) or ends or (fresh is not None and self._among_best(fresh)):
            with phase("checkpoints"):  # what the loop waits for: the snapshot, and the save before still writing
                self.save(run, fresh)
                if ends:  # what runs after the loop may change the weights (restore_best, EMA's at the end)
                    self.sharded.staged()

    def on_before_optimizer_step(self, run: Run) -> None:
        """An async save's copy of the shards, still under way in the background, ends before the step changes them."""
        if self.sharded.staging is not None:
            with phase("checkpoints"):
                self.sharded.staged()

    def on_fit_end(self, run: Run) -> None:
        """Wait for the last save and surface its error, if any; no rank leaves before it is on disk."""
        with phase("checkpoints"):
            self.wait()
        self.check()
        run.strategy.barrier()

    def state_dict(self) -> dict[str, Any]:
        """The monitored values of the checkpoints saved so far."""
        return {"scored": [list(x) for x in self.scored]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.scored = [list(x) for x in state["scored"]]

    def prepare(self, run: Run) -> None:
        """Allocate the snapshot buffers in the background (after the first step, when the optimizer state exists),
        so that the first save only copies (allocating and faulting in hundreds of MB would stall the loop)."""
        # rank 0 alone: no collective; every rank's RNG state has the shapes of this one, and FSDP shards the shapes
        # of the full tensors that a save gathers
        model, state = bare_names(run.task.state_dict()), training_state(run, gather=False)

        def allocate() -> None:
            _snapshot(model, self.buffers, "model", copy=False)
            _snapshot(state, self.buffers, "state", copy=False)

        self.thread = threading.Thread(target=allocate, daemon=True)
        self.thread.start()

    def format_of(self, run: Run) -> str:
        """'files' or 'dcp': `format`, with auto resolved by the strategy (dcp for fsdp and spread)."""
        return getattr(run.strategy, "checkpoint_format", "files") if self.format == "auto" else self.format

    def _among_best(self, value: float) -> bool:
        kept = sorted((v for v, _ in self.scored), key=self.order.key)[: self.keep_best]  # best first
        return len(kept) < self.keep_best or self.order.better(value, kept[-1])

    def save(self, run: Run, monitor_value: float | None = None) -> Path:
        """Snapshot the state to CPU now (the loop waits for this) and write it in the background."""
        self.wait()  # at most one save in flight; its buffers are reused
        self.check()
        p = run.progress
        folder = self.dir / f"{PREFIX}{p.step:08d}"
        if monitor_value is not None:
            self.scored.append([monitor_value, p.step])
        if self.format_of(run) == DCP:  # every rank writes its own shards
            seal = self.sharded.start(run, folder, self._info(run, monitor_value))
            if self.sharded.async_save:
                self.thread = threading.Thread(target=self._finish, args=(folder, seal), daemon=False)
                self.thread.start()
            else:
                self._finish(folder, seal)
            return folder
        state = training_state(run)  # collective: every rank's RNG states are gathered (and FSDP's shards)
        weights = model_weights(run)  # collective under FSDP
        if not run.strategy.is_main:
            return folder  # rank 0 owns the filesystem
        model = _snapshot(weights, self.buffers, "model")
        state = _snapshot(state, self.buffers, "state")
        if run.device.type == "cuda":  # the run's own device: with distributed.device=cuda:1 the current one is 0
            torch.cuda.synchronize(run.device)  # the non-blocking copies into pinned buffers land before the writer
        info = self._info(run, monitor_value)
        self.thread = threading.Thread(target=self.write, args=(folder, model, state, info), daemon=False)
        self.thread.start()
        return folder

    def _info(self, run: Run, monitor_value: float | None) -> dict[str, Any]:
        # the manifest's fields besides the files
        p = run.progress
        # the loop names max_duration only after the last step; a checkpoint of that step is of a finished run
        reason = run.stop_reason or (StopReason.MAX_DURATION if p.finished else None)
        return {
            "step": p.step,
            "epoch": p.epoch,
            "samples": p.samples,
            "stop_reason": reason.value if reason else None,
            "metrics": dict(run.state.metrics),
            "monitor": self.monitor,
            "monitor_value": monitor_value,
            "wall_time_s": time.time() - self.started,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config_sha256": run.settings.config_hash,
            "config": run.settings.config,
        }

    def write(self, folder: Path, model: dict, state: dict, info: dict) -> None:
        """In the writer thread: write the folder, point `last` at it, rotate; an error is kept for check()."""
        self._finish(folder, lambda: write_checkpoint(folder, model, state, info))

    def _finish(self, folder: Path, write: Callable[[], dict[str, Any] | None]) -> None:
        # put the checkpoint in place (`write`: its manifest, None on the ranks that do not own the folder), point
        # `last` at it, rotate; an error is kept for check()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            manifest = write()
            if manifest is None:
                return
            self.verified[folder] = (manifest[MANIFEST_SHA256], manifest)
            if self.save_last:
                link = self.dir / ".last.tmp"
                link.unlink(missing_ok=True)
                link.symlink_to(folder.name)
                os.replace(link, self.dir / "last")
            self._rotate()
        except BaseException as error:  # surfaced in the training thread by check()
            self.error = error
            if is_disk_full(error):  # one paragraph for the CLI (exit 2: runner.rundir.DiskFull says why not 75)
                where = f" ({error.filename})" if getattr(error, "filename", None) else ""  # a rank's shards
                self.error = disk_full(
                    f"saving checkpoint {folder}{where}", f"the earlier checkpoints in {self.dir} are intact"
                )

    def _manifests(self) -> list[dict[str, Any]]:
        """The manifests of the checkpoints that verify, newest first; the others are reported once, and kept."""
        found = []
        for folder in checkpoints(self.dir):
            try:  # cheap (a small JSON file): a folder written again since it was verified has a new checksum
                sealed = read_manifest(folder)[MANIFEST_SHA256]
            except CheckpointError:
                sealed = None
            if self.verified.get(folder, (False,))[0] != sealed:
                try:
                    self.verified[folder] = (sealed, verify(folder))
                except CheckpointError as error:
                    print(f"warning: {error}; rotation keeps it but does not count it", file=sys.stderr)
                    self.verified[folder] = (sealed, None)
            manifest = self.verified[folder][1]
            if manifest is not None:
                found.append({**manifest, "folder": folder})
        return found

    def _rotate(self) -> None:
        # Only checkpoints that verify count toward keep_last and keep_best: a corrupt newer folder must not push the
        # newest good one out. Corrupt folders are neither counted nor deleted (they may be looked into).
        manifests = self._manifests()  # newest first
        keep = {m["folder"] for m in manifests[: self.keep_last]}
        scored = [m for m in manifests if m.get("monitor_value") is not None]
        scored.sort(key=lambda m: self.order.key(m["monitor_value"]))
        keep |= {m["folder"] for m in scored[: self.keep_best]}
        for m in manifests:
            if m["folder"] not in keep:
                shutil.rmtree(m["folder"], ignore_errors=True)
                self.verified.pop(m["folder"], None)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def check(self) -> None:
        """Raise, in the training thread, an error the writer thread met."""
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, ConfigError):  # a full disk: one paragraph, no traceback
                raise error from None
            raise RuntimeError(f"saving a checkpoint in {self.dir} failed: {error}") from error
