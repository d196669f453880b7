"""A family of SAEs spread over the ranks (distributed=spread, sparsify's `distribute_modules`): each SAE lives on one
rank, which trains it on every rank's rows of its columns. The rows reach their SAEs' ranks by one all-to-all per
batch, and each step's metrics reach every rank by one small all-reduce, so that every rank logs, validates and stops
as one process would. No gradient crosses ranks: an SAE's whole batch is on its own rank."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from runner import ConfigError

Batch = torch.Tensor | tuple[torch.Tensor, ...]


def placement(sizes: list[int], world_size: int) -> list[int]:
    """Each SAE's rank, balanced by size (parameters): the largest first, each onto the least loaded rank (the lowest
    of equals), so that every rank gets one when there are as many SAEs as ranks."""
    if len(sizes) < world_size:
        raise ConfigError(
            f"distributed=spread puts each SAE of the family on one rank: {len(sizes)} SAEs leave "
            f"{world_size - len(sizes)} of the {world_size} ranks without one; use as many ranks as SAEs or fewer "
            "(torchrun --nproc_per_node), or distributed=ddp"
        )
    load, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = min(range(world_size), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


class Spread:
    """Where each SAE of a family lives and what it reads: `owners` (name -> rank) and `spans` (name -> its columns
    of a row, (start, end); None: every column)."""

    def __init__(self, owners: dict[str, int], spans: dict[str, tuple[int, int] | None]) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owners, self.spans = owners, spans
        self.mine = [name for name, rank in owners.items() if rank == self.rank]
        self.layouts: dict[str, tuple[int, list[tuple[str, str, torch.Size, torch.dtype]]]] = {}
        self.plans: dict[int, tuple[list[list[tuple[int, int]]], dict[str, tuple[int, int]]]] = {}  # by row width

    def _columns(self, rank: int, width: int) -> list[tuple[int, int]]:
        # the column ranges rank `rank`'s SAEs read, merged, in order
        spans = sorted(self.spans[name] or (0, width) for name, r in self.owners.items() if r == rank)
        merged: list[tuple[int, int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def _sizes(self, rows: int, layout: int) -> list[tuple[int, int]]:
        # every rank's batch size and metric layout, by rank: one tiny host collective (gloo, also beside NCCL)
        mine = torch.tensor([rows, layout], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [(int(t[0]), int(t[1])) for t in every]

    def _plan(self, width: int) -> tuple[list[list[tuple[int, int]]], dict[str, tuple[int, int]]]:
        # for rows `width` wide (made once): the column ranges each rank reads, and where each of this rank's SAEs'
        # columns sit among the ones it receives
        if width not in self.plans:
            ranges = [self._columns(rank, width) for rank in range(self.world_size)]
            at, starts = 0, {}
            for first, last in ranges[self.rank]:
                starts[first], at = at, at + last - first
            where = {}
            for name in self.mine:
                start, end = self.spans[name] or (0, width)
                first = next(a for a, b in ranges[self.rank] if a <= start < b)
                where[name] = (starts[first] + start - first, starts[first] + end - first)
            self.plans[width] = (ranges, where)
        return self.plans[width]

    def rows(self, batch: Batch) -> dict[str, Batch]:
        """Each of this rank's SAEs' rows: its columns of every rank's batch, in rank order (the global batch)."""
        parts = list(batch) if isinstance(batch, (tuple, list)) else [batch]
        sizes = [n for n, _ in self._sizes(parts[0].shape[0], 0)]
        routed = [(self._exchange(t, sizes), self._plan(t.shape[-1])[1]) for t in parts]
        out = {}
        for name in self.mine:
            mine = [t[:, slice(*where[name])] for t, where in routed]
            out[name] = type(batch)(mine) if isinstance(batch, (tuple, list)) else mine[0]
        return out

    def _exchange(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # flat pieces with their sizes (alltoallv): gloo's list form wants one shape for every peer
        ranges = self._plan(t.shape[-1])[0]
        send = [torch.cat([t[:, a:b] for a, b in columns], 1) for columns in ranges]
        mine = sum(b - a for a, b in ranges[self.rank])
        received = t.new_empty(sum(sizes) * mine)
        dist.all_to_all_single(
            received,
            torch.cat([part.reshape(-1) for part in send]),
            [n * mine for n in sizes],
            [part.numel() for part in send],
        )
        return received.view(sum(sizes), mine)

    def share(self, kind: str, own: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
        """Every SAE's outputs on every rank, from each rank's own (`kind`: a step's name, each kind keeps its own
        layout): one all-reduce of a float64 vector on the device, which the host does not wait for. Values come
        detached, in each output's own dtype and shape."""
        entries = [(name, key, torch.as_tensor(v)) for name, out in own.items() for key, v in out.items()]
        signature = repr([(n, k, tuple(v.shape), str(v.dtype)) for n, k, v in entries])
        code = zlib.crc32(signature.encode())
        codes = [c for _, c in self._sizes(0, code)]  # an output that comes and goes changes the layout
        known = self.layouts.get(kind)
        if known is None or known[0] != codes:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, [(n, k, v.shape, v.dtype) for n, k, v in entries])
            layout = sorted((x for part in everyone for x in part), key=lambda x: list(self.owners).index(x[0]))
            known = self.layouts[kind] = (codes, layout)
        layout = known[1]
        device = next((v.device for _, _, v in entries), torch.device("cpu"))
        flat = torch.zeros(sum(shape.numel() for _, _, shape, _ in layout), dtype=torch.float64, device=device)
        at, offsets = 0, {}
        for name, key, shape, _ in layout:
            offsets[(name, key)] = at
            at += shape.numel()
        for name, key, value in entries:
            start = offsets[(name, key)]
            flat[start : start + value.numel()] = value.detach().reshape(-1).to(device, torch.float64)
        dist.all_reduce(flat)
        shared: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.owners}
        for name, key, shape, dtype in layout:
            start = offsets[(name, key)]
            shared[name][key] = flat[start : start + shape.numel()].reshape(shape).to(dtype)
        return shared
