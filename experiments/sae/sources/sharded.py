"""A source model sharded over the ranks with FSDP2 (source.shard=fsdp), for inference: each rank holds its shards
and runs its slice of every batch of inputs, and every rank gets every slice's rows (SourceModel.activations)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from experiments.sae.sources import pretrained
from runner.ckpt.sliced import materialize
from runner.data import map_rows
from runner.distributed.fsdp import local_shard, tied_parameters


def sharded(source: Any, shard: str | None) -> tuple[int, int] | None:
    """Shard `source`'s model (a SourceModel: its model, and its device, set here) over the ranks with FSDP2
    (`fully_shard`, inference only) when asked and there are several; (rank, world size), or None. A runner run's
    model is sharded already, as it was built (sharded_build); a transformers model is sharded here."""
    if not _several(shard):
        return None
    from torch.distributed.tensor import DTensor

    source.device = _device()
    if not any(isinstance(p, DTensor) for p in source.model.parameters()):
        shard_model(source.model, source.device)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def sharded_build(shard: str | None, device: torch.device | str, checkpoint: str) -> Iterator[torch.device]:
    """The device the source model goes to; inside, a runner run's model is sharded as soon as it is built, before
    its weights are read, so that each rank reads only its own shards' slices of the file (runner.load)."""
    if not _several(shard) or pretrained.is_pretrained(checkpoint):
        yield torch.device(device)
        return
    from runner.load import sharded_loads

    here = _device()
    with sharded_loads(lambda model: shard_model(model, here)):
        yield here  # where the sharded model is: moving it elsewhere would take its shards off the mesh


def _several(shard: str | None) -> bool:
    return shard is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _device() -> torch.device:
    from runner.distributed.env import environment, pick_device

    return pick_device("auto", environment()["local_rank"])


def shard_model(model: nn.Module, device: torch.device) -> None:
    """Shard `model` over every rank with FSDP2 on `device`'s kind, for inference. Every submodule that owns
    parameters is a unit, gathered for its own forward and freed after it: a rank holds its shards and one unit at a
    time. Every forward is then a collective, which the ranks run in step: the buffer's fills, validation's batches
    and the splicing pass are the same on every rank. Tied parameters stay with the root, gathered for the whole
    forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    # a tied parameter (a GPT's head and embedding) must sit in one group: the root's, which holds what no unit takes
    tied = tied_parameters(model)
    for module in reversed(list(model.modules())):  # children first, as fully_shard requires
        own = list(module.parameters(recurse=False))
        if module is not model and own and not any(id(p) in tied for p in own):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the root too: no backward will want them
    materialize(model, device)  # a model built empty (runner.load.sharded_loads) gets storage for its shards only
    if hasattr(model, "validation_step"):  # a runner task's loss is its validation_step, not forward()
        register_fsdp_forward_method(model, "validation_step")


def batch_slice(batch: Any, rank: int, world: int, size: int) -> Any:
    """This rank's contiguous share of a batch of `size` inputs (source.shard=fsdp: each rank runs its slice)."""
    # every tensor of the batch's `size` rows (windows, masks); other values (a count of tokens, which only the loss
    # reads, and a cut-short forward never reaches it) stay as they are
    return map_rows(batch, size, lambda t: torch.tensor_split(t, world)[rank])


def every_slice(rows: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's `rows` in rank order (their counts may differ: padded to the largest for the all-gather)."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    torch.distributed.all_gather(counts, torch.tensor([len(rows)]))  # gloo, on the host
    most = int(max(counts))
    padded = torch.cat([rows, rows.new_zeros(most - len(rows), *rows.shape[1:])])
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[: int(n)] for part, n in zip(parts, counts, strict=True)])


def source_parameters(model: nn.Module) -> dict[str, int]:
    """A sharded model's parameters (counted once, tied ones too) and the elements of them this rank holds."""
    params = list(model.parameters())
    local = [local_shard(p) for p in params]
    return {"whole": sum(p.numel() for p in params), "on_this_rank": sum(t.numel() for t in local)}
