"""Weights read into a model already sharded over the ranks (FSDP2's DTensors: an FSDP init_from, the sharded source
model), each rank reading from the safetensors file only the rows its own shards hold (safe_open's slices). Nothing
is read whole on every rank but the tensors that are not sharded (buffers, a model of one rank). One rank checks the
file against its sha256 (its checkpoint's manifest or its record), in chunks, and tells the others: the ranks
together read the file once, plus one rank's check. A distributed checkpoint's weights are still read whole on each
rank (runner.ckpt.dcp.full_weights), then sliced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runner import rundir
from runner.ckpt.files import DCP, FILES, CheckpointError, _matches, bare_names, digest, read_manifest
from runner.ckpt.weights import check_record, fitting, read_weights, said, unreadable


def load_sliced(
    model: torch.nn.Module, path: str | Path, strict: bool = True, what: str = "init_from", say: bool = True
) -> dict[str, list[str]]:
    """load_weights for a sharded model (collective: every rank calls it): each rank copies into its shards only
    the slices of the weights they hold. The same checks, report and message as load_weights."""
    path = Path(path)
    folder, name = (path, "model.safetensors") if path.is_dir() else (path.parent, path.name)
    own = bare_names(model.state_dict(keep_vars=True))
    if (folder / "manifest.json").is_file() and name in FILES:  # a checkpoint folder, or its weights file
        manifest = _once(lambda: read_manifest(folder))
        if manifest.get("format") == DCP:  # its shards hold other slices than this world's: read whole, then sliced
            return _copy(own, _Whole(read_weights(folder)), path, (strict, what, say))
        _once(lambda: _matches(folder, name, manifest["files"][name], **_digest(folder / name)))
        file = folder / name
    else:
        file = path / rundir.MODEL if path.is_dir() else path
        _once(lambda: check_record(file, _digest(file, path)["sha256"]))
    try:
        weights = safe_open(str(file), framework="pt")
    except Exception as error:  # not safetensors at all (rank 0's check would have said it is cut short)
        raise unreadable(path, error) from None
    with weights:
        return _copy(own, weights, path, (strict, what, say))


def _copy(own: dict[str, torch.Tensor], weights: Any, path: Path, how: tuple[bool, str, bool]) -> dict[str, list]:
    # the weights that fit, each rank's slices of them copied into its shards; the report, as load_weights gives it
    strict, what, say = how
    found = {
        k: tuple(weights[k].shape if isinstance(weights, dict) else weights.get_slice(k).get_shape())
        for k in weights.keys()
    }  # noqa: SIM118 - safe_open is not a dict
    usable, report = fitting({k: tuple(v.shape) for k, v in own.items()}, found, path, strict, what)
    with torch.no_grad():
        for key in usable:
            _read_into(own[key], weights, key)
    return said(usable, len(own), path, what, say, report)


def _read_into(target: torch.Tensor, weights: Any, key: str) -> None:
    # a DTensor takes the rows (the block, for a 2-D mesh) its local shard holds; anything else the whole tensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        target.copy_(weights.get_tensor(key))
        return
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    local = target.to_local()
    if local.numel():  # a rank past the end of a small tensor's rows holds none
        local.copy_(weights.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])


class _Whole(dict):
    # weights already read whole, with safe_open's two readers: a tensor indexes by slices as its get_slice does
    def get_tensor(self, key: str) -> torch.Tensor:
        return self[key]

    def get_slice(self, key: str) -> torch.Tensor:
        return self[key]


def _digest(file: Path, given: Path | None = None) -> dict[str, Any]:
    # the file's size and sha256, in chunks; a file that cannot be read is said as read_weights says it
    try:
        found = digest(file)
    except OSError as error:
        raise unreadable(given or file, error) from None
    return {"size": found["bytes"], "sha256": found["sha256"]}


def _once(check: Any) -> Any:
    # `check` run by rank 0 alone, its result (or its CheckpointError) given to every rank
    several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if several and torch.distributed.get_rank() != 0:
        outcome: list[Any] = [None]
    else:
        try:
            outcome = [("ok", check())]
        except Exception as error:  # every rank must reach the broadcast, or the others wait forever
            outcome = [("error", str(error) if isinstance(error, CheckpointError) else repr(error))]
    if several:
        torch.distributed.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise CheckpointError(value)
    return value
