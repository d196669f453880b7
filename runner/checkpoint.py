"""Checkpoint files: the training state (runner.state) written atomically in the background, verified on load.

A checkpoint is a folder `<dir>/step-00001000/` holding `model.safetensors` (the bare model's weights), `state.pt`
(everything else: optimizer, schedule, precision, progress, data position, RNG, callbacks, loggers; tensors and plain
Python values only, so it loads with `torch.load(weights_only=True)`) and `manifest.json` (step, metrics, wall time,
config hash, and the size and sha256 of each file). It is written under a temporary name, fsynced, renamed into place
and the folder fsynced: a crash leaves either the whole checkpoint or none.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner import ConfigError
from runner.callbacks import Best, Callback
from runner.progress import parse_duration
from runner.state import CheckpointError, bare_state_dict, model_weights, training_state

if TYPE_CHECKING:
    from runner.loop import Run

PREFIX = "step-"


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


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors(weights: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, DTensor) for v in weights.values()):  # would write this rank's shards as if whole
        raise RuntimeError("these weights are FSDP shards: gather them first (runner.state.model_weights, every rank)")

    # clone: safetensors refuses tensors that share storage (tied weights); each key gets its own copy
    return save({k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()})


def save_weights(model: torch.nn.Module | dict[str, torch.Tensor], path: str | Path) -> None:
    """The bare model's weights (or weights already gathered: model_weights) as safetensors, written atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    weights = bare_state_dict(model) if isinstance(model, torch.nn.Module) else model
    _write_synced(tmp, _safetensors(weights))
    os.replace(tmp, path)


def write_checkpoint(folder: Path, model: dict[str, torch.Tensor], state: dict[str, Any], info: dict[str, Any]) -> None:
    """Write a checkpoint folder atomically: temporary folder, fsync every file, rename, fsync the parent."""
    tmp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files = {"model.safetensors": _safetensors(model), "state.pt": buffer.getvalue()}
    manifest = {**info, "files": {}}
    for name, data in files.items():
        _write_synced(tmp / name, data)
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_synced(tmp / "manifest.json", (json.dumps(manifest, indent=2, default=str) + "\n").encode())
    _fsync_dir(tmp)
    if folder.exists():  # the same step saved twice (an interval save, then the end of training): keep the new one
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    _fsync_dir(folder.parent)


# ---- reading --------------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, or CheckpointError."""
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {folder} has no readable manifest.json ({error})") from None


def verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a checkpoint, after checking its size and sha256 against the manifest."""
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint {folder}: its manifest lists no {name}")
    try:
        data = (folder / name).read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({error})") from None
    if len(data) != expected["bytes"]:
        raise CheckpointError(
            f"checkpoint {folder}: {name} is {len(data)} bytes, expected {expected['bytes']} (truncated)"
        )
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"checkpoint {folder}: {name} does not match its sha256 (corrupted)")
    return data


def load_checkpoint(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model weights, training state, manifest) of a verified checkpoint; never unpickles Python objects."""
    from safetensors.torch import load as safetensors_load

    folder = Path(folder)
    manifest = read_manifest(folder)
    weights = safetensors_load(verified(folder, "model.safetensors", manifest))
    try:
        state = torch.load(io.BytesIO(verified(folder, "state.pt", manifest)), weights_only=True, map_location="cpu")
    except Exception as error:  # weights_only refuses pickled objects (and anything that would run code)
        raise CheckpointError(
            f"checkpoint {folder}: state.pt is not a plain tensor file, refusing it ({error})"
        ) from None
    return weights, state, manifest


def checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders in `directory`, newest (highest step) first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest_valid(directory: Path) -> tuple[Path, tuple] | None:
    """The newest checkpoint in `directory` that verifies, with its contents; corrupt ones are reported and skipped."""
    for folder in checkpoints(directory):
        try:
            return folder, load_checkpoint(folder)
        except CheckpointError as error:
            print(f"warning: {error}; skipping it", file=sys.stderr)
    return None


# ---- the callback ---------------------------------------------------------------------------------------------------
class Checkpoint(Callback):
    """Saves the full training state every `interval`, at the best validations, and at the end of training.

    Keeps the `keep_last` newest checkpoints and, apart from them, the `keep_best` best by `monitor`; `save_last`
    maintains a `last` symlink to the newest. Saving blocks the loop only while tensors are copied to CPU buffers;
    serialisation, checksums, fsync and rotation run in a background thread, one save at a time.
    """

    def __init__(
        self,
        dir: str,
        interval: str = "1ep",
        keep_last: int = 2,
        keep_best: int = 1,
        monitor: str | None = None,
        mode: str = "min",
        save_last: bool = True,
    ) -> None:
        if keep_last < 1:
            raise ConfigError(f"callbacks.checkpoint.keep_last must be >= 1 (resume needs one), got {keep_last}")
        self.dir, self.interval = Path(dir), parse_duration(interval)
        if self.interval.value <= 0:
            raise ConfigError(f"callbacks.checkpoint.interval={interval} must be longer than zero")
        self.keep_last, self.keep_best, self.save_last = keep_last, max(0, keep_best), save_last
        self.monitor = monitor if keep_best > 0 else None
        self.mode = Best(mode).mode  # Best checks that it is 'min' or 'max'
        # (value, step) of every checkpoint saved with a fresh monitored value: every rank decides the same saves
        # from it (a save is collective), without reading the disk that rank 0's writer is changing.
        self.scored: list[list[float]] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.fresh: float | None = None  # the monitored value of a validation at the current step
        self.started = time.time()

    def on_fit_start(self, run: Run) -> None:
        """Remove the half-written folders of a save that a crash interrupted."""
        if run.distributed.is_main:
            for stale in self.dir.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Remember this step's monitored value (checkpoints record it; the best ones are kept)."""
        if self.monitor is not None:
            self.fresh = metrics[self.monitor]

    def on_step_end(self, run: Run) -> None:
        """Save when the interval ticks, when training ends, or when this step's validation is among the best."""
        self.check()
        if not self.buffers and self.thread is None and run.distributed.is_main:
            self.prepare(run)
        p, fresh, self.fresh = run.progress, self.fresh, None
        ends = p.finished or run.stop_reason is not None
        if p.ticked(self.interval) or ends or (fresh is not None and self._among_best(fresh)):
            self.save(run, fresh)

    def on_fit_end(self, run: Run) -> None:
        """Wait for the last save and surface its error, if any; no rank leaves before it is on disk."""
        self.wait()
        self.check()
        run.distributed.barrier()

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
        model, state = bare_state_dict(run.task), training_state(run, gather=False)

        def allocate() -> None:
            _snapshot(model, self.buffers, "model", copy=False)
            _snapshot(state, self.buffers, "state", copy=False)

        self.thread = threading.Thread(target=allocate, daemon=True)
        self.thread.start()

    def _among_best(self, value: float) -> bool:
        kept = sorted((v for v, _ in self.scored), reverse=self.mode == "max")[: self.keep_best]  # best first
        return len(kept) < self.keep_best or (value < kept[-1] if self.mode == "min" else value > kept[-1])

    def save(self, run: Run, monitor_value: float | None = None) -> Path:
        """Snapshot the state to CPU now (the loop waits for this) and write it in the background."""
        self.wait()  # at most one save in flight; its buffers are reused
        self.check()
        p = run.progress
        folder = self.dir / f"{PREFIX}{p.step:08d}"
        if monitor_value is not None:
            self.scored.append([monitor_value, p.step])
        state = training_state(run)  # collective: every rank's RNG states are gathered (and FSDP's shards)
        weights = model_weights(run)  # collective under FSDP
        if not run.distributed.is_main:
            return folder  # rank 0 owns the filesystem
        model = _snapshot(weights, self.buffers, "model")
        state = _snapshot(state, self.buffers, "state")
        if any(t.is_cuda for t in run.task.parameters()):
            torch.cuda.synchronize()  # the non-blocking copies into pinned buffers must land before the writer reads
        info = {
            "step": p.step,
            "epoch": p.epoch,
            "samples": p.samples,
            # the loop names max_duration only after the last step; a checkpoint of that step is of a finished run
            "stop_reason": run.stop_reason or ("max_duration" if p.finished else None),
            "metrics": dict(run.metrics),
            "monitor": self.monitor,
            "monitor_value": monitor_value,
            "wall_time_s": time.time() - self.started,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config_sha256": run.config_hash,
        }
        self.thread = threading.Thread(target=self._write, args=(folder, model, state, info), daemon=False)
        self.thread.start()
        return folder

    def _write(self, folder: Path, model: dict, state: dict, info: dict) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_checkpoint(folder, model, state, info)
            if self.save_last:
                link = self.dir / ".last.tmp"
                link.unlink(missing_ok=True)
                link.symlink_to(folder.name)
                os.replace(link, self.dir / "last")
            self._rotate()
        except BaseException as error:  # surfaced in the training thread by check()
            self.error = error

    def _manifests(self) -> list[dict[str, Any]]:
        found = []
        for folder in checkpoints(self.dir):
            try:
                found.append({**read_manifest(folder), "folder": folder})
            except CheckpointError:
                continue
        return found

    def _rotate(self) -> None:
        manifests = self._manifests()  # newest first
        keep = {m["folder"] for m in manifests[: self.keep_last]}
        scored = [m for m in manifests if m.get("monitor_value") is not None]
        scored.sort(key=lambda m: m["monitor_value"], reverse=self.mode == "max")
        keep |= {m["folder"] for m in scored[: self.keep_best]}
        for m in manifests:
            if m["folder"] not in keep:
                shutil.rmtree(m["folder"], ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def check(self) -> None:
        """Raise, in the training thread, an error the writer thread met."""
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"saving a checkpoint in {self.dir} failed: {error}") from error
