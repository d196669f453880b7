"""Writing distributed checkpoints (checkpoint.format=dcp; what they hold: runner.ckpt.dcp).

Every rank writes into one staging folder beside the final one (`.step-N.partial-PID`, PID being rank 0's, so the
crash clean-up of runner.rundir.staged_in finds it): DCP's shards, then its own small files. Then each rank hashes the
files it wrote, rank 0 gathers the hashes, writes the manifest last and renames the folder into place. A kill at any
moment leaves a staging folder that no reader takes for a checkpoint, and the earlier checkpoints as they were.

With `async`, the loop goes on at once: DCP's stager copies the shards into CPU memory kept from one save to the next
in a thread of its own, while the next step's forward and backward run; that step's optimizer step waits for the copy
(staged()), as it is the first to change the parameters and the optimizer's state. The buffers, which a forward may
change (a norm's running statistics, an SAE's firing counts), are copied at the save. The writing and the sealing go
on in the callback's writer thread, over a gloo group of their own (the training's collectives keep the default one).
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError, rundir
from runner.ckpt.dcp import PER_RANK, SHARED, sharded_state
from runner.ckpt.files import DCP, RANK_FILE, digest, write_manifest
from runner.ckpt.state import training_state
from runner.distributed.fsdp import local_shard
from runner.run import Run


def _bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def small_files(run: Run) -> dict[str, bytes]:
    """This rank's part of the training state besides the shards, serialised now (the loop goes on changing it):
    rank-K.pt (its run state, generators, data position) and, on rank 0, shared.pt (the rest)."""
    state = training_state(run, gather=False)  # no communication: its per-rank lists hold this rank's value
    del state["optimizer"]  # in the shards
    own = {k: state.pop(k)[0] for k in PER_RANK if k in state}
    files = {RANK_FILE.format(run.strategy.rank): _bytes(own)}
    if run.strategy.is_main:
        files[SHARED] = _bytes(state)
    return files


class ShardedWriter:
    """Starts a distributed checkpoint's save on every rank (start) and returns what seals it (run it at once, or in
    a writer thread with `async_save`)."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self.group: Any = None
        self.pid: int | None = None
        self.stager: Any = None
        self.staging: Future | None = None  # the copy of an async save's shards, until the loop has waited for it

    def _setup(self, run: Run) -> None:
        # collective, at the first save (every rank saves at the same step): rank 0's pid names the staging
        # folders; the writer's own gloo group keeps its collectives (in the writer thread) apart from training's
        self.pid = run.strategy.gather(os.getpid())[0]
        if run.strategy.world_size > 1:
            self.group = torch.distributed.new_group(backend="gloo")
        if self.async_save:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # One stager for the run: it keeps the CPU copies of the shards from one save to the next and only copies
            # into them (async_save's own stager would allocate and fault in all of them at every save, in the step)
            pinned = run.device.type == "cuda"
            self.stager = DefaultStager(StagingOptions(pinned, False, True, pinned))

    def staged(self) -> None:
        """Wait until the async save in flight has copied the shards (before anything changes the parameters or the
        optimizer's state); a failed copy is the seal's to report."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging.exception()

    def start(self, run: Run, folder: Path, info: dict[str, Any]) -> Callable[[], dict[str, Any] | None]:
        """Write (or with async_save, stage) this rank's shards of the checkpoint `folder`; returns the seal, which
        every rank must call: rank 0's returns the manifest of the checkpoint now in place, the others' None."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        if self.pid is None:
            self._setup(run)
        staging = folder.parent / rundir.files.STAGING.format(folder.name, self.pid)
        staging.mkdir(parents=True, exist_ok=True)
        files = small_files(run)
        state = sharded_state(run)
        if self.async_save:
            state["model"] = _buffers_copied(state["model"], run.task)
        single, writer = run.strategy.world_size == 1, FileSystemWriter(staging)
        if self.async_save:
            response = dcp.async_save(
                state, storage_writer=writer, process_group=self.group, async_stager=self.stager, no_dist=single
            )
            self.staging, pending = response.staging_completion, response.upload_completion
        else:
            try:
                pending = dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=single)
            except (Exception, CheckpointException) as error:  # on every rank when any failed: the seal says whose
                pending = error
        strategy, ranks = run.strategy, run.strategy.world_size

        def seal() -> dict[str, Any] | None:
            return self._seal(staging, folder, pending, files, (strategy.rank, ranks), info)

        return seal

    def _seal(
        self, staging: Path, folder: Path, pending: Any, files: dict[str, bytes], where: tuple[int, int], info: dict
    ) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

        rank, ranks = where
        failure: BaseException | None = None
        try:
            if isinstance(pending, BaseException):
                raise pending
            if isinstance(pending, Future):
                pending.result()  # DCP raises on every rank when any rank failed to write
            for name, data in files.items():
                rundir.write_atomic(staging / name, data, fsync=True)
            mine = [*files, *(p.name for p in staging.glob(f"__{rank}_*.distcp"))] + [".metadata"] * (rank == 0)
            report: dict[str, Any] | str = {name: digest(staging / name) for name in mine}
        except (Exception, CheckpointException) as error:  # every rank still joins the gather: rank 0 waits for it
            failure = _own(error, rank, folder)
            if ranks == 1:
                raise failure from None
            report = f"rank {rank}: {type(failure).__name__}: {str(failure).splitlines()[0]}"
        reports = self._gather(report, rank, ranks)
        if failure is not None:  # a rank's own full disk is its paragraph; the others stop as stopped by it
            raise failure
        if rank != 0:
            return None
        errors = [r for r in reports if isinstance(r, str)]
        if errors:
            raise RuntimeError("; ".join(errors))
        entries = {name: entry for r in reports for name, entry in r.items()}
        manifest = write_manifest(
            staging, {**info, "format": DCP, "world_size": ranks, "files": dict(sorted(entries.items()))}
        )
        _into_place(staging, folder)
        return manifest

    def _gather(self, report: Any, rank: int, ranks: int) -> list[Any]:
        if ranks == 1:
            return [report]
        reports: list[Any] | None = [None] * ranks if rank == 0 else None
        torch.distributed.gather_object(report, reports, dst=0, group=self.group)
        return reports or []


def _buffers_copied(model: dict[str, Any], task: torch.nn.Module) -> dict[str, Any]:
    # a buffer of the state (by its storage) copied now: the forward before the next optimizer step may change it
    buffers = {buffer.data_ptr() for buffer in task.buffers() if buffer.numel()}
    return {
        name: value.clone() if isinstance(value, torch.Tensor) and local_shard(value).data_ptr() in buffers else value
        for name, value in model.items()
    }


def _own(error: BaseException, rank: int, folder: Path) -> BaseException:
    # DCP raises the same CheckpointException on every rank, holding each failed rank's (exception, traceback): the
    # rank whose own write found its disk full raises that, naming its shards' file (the paragraph the CLI prints,
    # exit 2); the others raise the DCP error, and stop as stopped by that rank (runner.distributed.stopping)
    failures = getattr(error, "failures", None)
    own = failures.get(rank, (None,))[0] if isinstance(failures, dict) else None  # (not DCP's: said as it is)
    if isinstance(own, OSError | rundir.DiskFull) and rundir.is_disk_full(own):
        code = own.errno if isinstance(own, OSError) and own.errno else errno.ENOSPC
        return OSError(code, os.strerror(code), f"rank {rank}'s shards {folder / f'__{rank}_0.distcp'}")
    return error


def _into_place(staging: Path, folder: Path) -> None:
    # the staging folder renamed to the checkpoint's name; the same step saved again (an interval save, then the end
    # of training) replaces the older folder, kept aside until the new one is in
    old = folder.parent / rundir.files.STAGING.format(folder.name, f"{os.getpid()}.old")
    if folder.exists():
        rundir.files.remove(old)
        os.rename(folder, old)
    os.replace(staging, folder)
    rundir.fsync_dir(folder.parent)
    rundir.files.remove(old)


def checkpoint_format(format: str, options: dict[str, bool]) -> str:
    """checkpoint.format, checked; `options`: the callback's other keywords (`async`, a Python keyword, is one)."""
    unknown = set(options) - {"async"}
    if unknown:
        raise ConfigError(
            f"checkpoint has no option {', '.join(sorted(unknown))} (format, async, interval, keep_last...)"
        )
    if format not in ("auto", "files", DCP):
        raise ConfigError(
            f"checkpoint.format={format}: auto (dcp under fsdp and spread, files otherwise), files (model.safetensors "
            "and state.pt, gathered on rank 0) or dcp (each rank writes its own shards)"
        )
    return format
