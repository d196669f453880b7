"""Checkpoint files: write a checkpoint folder atomically, verify and read it (weights files: runner.ckpt.weights).

A checkpoint is a folder `<dir>/step-00001000/` holding `model.safetensors` (the bare model's weights), `state.pt`
(everything else: optimizer, schedule, precision, progress, data position, RNG, callbacks, loggers; tensors and plain
Python values only, so it loads with `torch.load(weights_only=True)`) and `manifest.json` (step, metrics, wall time,
config hash, and the size and sha256 of each file). It is written under a staging name (runner.rundir.staged_folder),
fsynced, renamed into place and the folder fsynced: a crash leaves either the whole checkpoint or none. What the state
holds is runner.ckpt.state's; when to save is runner.ckpt.callback's.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError, rundir

PREFIX = "step-"
FILES = ("model.safetensors", "state.pt")
# A distributed checkpoint (checkpoint.format=dcp, runner.ckpt.dcp) holds DCP's shards (__RANK_N.distcp) and .metadata,
# the state every rank shares (shared.pt) and each rank's own (rank-RANK.pt); its manifest says "format": "dcp".
DCP = "dcp"
DCP_FILES = (".metadata", "shared.pt")
RANK_FILE = "rank-{}.pt"
MANIFEST_SHA256 = "manifest_sha256"
# In a weight's name: a LoRA adapter's (PEFT's lora_A / lora_B). A file of only those says so in its metadata.
ADAPTER = "lora_"
ADAPTERS_ONLY = {"runner_weights": "lora_adapters_only: merge with python -m runner.finetune merge RUN_DIR"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, unsafe, or from an incompatible run."""


def bare_names(state: dict[str, Any]) -> dict[str, Any]:
    """A model's state_dict under the names of the bare model: no DDP `module.`, no torch.compile `_orig_mod.`."""
    bare = {}
    for name, tensor in state.items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        bare[name.replace("._orig_mod.", ".")] = tensor  # a compiled submodule
    return bare


def safetensors_bytes(weights: dict[str, torch.Tensor]) -> bytes:
    """`weights` as the bytes of a safetensors file (on the CPU; an adapters-only file says so in its metadata)."""
    from safetensors.torch import save
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, DTensor) for v in weights.values()):  # would write this rank's shards as if whole
        raise RuntimeError("these weights are FSDP shards: gather them first (runner.ckpt.state.model_weights)")

    # clone: safetensors refuses tensors that share storage (tied weights); each key gets its own copy
    metadata = ADAPTERS_ONLY if weights and all(ADAPTER in k for k in weights) else None
    return save({k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()}, metadata=metadata)


def write_checkpoint(
    folder: Path, model: dict[str, torch.Tensor], state: dict[str, Any], info: dict[str, Any]
) -> dict[str, Any]:
    """Write a checkpoint folder atomically: staging folder, fsync every file, rename, fsync the parent; its
    manifest. A failure (a full disk) removes the staging folder and leaves the other checkpoints as they were. The
    same step saved twice (an interval save, then the end of training) keeps the new one."""
    with rundir.staged_folder(folder, replace=True, fsync=True) as tmp:
        manifest = _write_folder(tmp, model, state, info)
    return manifest


def _write_folder(tmp: Path, model: dict[str, torch.Tensor], state: dict[str, Any], info: dict[str, Any]) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files = {"model.safetensors": safetensors_bytes(model), "state.pt": buffer.getvalue()}
    manifest = {**info, "files": {}}
    for name, data in files.items():
        rundir.write_atomic(tmp / name, data, fsync=True)
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return write_manifest(tmp, manifest)


def write_manifest(tmp: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Seal a staged checkpoint folder: its manifest, with its own checksum, written last; the folder fsynced."""
    manifest = json.loads(json.dumps(manifest, default=str))  # what a reader will see: the checksum is of that
    manifest[MANIFEST_SHA256] = manifest_checksum(manifest)
    rundir.write_atomic(tmp / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode(), True)
    rundir.fsync_dir(tmp)
    return manifest


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The manifest's own checksum: sha256 of its other keys in a canonical order (a flipped bit or edited step)."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


# ---- reading --------------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked against its own checksum and for the fields a resume reads."""
    manifest = rundir.read_json(folder / "manifest.json")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {folder} has no readable manifest.json (missing, cut short or not JSON)")
    if manifest.get(MANIFEST_SHA256) != manifest_checksum(manifest):
        raise CheckpointError(
            f"checkpoint {folder}: manifest.json does not match its own checksum (edited, corrupted, or written by a "
            "runner older than the checksum)"
        )
    files, required = manifest.get("files"), required_files(manifest)
    entries = [files.get(name) for name in required] if isinstance(files, dict) and required else [None]
    if isinstance(files, dict):
        entries += list(files.values())
    if not isinstance(manifest.get("step"), int) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str) for e in entries
    ):
        raise CheckpointError(
            f"checkpoint {folder}: manifest.json lacks its step or the size and sha256 of {required or FILES}"
        )
    return manifest


def required_files(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The files a checkpoint of this manifest's format must hold (every rank's own, for a distributed one)."""
    if manifest.get("format", "files") != DCP:
        return FILES
    ranks = manifest.get("world_size")
    if not isinstance(ranks, int) or ranks < 1:
        return ()
    return (*DCP_FILES, *(RANK_FILE.format(rank) for rank in range(ranks)))


def _label(name: str) -> str:
    # a distributed checkpoint's file names the rank that wrote it: the one whose disk or process to look at
    rank = name[2:].partition("_")[0] if name.startswith("__") and name.endswith(".distcp") else None
    if name.startswith("rank-") and name.endswith(".pt"):
        rank = name[len("rank-") : -len(".pt")]
    return f"{name} (written by rank {rank})" if rank is not None and rank.isdigit() else name


def _matches(folder: Path, name: str, expected: dict[str, Any], size: int, sha256: str) -> None:
    # a file of a checkpoint against its manifest entry: a short file is truncated, a same-size mismatch corrupted
    if size != expected["bytes"]:
        raise CheckpointError(
            f"checkpoint {folder}: {_label(name)} is {size} bytes, expected {expected['bytes']} (truncated)"
        )
    if sha256 != expected["sha256"]:
        raise CheckpointError(f"checkpoint {folder}: {_label(name)} does not match its sha256 (corrupted)")


def verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a checkpoint, after checking its size and sha256 against the manifest."""
    try:
        data = (folder / name).read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint {folder}: cannot read {_label(name)} ({error})") from None
    _matches(
        folder, name, manifest["files"][name], len(data), hashlib.sha256(data).hexdigest()
    )  # (listed: read_manifest)
    return data


def hash_into(sha256: Any, path: Path) -> int:
    """Feed the file at `path` to the hash `sha256` in chunks, not loaded; the bytes read."""
    # one 1 MiB buffer read into again and again: a fresh chunk a read would take twice its size at the turn (the old
    # one still held), in the arena of whichever thread hashes (a checkpoint writer's, beside the training's memory)
    size, buffer = 0, bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            sha256.update(view[:count])
            size += count
    return size


def digest(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its size and sha256."""
    sha256 = hashlib.sha256()
    return {"bytes": hash_into(sha256, path), "sha256": sha256.hexdigest()}


def verify(folder: Path, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The manifest of a checkpoint folder whose files match their sizes and sha256 (read in chunks, not loaded).
    `share` (rank, ranks): check only every ranks-th file from the rank-th, so that ranks split the reading."""
    manifest = read_manifest(folder)
    names = FILES if manifest.get("format", "files") != DCP else sorted(manifest["files"])
    for name in names[share[0] :: share[1]]:
        try:
            found = digest(folder / name)
        except OSError as error:
            raise CheckpointError(f"checkpoint {folder}: cannot read {_label(name)} ({error})") from None
        _matches(folder, name, manifest["files"][name], found["bytes"], found["sha256"])
    return manifest


def load_checkpoint(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model weights, training state, manifest) of a verified checkpoint; never unpickles Python objects."""
    from safetensors.torch import load as safetensors_load

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("format", "files") == DCP:
        raise CheckpointError(
            f"checkpoint {folder} is a distributed checkpoint (checkpoint.format=dcp): its shards are loaded by "
            "runner.ckpt.dcp.open_checkpoint (a resume does), its weights by runner.ckpt.weights.read_weights"
        )
    weights = safetensors_load(verified(folder, "model.safetensors", manifest))
    return weights, load_state_file(folder, "state.pt", manifest), manifest


def load_state_file(folder: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's file of tensors and plain values (state.pt, a rank's rank-K.pt), verified, loaded with
    torch.load(weights_only=True): never unpickles Python objects."""
    try:
        return torch.load(io.BytesIO(verified(folder, name, manifest)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:  # weights_only refuses pickled objects (and anything that would run code)
        raise CheckpointError(
            f"checkpoint {folder}: {_label(name)} holds Python objects, not only tensors and plain values; refusing "
            f"to unpickle it ({str(error).splitlines()[0]})"
        ) from None
    except Exception as error:  # cut short or not a torch.save file (its manifest was rewritten to match)
        raise CheckpointError(
            f"checkpoint {folder}: {_label(name)} cannot be read: truncated or not written by torch.save ({error})"
        ) from None


def checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders in `directory`, newest (highest step) first."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if p.is_dir() and not p.is_symlink() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    # By step number, not by name: past step 99,999,999 the names outgrow their 8 digits and sort wrong.
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


def newest_valid(directory: Path, load: Callable[[Path], tuple] | None = None) -> tuple[Path, tuple] | None:
    """The newest checkpoint in `directory` that verifies, with its contents (`load`'s: load_checkpoint's unless
    given); corrupt ones are reported and skipped. None when there is no checkpoint; CheckpointError when there are
    some and none verifies."""
    failures = []
    for folder in checkpoints(directory):
        try:
            return folder, (load or load_checkpoint)(folder)
        except CheckpointError as error:
            print(f"warning: {error}; skipping it", file=sys.stderr)
            failures.append(str(error))
    if failures:
        # Starting from step 0 would retrain over this run's metrics.jsonl as if nothing had been saved
        raise CheckpointError(
            f"none of the {len(failures)} checkpoints in {directory} verifies ({'; '.join(failures)}), so this run "
            "cannot be resumed. Restore a good copy of a checkpoint folder there, or resume from one elsewhere with "
            "resume=<checkpoint folder>, or train again from step 0 in this run folder with resume=scratch (the "
            "run's earlier files are moved to before-scratch-<time>/ in it, not deleted)"
        )
    return None
