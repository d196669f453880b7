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
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError, rundir

PREFIX = "step-"
FILES = ("model.safetensors", "state.pt")
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
    files = manifest.get("files")
    entries = [files.get(name) for name in FILES] if isinstance(files, dict) else [None]
    if not isinstance(manifest.get("step"), int) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str) for e in entries
    ):
        raise CheckpointError(f"checkpoint {folder}: manifest.json lacks its step or the size and sha256 of {FILES}")
    return manifest


def _matches(folder: Path, name: str, expected: dict[str, Any], size: int, sha256: str) -> None:
    # a file of a checkpoint against its manifest entry: a short file is truncated, a same-size mismatch corrupted
    if size != expected["bytes"]:
        raise CheckpointError(f"checkpoint {folder}: {name} is {size} bytes, expected {expected['bytes']} (truncated)")
    if sha256 != expected["sha256"]:
        raise CheckpointError(f"checkpoint {folder}: {name} does not match its sha256 (corrupted)")


def verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a checkpoint, after checking its size and sha256 against the manifest."""
    try:
        data = (folder / name).read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({error})") from None
    _matches(
        folder, name, manifest["files"][name], len(data), hashlib.sha256(data).hexdigest()
    )  # (listed: read_manifest)
    return data


def verify(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder whose files match their sizes and sha256 (read in chunks, not loaded)."""
    manifest = read_manifest(folder)
    for name in FILES:
        digest, size = hashlib.sha256(), 0
        try:
            with open(folder / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as error:
            raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({error})") from None
        _matches(folder, name, manifest["files"][name], size, digest.hexdigest())
    return manifest


def load_checkpoint(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model weights, training state, manifest) of a verified checkpoint; never unpickles Python objects."""
    from safetensors.torch import load as safetensors_load

    folder = Path(folder)
    manifest = read_manifest(folder)
    weights = safetensors_load(verified(folder, "model.safetensors", manifest))
    try:
        state = torch.load(io.BytesIO(verified(folder, "state.pt", manifest)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:  # weights_only refuses pickled objects (and anything that would run code)
        raise CheckpointError(
            f"checkpoint {folder}: state.pt holds Python objects, not only tensors and plain values; refusing to "
            f"unpickle it ({str(error).splitlines()[0]})"
        ) from None
    except Exception as error:  # cut short or not a torch.save file (its manifest was rewritten to match)
        raise CheckpointError(
            f"checkpoint {folder}: state.pt cannot be read: truncated or not written by torch.save ({error})"
        ) from None
    return weights, state, manifest


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


def newest_valid(directory: Path) -> tuple[Path, tuple] | None:
    """The newest checkpoint in `directory` that verifies, with its contents; corrupt ones are reported and skipped.
    None when there is no checkpoint; CheckpointError when there are some and none verifies."""
    failures = []
    for folder in checkpoints(directory):
        try:
            return folder, load_checkpoint(folder)
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
