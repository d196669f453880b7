"""Distributed checkpoints (checkpoint.format=dcp): reading them, and the sharded state both sides use.

The model and the optimizer go through torch.distributed.checkpoint (DCP) as sharded state dicts under the bare
model's names (`get_state_dict`): each rank writes the shards it holds (`__RANK_N.distcp`) and reads the slices its
own shards need, whatever the world size that wrote them, so a checkpoint of N ranks resumes on M, or in one process.
The rest of the training state is small: `shared.pt` (rank 0's: schedule, precision, callbacks, loggers, shapes) and
each rank's `rank-K.pt` (its run state, generators and data position), both plain torch.save files. Writing is
runner.ckpt.dcp_writer's; the folder, manifest and checks are runner.ckpt.files'.

Nothing here unpickles Python objects: DCP's `.metadata` (a pickle) is read with an unpickler that builds only DCP's
metadata classes, its non-tensor values and the state files load with torch.load(weights_only=True), and every file is
checked against the manifest's sha256 before it is read.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.ckpt.files import (
    DCP,
    RANK_FILE,
    CheckpointError,
    bare_names,
    load_checkpoint,
    load_state_file,
    read_manifest,
    verify,
)
from runner.run import Run

PER_RANK = ("state", "rng", "data")  # training_state's entries that each rank has its own of
SHARED = "shared.pt"
# DCP in one process (no process group) warns at every save and load that it assumes one process: that is the intent
warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) .*single process")
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
}
_METADATA_CLASSES |= {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    # DCP's .metadata is a pickle: only its own record classes, torch sizes, dtypes and layouts may be built from it
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's .metadata")


@functools.cache
def _safe() -> tuple[type, type]:
    # DCP's reader and load planner made safe; built at the first use (importing DCP takes most of a second)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        # `.metadata` unpickled into DCP's metadata classes only, never arbitrary objects
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as error:
                raise CheckpointError(f"checkpoint {path.parent}: .metadata cannot be read ({error})") from None
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"checkpoint {path.parent}: .metadata is not DCP's metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        # non-tensor values (the optimizer's hyperparameters) loaded with weights_only=True
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafePlanner


def safe_reader(folder: Path) -> Any:
    """DCP's file reader of `folder`, whose `.metadata` (a pickle) builds DCP's metadata classes only."""
    return _safe()[0](folder)


def safe_planner() -> Any:
    """DCP's load planner, with the checkpoint's non-tensor values loaded with torch.load(weights_only=True)."""
    return _safe()[1]()


def _here(values: dict[str, Any]) -> dict[str, Any]:
    # distributed=spread: the other ranks' modules are meta placeholders here; their own ranks save and load them
    def real(value: Any) -> bool:
        if isinstance(value, dict):
            return all(real(v) for v in value.values())
        return not (isinstance(value, torch.Tensor) and value.is_meta)

    return {k: v for k, v in values.items() if real(v)}


def sharded_state(run: Run) -> dict[str, Any]:
    """The model's and the optimizer's state dicts as DCP saves them: this rank's shards (FSDP's DTensors, spread's own
    modules, whole tensors otherwise), under the bare model's names. No communication."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(run.task, run.optimizer)
    return {"model": _here(model), "optimizer": {**optimizer, "state": _here(optimizer["state"])}}


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    # A fresh optimizer has no state to load into: one step of zero gradients at learning rate 0 makes it, leaving
    # the parameters as they are (get_state_dict's own would also step spread's meta placeholders, which fused
    # optimizers refuse; without a gradient they are skipped)
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and not p.is_meta]
    for param in params:
        param.grad = torch.zeros_like(param)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for param in params:
        param.grad = None


class Shards:
    """The model and optimizer of a distributed checkpoint, read by each rank into its own shards (restore calls
    load_into: a collective)."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder, self.manifest = folder, manifest

    def load_into(self, run: Run) -> None:
        """Load the shards this rank's model and optimizer hold (collective; resharded from any world size)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        _init_state(run.optimizer)
        target = sharded_state(run)
        saved = set(safe_reader(self.folder).read_metadata().state_dict_metadata)
        # a parameter the saved run never stepped has no optimizer state there (get_state_dict made some here)
        target["optimizer"]["state"] = {
            name: {k: v for k, v in s.items() if f"optimizer.state.{name}.{k}" in saved}
            for name, s in target["optimizer"]["state"].items()
            if any(f"optimizer.state.{name}.{k}" in saved for k in s)
        }
        partial = len(target["model"]) < len(run.task.state_dict())  # spread: the others' modules are not here
        dcp.load(
            target,
            storage_reader=safe_reader(self.folder),
            planner=safe_planner(),
            no_dist=run.strategy.world_size == 1,
        )
        set_state_dict(
            run.task,
            run.optimizer,
            model_state_dict=target["model"],
            optim_state_dict=target["optimizer"],
            options=StateDictOptions(strict=not partial),
        )


def open_checkpoint(folder: str | Path, strategy: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(weights, training state, manifest) of a verified checkpoint of either format, for runner.ckpt.state.restore.

    A distributed one is collective: the ranks split the checking of its files, each loads the shared state and its
    own rank's (rank K of M takes rank K mod N's of a checkpoint written by N), and the weights are its Shards."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("format", "files") != DCP:
        return load_checkpoint(folder)
    check_shares(folder, strategy.rank, strategy.world_size, strategy.gather)
    state = load_state_file(folder, SHARED, manifest)
    own = load_state_file(folder, RANK_FILE.format(strategy.rank % manifest["world_size"]), manifest)
    return Shards(folder, manifest), {**state, **{k: [v] for k, v in own.items()}}, manifest


def check_shares(folder: Path, rank: int, ranks: int, gather: Callable[[str | None], list[str | None]]) -> None:
    """Every file of a distributed checkpoint against its sha256, the ranks splitting the files (each checks its
    share); `gather` gives every rank's finding, and every rank raises the first error any rank found."""
    errors = gather(check_share(folder, rank, ranks))
    if any(errors):
        raise CheckpointError(next(e for e in errors if e))


def check_share(folder: Path, rank: int, ranks: int) -> str | None:
    """This rank's share of a checkpoint's files (every ranks-th from the rank-th) checked against their sha256:
    None, or what is wrong."""
    try:
        verify(folder, (rank, ranks))
    except CheckpointError as error:
        return str(error)
    return None


def full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The bare model's whole weights from a verified distributed checkpoint, in this one process (tools, init_from)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(folder)
    metadata = safe_reader(folder).read_metadata().state_dict_metadata
    model = {
        name[len("model.") :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in metadata.items()
        if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({"model": model}, storage_reader=safe_reader(folder), planner=safe_planner(), no_dist=True)
    return bare_names(model)
