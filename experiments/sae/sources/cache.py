"""data.cache=DIR (data=activations_cached): a hooked module's activations written to disk once (.npy shards, then a
manifest naming what they were made from), read back memory-mapped by every later run that hooks the same module of
the same weights.

A cache is complete when its manifest.json exists: shards are written under temporary names and renamed when whole,
the manifest last (atomically), so an interrupted write leaves no manifest; the next run continues it from its last
whole shard (DIR/.partial.json says which, and where the source's inputs were). A reader opens only the shards the
manifest lists, each checked for its size and shape. One writer at a time: it holds an flock on DIR/.lock (another
run that finds no manifest waits for it, then reads what it wrote); under torchrun only rank 0 writes and the other
ranks poll for the manifest, giving up with an error when the writer's heartbeat (DIR/.writing, touched after each
shard) has not moved for WAIT_S seconds, so no rank can hang for good (a cache dir that only rank 0's machine sees,
say)."""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from experiments.sae.sources.buffer import source_inputs
from runner import ConfigError
from runner.ckpt.files import hash_into
from runner.rundir import MODEL, fsync_dir, locked, read_json, write_atomic

MANIFEST, HEARTBEAT, PARTIAL = "manifest.json", ".writing", ".partial.json"  # the writer's DIR/.lock: runner.rundir
SHARD_ROWS = 65536
WAIT_S = 600.0  # a waiting rank gives up when the writer shows no progress for this long
DTYPES = ("float32", "float16")
# what the activations were made from: a cache that differs in any of these is refused
IDENTITY = ("weights_sha256", "module", "skip_positions", "dtype", "d", "inputs")


class Shards(Dataset):
    """The first `rows` rows of several memory-mapped [n_i, d] shards, as one dataset; a batch is one sorted read
    per shard it touches (the order inside a batch does not matter to an SAE)."""

    def __init__(self, arrays: list[np.ndarray], rows: int) -> None:
        self.arrays, self.rows = arrays, rows
        self.starts = np.cumsum([0, *(len(a) for a in arrays)])

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor]:
        rows = np.sort(np.asarray(indices))
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        parts = [self.arrays[s][rows[shard == s] - self.starts[s]] for s in np.unique(shard)]
        return (torch.from_numpy(np.concatenate(parts)).float(),)


def identity(
    checkpoint: str,
    module: str,
    skip_positions: int,
    dtype: str,
    d: int,
    weights: list[Path] | None = None,
    inputs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a cache of these activations is made from: the source's weights by their sha256, not their path (a run
    folder's model.safetensors, or the `weights` files of a transformers source, with the text it read: `inputs`)."""
    if dtype not in DTYPES:
        raise ConfigError(f"data.cache_dtype={dtype!r}: use one of {list(DTYPES)}")
    path = Path(checkpoint)
    digest = hashlib.sha256()
    for file in weights or [path / MODEL if path.is_dir() else path]:
        hash_into(digest, file)
    return {
        "source": str(path.resolve()),
        "weights_sha256": digest.hexdigest(),
        "module": module,
        "skip_positions": skip_positions,
        "dtype": dtype,
        "d": d,
        "inputs": inputs,
    }


def read(directory: Path, key: dict[str, Any], rows: int) -> Shards | None:
    """The cache in `directory` if it is complete and made from `key`; None if there is none (or it is damaged:
    rewrite it); a ConfigError if it was made from something else or holds fewer than `rows` rows."""
    manifest = read_json(directory / MANIFEST)
    if manifest is None or not isinstance(manifest.get("shards"), list) or not isinstance(manifest.get("rows"), int):
        return None
    differs = [k for k in IDENTITY if manifest.get(k) != key[k]]
    if differs:
        was = ", ".join(f"{k}={manifest.get(k)!r}" for k in differs)
        now = ", ".join(f"{k}={key[k]!r}" for k in differs)
        raise ConfigError(
            f"the activation cache in {directory} was written from {manifest.get('module')} of run "
            f"{manifest.get('source')} ({was}); this run has {now} (source {key['source']}): use another "
            "data.cache dir, or delete that one"
        )
    if manifest["rows"] < rows:
        raise ConfigError(
            f"the activation cache in {directory} holds {manifest['rows']} rows; this run asks for {rows} "
            f"(data.cache_rows): set data.cache_rows<={manifest['rows']}, or use another data.cache dir"
        )
    if sum(shard["rows"] for shard in manifest["shards"]) != manifest["rows"]:
        return None
    arrays = []
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        try:
            array = np.load(path, mmap_mode="r") if path.stat().st_size == shard["bytes"] else None
        except (OSError, ValueError):
            array = None
        if array is None or array.shape != (shard["rows"], key["d"]) or array.dtype != np.dtype(key["dtype"]):
            return None  # a shard went missing or was cut short after the manifest was written
        arrays.append(array)
    return Shards(arrays, rows)


def _activations(source: Any, skip: int = 0) -> Iterator[torch.Tensor]:
    # the activations of the source's inputs in the ring buffer's order, after its first `skip` input batches (read,
    # not run through the model)
    for i, (_, _, batch) in enumerate(source_inputs(source.data.train_loader())):
        if i >= skip:
            yield source.activations(batch).cpu()


def _partial(directory: Path, key: dict[str, Any], rows: int, shard_rows: int) -> dict[str, Any] | None:
    # what an interrupted write of this same cache left: its whole shards and where the source's inputs were
    partial = read_json(directory / PARTIAL)
    if partial is None or any(partial.get(k) != key[k] for k in IDENTITY):
        return None
    if (partial.get("rows"), partial.get("shard_rows")) != (rows, shard_rows):
        return None
    for shard in partial["shards"]:
        path = directory / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            return None
    return partial


def write(directory: Path, key: dict[str, Any], source: Any, rows: int, shard_rows: int = SHARD_ROWS) -> None:
    """Run the source over its training inputs and write `rows` activations to `directory`: shards of `shard_rows`,
    each renamed into place when whole, then the manifest. An interrupted write of the same cache (its progress in
    DIR/.partial.json after each shard) is continued: its shards are kept and the inputs they came from are read
    past without running the model."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)  # a damaged cache: nothing may read it while it is rewritten
    done = _partial(directory, key, rows, shard_rows)
    shards, consumed, leftover = (done["shards"], done["consumed"], done["leftover"]) if done else ([], 0, 0)
    kept = {shard["file"] for shard in shards}
    for stale in [*directory.glob("shard-*.npy"), *directory.glob(".shard-*")]:
        if stale.name not in kept:
            stale.unlink()
    if done:
        print(f"data.cache: continuing an interrupted write after {len(shards)} shard(s)", flush=True)
    # the last input batch of the written shards may have rows left over for the next shard: it is run again
    stream = _activations(source, skip=consumed - (1 if leftover else 0))
    pending = [next(stream)[-leftover:]] if leftover else []
    for i, start in enumerate(range(0, rows, shard_rows)):
        if i < len(shards):
            continue
        n = min(shard_rows, rows - start)
        while sum(map(len, pending)) < n:
            pending.append(next(stream))
            consumed += 1
        block = torch.cat(pending)
        pending = [block[n:]]  # the rest of the last input's activations open the next shard
        data = io.BytesIO()
        np.save(data, block[:n].float().numpy().astype(key["dtype"]))
        name = f"shard-{i:05d}.npy"
        write_atomic(directory / name, data.getbuffer(), fsync=True)  # a temporary name until it is whole
        shards.append(
            {"file": name, "rows": n, "bytes": data.tell(), "sha256": hashlib.sha256(data.getbuffer()).hexdigest()}
        )
        progress = {**key, "rows": rows, "shard_rows": shard_rows, "shards": shards, "consumed": consumed}
        progress["leftover"] = len(pending[0])
        write_atomic(directory / PARTIAL, json.dumps(progress).encode(), fsync=True)
        (directory / HEARTBEAT).touch()
    fsync_dir(directory)  # the shards' names are on disk before the manifest that lists them
    manifest = {**key, "rows": rows, "shards": shards, "written_at": time.strftime("%FT%T")}
    write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode(), fsync=True)
    fsync_dir(directory)
    (directory / PARTIAL).unlink(missing_ok=True)


def _rank() -> int:
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if initialized else 0


def cached(directory: str | Path, source: Any, key: dict[str, Any], rows: int, shard_rows: int = SHARD_ROWS) -> Shards:
    """The activations of `source` described by `key`, from the cache in `directory`, written first if it is not
    there (by rank 0; the other ranks wait for its manifest)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"data.cache={directory} is a file: give a folder (made if it does not exist)")
    found = read(directory, key, rows)
    if found is not None:
        return found
    if _rank() != 0:
        return _wait(directory, key, rows)
    with locked(directory):  # released at the block's end, also when the process dies
        found = read(directory, key, rows)  # another run may have written it while this one waited for the lock
        if found is None:
            print(f"data.cache: writing {rows} activations of {key['module']} to {directory}", flush=True)
            write(directory, key, source, rows, shard_rows)
            found = read(directory, key, rows)
    if found is None:
        raise ConfigError(f"the activation cache just written to {directory} does not read back: is the disk full?")
    return found


def _wait(directory: Path, key: dict[str, Any], rows: int) -> Shards:
    started = time.time()
    while (found := read(directory, key, rows)) is None:
        beat = directory / HEARTBEAT
        last = max(started, beat.stat().st_mtime if beat.exists() else 0.0)
        if time.time() - last > WAIT_S:
            raise ConfigError(
                f"rank {_rank()} waited {WAIT_S:.0f} s for rank 0 to write the activation cache in {directory} and "
                "saw no progress: data.cache must be a folder that every rank sees (a shared filesystem)"
            )
        time.sleep(1.0)
    return found
