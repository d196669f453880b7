"""Weights files: the bare model's weights as safetensors, with a sha256 record beside them that every load checks,
and loading weights into a model (init_from, runner.tools.evaluate, an SAE's source, finetune merge)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from runner import rundir
from runner.ckpt.files import (
    DCP,
    FILES,
    CheckpointError,
    bare_names,
    read_manifest,
    safetensors_bytes,
    verified,
)

# model.safetensors.sha256 beside each weights file that save_weights writes, in `sha256sum` format (`sha256sum -c`
# checks it by hand). A file of its own, not safetensors metadata: a checksum covers the whole file, header included,
# and a file given by a user or written by an older runner (no record) still loads.
RECORD = ".sha256"


def save_weights(model: torch.nn.Module | dict[str, torch.Tensor], path: str | Path) -> None:
    """The bare model's weights (or weights already gathered: model_weights) as safetensors, written atomically,
    with their sha256 in a record beside them (RECORD) that every load checks (read_weights)."""
    weights = bare_names(model.state_dict()) if isinstance(model, torch.nn.Module) else model
    data, path = safetensors_bytes(weights), Path(path)
    record = path.with_name(path.name + RECORD)
    # The old record goes first: a crash between the writes leaves weights without a record (loaded unchecked, as an
    # older run's are), never a record that disagrees with good weights.
    record.unlink(missing_ok=True)
    rundir.write_atomic(path, data, fsync=True)
    write_record(path, hashlib.sha256(data).hexdigest())


def write_record(path: Path, sha256: str) -> None:
    """The sha256 record beside the weights file `path` (RECORD), in `sha256sum` format."""
    rundir.write_atomic(path.with_name(path.name + RECORD), f"{sha256}  {path.name}\n".encode(), fsync=True)


def weight_parts(task: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The weights of each part of a task made of several models (`task.parts`: name -> prefix of its weights, as a
    family of SAEs has), under the part's own names: a file of its own loads into that part alone."""
    return {
        name: {key[len(prefix) :]: value for key, value in weights.items() if key.startswith(prefix)}
        for name, prefix in getattr(task, "parts", {}).items()
    }


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The bare model's weights from a checkpoint folder, a run folder or a .safetensors file, checked against the
    checkpoint's manifest or the file's sha256 record where there is one (save_weights writes it)."""
    from safetensors.torch import load as safetensors_load

    path = Path(path)
    folder, name = (path, "model.safetensors") if path.is_dir() else (path.parent, path.name)
    if (folder / "manifest.json").is_file() and name in FILES:  # a checkpoint folder, or its weights file
        manifest = read_manifest(folder)
        if manifest.get("format") == DCP:  # a distributed checkpoint: its shards, whole in this process
            from runner.ckpt.dcp import full_weights

            return full_weights(folder)
        return safetensors_load(verified(folder, name, manifest))
    file = path / rundir.MODEL if path.is_dir() else path
    try:
        data = file.read_bytes()
        weights = safetensors_load(_recorded(file, data))
    except CheckpointError:
        raise
    except Exception as error:  # missing, truncated, not safetensors at all
        raise unreadable(path, error) from None
    return weights


def unreadable(path: str | Path, error: BaseException) -> CheckpointError:
    """The error for weights at `path` that cannot be read (missing, truncated, not safetensors)."""
    return CheckpointError(
        f"cannot read weights from {path} ({error}); give a checkpoint folder, a run folder or a .safetensors file"
    )


def _recorded(file: Path, data: bytes) -> bytes:
    """`data` (the bytes of `file`) if they match the sha256 in the file's record, or if it has none."""
    check_record(file, hashlib.sha256(data).hexdigest())
    return data


def check_record(file: Path, actual: str) -> None:
    """Refuse `file` if `actual` (its sha256) is not the one in its record; a file without a record passes."""
    record = file.with_name(file.name + RECORD)
    try:
        expected = record.read_text(encoding="utf-8").split()[0]
    except FileNotFoundError:
        return  # a user's file, or an older run's
    except (OSError, ValueError, IndexError) as error:
        raise CheckpointError(f"{file}: its checksum record {record} cannot be read ({error})") from None
    if actual != expected:
        raise CheckpointError(
            f"{file} does not match the sha256 recorded in {record.name} when it was written (expected {expected}, "
            f"got {actual}): the file is corrupted (or replaced). Use a good copy, or write it again from the run's "
            "newest checkpoint (resume=auto writes a finished run's final files again)"
        )


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
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    usable, report = fitting({k: tuple(v.shape) for k, v in own.items()}, shapes, path, strict, what)
    with torch.no_grad():
        for name in usable:
            own[name].copy_(weights[name])
    return said(usable, len(own), path, what, say, report)


def fitting(
    own: dict[str, tuple], found: dict[str, tuple], path: str | Path, strict: bool, what: str
) -> tuple[list[str], dict[str, list[str]]]:
    """The names of the weights `found` (name -> shape) that fit the model's `own`, and the report of the missing,
    unexpected and shape-mismatched names; with `strict` any of them is an error (`what` names the setting in it)."""
    report = {
        "missing": sorted(set(own) - set(found)),
        "unexpected": sorted(set(found) - set(own)),
        "shape_mismatch": sorted(k for k in set(own) & set(found) if own[k] != found[k]),
    }
    problems = {k: v for k, v in report.items() if v}
    if problems and strict:
        details = "; ".join(f"{k}: {v[:5]}{' ...' if len(v) > 5 else ''}" for k, v in problems.items())
        hint = " Set init_strict=false to load the tensors that fit and keep the others as initialised."
        raise CheckpointError(f"{what}={path} does not fit the model ({details}).{hint if what == 'init_from' else ''}")
    return [k for k in found if k in own and own[k] == found[k]], report


def said(usable: list[str], total: int, path: str | Path, what: str, say: bool, report: dict) -> dict:
    """Print what was loaded (`say`: rank 0 does; init_from always, another setting only when something did not fit)
    and return `report` (fitting's)."""
    problems = {k: v for k, v in report.items() if v}
    if say and (what == "init_from" or problems):
        print(
            f"{what}: loaded {len(usable)} of {total} tensors from {path}"
            + "".join(f"; {k}: {len(v)}" for k, v in problems.items()),
            file=sys.stderr,
        )
    return report
