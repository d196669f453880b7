"""data.cache throughput (data=activations_cached): the residual stream of the lm experiment's GPT (d_model 128)
written to an activation cache, then read back as training reads it.

    python benchmarks/sae_cache.py [--rows 524288] [--n-layer 6] [--layer 2] [--batch 1024] [--threads 1]
                                   [--device cpu|cuda] [--dir DIR] [--json out.json]

The source is a GPT of `--n-layer` blocks with random weights (its forward costs what a trained one's does), hooked
after block `--layer`, one position per row from the second on (source.skip_positions=1). Write: rows/s and MB/s of
experiments.sae.sources.cache.write (the source's forward over its training inputs, the .npy shards of 65,536 rows,
fsync, the manifest), beside the source's forward alone over the same inputs, so the disk's share shows. Read: one epoch
of shuffled batches of `--batch` rows through runner's training loader over the memory-mapped shards, first after the
shards were evicted from the page cache (cold: posix_fadvise DONTNEED; the disk's own cache aside), then again from the
page cache (warm). MB are 10^6 bytes of float32 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name, synchronize  # noqa: E402
from benchmarks.sae_multi import make_source  # noqa: E402


def _read(shards, batch: int) -> float:
    """Seconds for one epoch of shuffled batches over `shards` through runner's training loader."""
    from runner.data import DataModule

    loader = DataModule({"train": shards}, batch_size=batch, shuffle=True).train_loader()
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=524288, help="activations written (8 shards of 65,536)")
    parser.add_argument("--n-layer", type=int, default=6, help="the source GPT's blocks (the lm experiment's: 6)")
    parser.add_argument("--layer", type=int, default=2, help="the hooked block")
    parser.add_argument("--batch", type=int, default=1024, help="rows per training batch (sae_lm's)")
    parser.add_argument("--shard-rows", type=int, default=65536)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    parser.add_argument("--dir", help="where the source and the cache go (default: a temporary folder)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from experiments.sae.sources import cache
    from experiments.sae.sources.source import SourceModel

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        make_source(Path(tmp) / "source", args.device, f"model.n_layer={args.n_layer}")
        source = SourceModel(str(Path(tmp) / "source"), f"blocks.{args.layer}", args.device, skip_positions=1)
        d = source.activations(next(iter(source.data.val_loader()))).shape[1]
        key = cache.identity(str(Path(tmp) / "source"), f"blocks.{args.layer}", 1, "float32", d)
        for _, _ in zip(range(3), cache._activations(source), strict=False):
            pass  # warm-up: the loader's first batches, the allocator
        start, rows = time.perf_counter(), 0
        for acts in cache._activations(source):  # the source's forward alone, over the inputs the write reads
            rows += len(acts)
            if rows >= args.rows:
                break
        synchronize(args.device)
        forward_s = time.perf_counter() - start
        directory = Path(tmp) / "acts"
        start = time.perf_counter()
        cache.write(directory, key, source, args.rows, args.shard_rows)
        write_s = time.perf_counter() - start
        for path in directory.glob("shard-*.npy"):  # written and fsynced: clean pages, which this evicts
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        cold_s = _read(cache.read(directory, key, args.rows), args.batch)
        warm_s = _read(cache.read(directory, key, args.rows), args.batch)  # what the cold epoch left in the cache
    mb = args.rows * d * 4 / 1e6
    seconds = {"forward": forward_s, "write": write_s, "read_warm": warm_s, "read_cold": cold_s}
    report = {
        "device": args.device,
        "threads": args.threads,
        "device_name": device_name(args.device),
        "rows": args.rows,
        "d": d,
        "mb": mb,
        "n_layer": args.n_layer,
        "layer": args.layer,
        **{
            f"{name}_{unit}": (args.rows if unit == "rows_per_s" else mb) / s
            for name, s in seconds.items()
            for unit in ("rows_per_s", "mb_per_s")
        },
    }
    print(f"device {report['device_name']}; source GPT {args.n_layer} blocks, hooked after block {args.layer}, d={d}")
    print(f"{args.rows} rows, {mb:.1f} MB of float32; reads in shuffled batches of {args.batch}")
    print(f"{'':>26} {'rows/s':>12} {'MB/s':>10}")
    for name, what in (
        ("forward", "source forward alone"),
        ("write", "write (forward + shards)"),
        ("read_warm", "read, page cache"),
        ("read_cold", "read, evicted"),
    ):
        print(f"{what:>26} {report[f'{name}_rows_per_s']:>12,.0f} {report[f'{name}_mb_per_s']:>10,.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
