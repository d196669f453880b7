"""Checkpoint files: write a checkpoint folder atomically, verify and read it; the bare model's weights as safetensors.

A checkpoint is a folder `<dir>/step-00001000/` holding `model.safetensors` (the bare model's weights), `state.pt`
(everything else: optimizer, schedule, precision, progress, data position, RNG, callbacks, loggers; tensors and plain
Python values only, so it loads with `torch.load(weights_only=True)`) and `manifest.json` (step, metrics, wall time,
config hash, and the size and sha256 of each file). It is written under a temporary name, fsynced, renamed into place
and the folder fsynced: a crash leaves either the whole checkpoint or none. What the state holds is runner.ckpt.state's;
when to save is runner.ckpt.callback's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
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
# model.safetensors.sha256 beside each weights file that save_weights writes, in `sha256sum` format (`sha256sum -c`
# checks it by hand). A file of its own, not safetensors metadata: a checksum covers the whole file, header included,
# and a file given by a user or written by an older runner (no record) still loads.
RECORD = ".sha256"
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


def _safetensors(weights: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, DTensor) for v in weights.values()):  # would write this rank's shards as if whole
        raise RuntimeError("these weights are FSDP shards: gather them first (runner.ckpt.state.model_weights)")

    # clone: safetensors refuses tensors that share storage (tied weights); each key gets its own copy
    metadata = ADAPTERS_ONLY if weights and all(ADAPTER in k for k in weights) else None
    return save({k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()}, metadata=metadata)


def save_weights(model: torch.nn.Module | dict[str, torch.Tensor], path: str | Path) -> None:
    """The bare model's weights (or weights already gathered: model_weights) as safetensors, written atomically,
    with their sha256 in a record beside them (RECORD) that every load checks (read_weights)."""
    weights = bare_names(model.state_dict()) if isinstance(model, torch.nn.Module) else model
    data, path = _safetensors(weights), Path(path)
    record = path.with_name(path.name + RECORD)
    # The old record goes first: a crash between the writes leaves weights without a record (loaded unchecked, as an
    # older run's are), never a record that disagrees with good weights.
    record.unlink(missing_ok=True)
    rundir.write_atomic(path, data, fsync=True)
    rundir.write_atomic(record, f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode(), fsync=True)


def weight_parts(task: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The weights of each part of a task made of several models (`task.parts`: name -> prefix of its weights, as a
    family of SAEs has), under the part's own names: a file of its own loads into that part alone."""
    return {
        name: {key[len(prefix) :]: value for key, value in weights.items() if key.startswith(prefix)}
        for name, prefix in getattr(task, "parts", {}).items()
    }


def write_checkpoint(
    folder: Path, model: dict[str, torch.Tensor], state: dict[str, Any], info: dict[str, Any]
) -> dict[str, Any]:
    """Write a checkpoint folder atomically: temporary folder, fsync every file, rename, fsync the parent; its
    manifest. A failure (a full disk) removes the temporary folder and leaves the other checkpoints as they were."""
    tmp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest = _write_folder(tmp, model, state, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():  # the same step saved twice (an interval save, then the end of training): keep the new one
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    rundir.fsync_dir(folder.parent)
    return manifest


def _write_folder(tmp: Path, model: dict[str, torch.Tensor], state: dict[str, Any], info: dict[str, Any]) -> dict:
    tmp.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files = {"model.safetensors": _safetensors(model), "state.pt": buffer.getvalue()}
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


def verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a checkpoint, after checking its size and sha256 against the manifest."""
    expected = manifest["files"][name]  # read_manifest checked that every file is listed
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


def verify(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder whose files match their sizes and sha256 (read in chunks, not loaded)."""
    manifest = read_manifest(folder)
    for name, expected in ((name, manifest["files"][name]) for name in FILES):
        digest, size = hashlib.sha256(), 0
        try:
            with open(folder / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as error:
            raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({error})") from None
        if size != expected["bytes"] or digest.hexdigest() != expected["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its size and sha256 (corrupted)")
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


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The bare model's weights from a checkpoint folder, a run folder or a .safetensors file, checked against the
    checkpoint's manifest or the file's sha256 record where there is one (save_weights writes it)."""
    from safetensors.torch import load as safetensors_load

    path = Path(path)
    folder, name = (path, "model.safetensors") if path.is_dir() else (path.parent, path.name)
    if (folder / "manifest.json").is_file() and name in FILES:  # a checkpoint folder, or its weights file
        return safetensors_load(verified(folder, name, read_manifest(folder)))
    file = path / rundir.MODEL if path.is_dir() else path
    try:
        data = file.read_bytes()
        weights = safetensors_load(_recorded(file, data))
    except CheckpointError:
        raise
    except Exception as error:  # missing, truncated, not safetensors at all
        raise CheckpointError(
            f"cannot read weights from {path} ({error}); give a checkpoint folder, a run folder or a .safetensors file"
        ) from None
    return weights


def _recorded(file: Path, data: bytes) -> bytes:
    """`data` (the bytes of `file`) if they match the sha256 in the file's record, or if it has none."""
    record = file.with_name(file.name + RECORD)
    try:
        expected = record.read_text(encoding="utf-8").split()[0]
    except FileNotFoundError:
        return data  # a user's file, or an older run's
    except (OSError, ValueError, IndexError) as error:
        raise CheckpointError(f"{file}: its checksum record {record} cannot be read ({error})") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointError(
            f"{file} does not match the sha256 recorded in {record.name} when it was written (expected {expected}, "
            f"got {actual}): the file is corrupted (or replaced). Use a good copy, or write it again from the run's "
            "newest checkpoint (resume=auto writes a finished run's final files again)"
        )
    return data


def load_weights(
    model: torch.nn.Module, path: str | Path, strict: bool = True, what: str = "init_from", say: bool = True
) -> dict:
    """Load only weights into `model` from a checkpoint folder, a run folder or a .safetensors file.

    Reports missing, unexpected and shape-mismatched keys; with `strict` any of them is an error (`what` names the
    setting in it), otherwise the matching tensors are loaded and the rest keep their initial values. `say`: print
    what was loaded (rank 0 does; the other ranks load the same quietly).
    """
    weights = read_weights(path)
    own = bare_names(model.state_dict())
    report = {
        "missing": sorted(set(own) - set(weights)),
        "unexpected": sorted(set(weights) - set(own)),
        "shape_mismatch": sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape),
    }
    problems = {k: v for k, v in report.items() if v}
    if problems and strict:
        details = "; ".join(f"{k}: {v[:5]}{' ...' if len(v) > 5 else ''}" for k, v in problems.items())
        hint = " Set init_strict=false to load the tensors that fit and keep the others as initialised."
        raise CheckpointError(f"{what}={path} does not fit the model ({details}).{hint if what == 'init_from' else ''}")
    usable = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
    with torch.no_grad():
        for name, tensor in usable.items():
            own[name].copy_(tensor)
    if say and (what == "init_from" or problems):
        print(
            f"{what}: loaded {len(usable)} of {len(own)} tensors from {path}"
            + "".join(f"; {k}: {len(v)}" for k, v in problems.items()),
            file=sys.stderr,
        )
    return report
