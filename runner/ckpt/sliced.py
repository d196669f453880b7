"""Weights read into a model already sharded over the ranks (FSDP2's DTensors: an FSDP init_from, the sharded source
model), each rank reading from the safetensors file only the rows its own shards hold (safe_open's slices). Nothing
is read whole on every rank but the tensors that are not sharded (buffers, a model of one rank). One rank checks the
file against its sha256 (its checkpoint's manifest or its record), in chunks, and tells the others: the ranks
together read the file once, plus one rank's check. A distributed checkpoint's are read by DCP's own load, each rank
reading the chunks of its files that its shards overlap.

Such a model is built with its parameters on the meta device (`built`: no storage, no random init), sharded, and only
then given storage for its own shards (`materialize`): no rank initialises or reads a whole parameter. Its buffers are
built as usual (a rotary table or a causal mask is computed by the constructor and is in no file)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from runner import rundir
from runner.ckpt.files import DCP, FILES, CheckpointError, _matches, bare_names, digest, read_manifest
from runner.ckpt.weights import check_record, fitting, said, unreadable


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
        if manifest.get("format") == DCP:  # its shards are another world's: DCP reads the chunks this rank's overlap
            return _distributed(own, folder, path, (strict, what, say))
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


def built(make: Callable[[], nn.Module], device: torch.device, empty: bool = False) -> nn.Module:
    """A model whose weights are all read from a file next: built without moving the caller's random streams (its
    init is overwritten), on `device`; with `empty`, its parameters on the meta device and its buffers on `device`."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if empty:
            try:
                with _parameters_on_meta():
                    model = make()
            except Exception:  # a constructor that reads its parameters' values (.item()) builds only with storage
                empty = False
        if not empty:
            return make().to(device)
    with torch.no_grad():  # buffers are set through the module, which keeps their persistence
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    # Every parameter a module registers in this thread goes to the meta device; a parameter met again (a tied head
    # and embedding) is the one meta Parameter already registered, kept as it is: the tie stays one object. The
    # patch of nn.Module is process-wide while any thread builds on meta, but acts only in the threads that asked
    # (a data loader's thread or a notebook's other cell building a model meanwhile gets real parameters).
    global _original, _open
    with _patch_lock:
        if _open == 0:
            _original = nn.Module.register_parameter
            nn.Module.register_parameter = _register  # type: ignore[method-assign]
        _open += 1
    _on_meta.depth = getattr(_on_meta, "depth", 0) + 1
    try:
        with _Unfilled():  # a torch function mode: this thread's alone
            yield
    finally:
        _on_meta.depth -= 1
        with _patch_lock:
            _open -= 1
            if _open == 0:
                nn.Module.register_parameter, _original = _original, None  # type: ignore[method-assign]


_patch_lock = threading.Lock()
_on_meta = threading.local()  # depth: this thread's nesting of _parameters_on_meta
_open = 0  # how many _parameters_on_meta are open, in every thread
_original: Callable[..., None] | None = None  # nn.Module.register_parameter while patched


def _register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    assert _original is not None  # only installed while a thread builds on meta
    _original(module, name, param)
    if getattr(_on_meta, "depth", 0) and param is not None and not param.is_meta:
        moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)
        module._parameters[name] = moved


# In-place writes of values (nn.init's fills) that a tensor on the meta device has no values for
_FILLS = {"normal_", "uniform_", "fill_", "zero_", "copy_", "erfinv_", "mul_", "add_", "div_", "clamp_", "exponential_"}


class _Unfilled(TorchFunctionMode):
    # nn.init's fills of a meta parameter skipped, not dispatched: some (normal_) would load torch's Python meta
    # kernels and sympy, ~120 MB of host memory for a process that never needed them, and change nothing
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        target = args[0] if args else (kwargs or {}).get("tensor")  # nn.init's functions name theirs
        if getattr(func, "__name__", None) in _FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **(kwargs or {}))


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give storage on `device` to the parameters of `model` still on the meta device (after sharding: each rank's
    shards only), uninitialised: the weights read next fill them. Each stays the same Parameter, ties included."""
    with torch.no_grad():
        for param in model.parameters():  # a tied parameter once
            if param.is_meta:
                empty = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, empty)


def _copy(own: dict[str, torch.Tensor], weights: Any, path: Path, how: tuple[bool, str, bool]) -> dict[str, list]:
    # the weights that fit, each rank's slices of them copied into its shards; the report, as load_weights gives it
    strict, what, say = how
    found = {k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()}  # noqa: SIM118 - not a dict
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


def _distributed(
    own: dict[str, torch.Tensor], folder: Path, path: Path, how: tuple[bool, str, bool]
) -> dict[str, list]:
    # a distributed checkpoint's model, read by DCP's own load in place into each rank's shards (a DTensor takes only
    # the chunks of the files that its local shard overlaps), checked by one rank; the report, as load_weights gives it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runner.ckpt.dcp import check_shares, safe_planner, safe_reader

    strict, what, say = how
    check_shares(folder, *_world(), _gathered)  # every file of it, the ranks splitting them as a resume does
    metadata = safe_reader(folder).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in metadata.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    saved = {k.removeprefix("model."): v.size for k, v in tensors.items()}
    names = bare_names({name: name for name in saved})  # the bare model's name -> the name it is saved under
    found = {bare: tuple(saved[name]) for bare, name in names.items()}
    usable, report = fitting({k: tuple(v.shape) for k, v in own.items()}, found, path, strict, what)
    with torch.no_grad():
        target = {"model": {names[key]: own[key] for key in usable}}
        dcp.load(target, storage_reader=safe_reader(folder), planner=safe_planner(), no_dist=_world()[1] == 1)
    return said(usable, len(own), path, what, say, report)


def _gathered(found: str | None) -> list[str | None]:
    # every rank's finding (dcp.check_shares' gather), through the default group
    rank, ranks = _world()
    out: list[str | None] = [None] * ranks
    if ranks > 1:
        torch.distributed.all_gather_object(out, found)
    out[rank] = found
    return out


def _world() -> tuple[int, int]:
    # (this rank, ranks) of the default group; (0, 1) in one process
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _digest(file: Path, given: Path | None = None) -> dict[str, Any]:
    # the file's size and sha256, in chunks; a file that cannot be read is said as read_weights says it
    try:
        found = digest(file)
    except OSError as error:
        raise unreadable(given or file, error) from None
    return {"size": found["bytes"], "sha256": found["sha256"]}


def _once(check: Any) -> Any:
    # `check` run by rank 0 alone, its result (or its CheckpointError) given to every rank
    rank, ranks = _world()
    if rank != 0:
        outcome: list[Any] = [None]
    else:
        try:
            outcome = [("ok", check())]
        except Exception as error:  # every rank must reach the broadcast, or the others wait forever
            outcome = [("error", str(error) if isinstance(error, CheckpointError) else repr(error))]
    if ranks > 1:
        torch.distributed.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise CheckpointError(value)
    return value
