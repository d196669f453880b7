"""The final weights (model.safetensors, and model.<part>.safetensors of a task made of several models) written tensor
by tensor: under FSDP each tensor is gathered alone (a collective, in the same order on every rank) and rank 0 streams
its bytes into the file, so no rank holds more than one full tensor at a time. The bytes are those of safetensors' own
save (runner.ckpt.files.safetensors_bytes), the sha256 record beside them runner.ckpt.weights.save_weights'."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

from runner import rundir
from runner.ckpt.files import ADAPTER, ADAPTERS_ONLY, bare_names
from runner.ckpt.state import model_weights
from runner.ckpt.weights import RECORD, save_weights, weight_parts, write_record
from runner.run import Run
from runner.rundir.files import new_file

# safetensors' names of torch's dtypes, in the order its files lay them out: the widest first (every tensor's bytes
# stay aligned to its element size), then by name
DTYPES = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}


def layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict | None = None) -> tuple[bytes, list]:
    """The header (length and JSON) of a safetensors file of tensors of these dtypes and shapes, and the order of
    their bytes after it: what safetensors.torch.save writes for them."""
    unknown = {str(dtype) for dtype, _ in specs.values() if dtype not in DTYPES}
    if unknown:
        raise ValueError(f"safetensors has no dtype for {', '.join(sorted(unknown))}")
    order = sorted(specs, key=lambda name: (_RANK[specs[name][0]], name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header with spaces to a multiple of 8 bytes
    return struct.pack("<Q", len(text)) + text, order


class StreamedFile:
    """One safetensors file written tensor by tensor under a temporary name beside `path`, in the order `layout`
    gives, its sha256 taken as the bytes go by; `close` renames it into place and writes its record."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        metadata = ADAPTERS_ONLY if specs and all(ADAPTER in k for k in specs) else None
        header, self.order = layout(specs, metadata)
        self.path, self.next = Path(path), 0
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        # The old record goes first: a crash between the writes leaves weights without a record (loaded unchecked),
        # never a record that disagrees with good weights
        self.path.with_name(self.path.name + RECORD).unlink(missing_ok=True)
        self.tmp.unlink(missing_ok=True)
        self.file = open(self.tmp, "wb", opener=new_file)  # as runner.rundir.write_atomic's
        self.sha256 = hashlib.sha256()
        self._write(header)

    def _write(self, data: Any) -> None:
        self.file.write(data)
        self.sha256.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The bytes of the tensor `name`, which must be the next in the file's order."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"{self.path.name}: {name} written out of order")
        self.next += 1
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._write(memoryview(flat.view(torch.uint8).numpy()))

    def close(self) -> None:
        """Every tensor written: fsync, rename into place, write the sha256 record."""
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path.name}: {len(self.order) - self.next} tensors not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        write_record(self.path, self.sha256.hexdigest())

    def abandon(self) -> None:
        """Remove the temporary file (an error stopped the writing)."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def stream_weights(state: dict[str, torch.Tensor], files: dict[Path, dict[str, str]], write: bool) -> None:
    """Write `files` (path -> {its tensor name: the name in `state`}) from `state`, whose FSDP shards are gathered
    one tensor at a time on every rank (call it on every rank: collective); only where `write` is a file written."""
    specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state.items()}  # a DTensor's: full
    order = layout(specs)[1]  # every rank gathers in this order; each file's order is a part of it
    streams: list[tuple[StreamedFile, dict[str, str]]] = []
    error: BaseException | None = None
    try:
        for path, names in files.items() if write else ():
            back = {source: own for own, source in names.items()}
            streams.append((StreamedFile(path, {own: specs[source] for own, source in names.items()}), back))
    except BaseException as failed:
        error = failed
    for name in order:
        full = _full(state[name])
        for stream, back in streams if error is None else ():
            try:
                if name in back:
                    stream.write(back[name], full)
            except BaseException as failed:  # the other ranks still gather: keep joining them, raise at the end
                error = failed
        del full
    try:
        for stream, _ in streams if error is None else ():
            stream.close()
    except BaseException as failed:
        error = failed
    if error is not None:
        for stream, _ in streams:
            stream.abandon()
        if rundir.is_disk_full(error):
            raise rundir.disk_full(f"writing {', '.join(p.name for p in files)}") from None
        raise error


def save_final_weights(run: Run, run_dir: Path) -> None:
    """model.safetensors, and one model.<name>.safetensors per part of a task made of several models (`parts`), each
    with its sha256 record. Collective: every rank calls it; rank 0 writes."""
    if not run.strategy.every_module_here:  # distributed=spread: the other ranks' modules reach rank 0 whole
        weights = model_weights(run)
        if run.strategy.is_main:
            save_weights(weights, run_dir / rundir.MODEL)
            for name, part in weight_parts(run.task, weights).items():
                save_weights(part, run_dir / rundir.MODEL_PART.format(name))
        return
    state = bare_names(run.task.state_dict())
    files = {run_dir / rundir.MODEL: {name: name for name in state}}
    for name, prefix in getattr(run.task, "parts", {}).items():
        own = {key[len(prefix) :]: key for key in state if key.startswith(prefix)}
        files[run_dir / rundir.MODEL_PART.format(name)] = own
    stream_weights(state, files, run.strategy.is_main)
