"""What exact resume costs a stream: data=text_stream's training loader against the same windows through torch's plain
DataLoader, which keeps no state.

    python benchmarks/stream.py [--batches 3000] [--batch 8] [--seq-len 128] [--workers 0,2] [--reps 3]
                                [--paths GLOB ...] [--device cpu|cuda] [--json out.json]

Both iterate experiments.lm.stream.TextStreamShards over the same files (the standard library's sources by default):
whole files per shard, windows of seq_len + 1 bytes, shuffled within blocks of 8192. runner's is TextStream's
StreamLoader: torchdata's StatefulDataLoader taking each worker's place with every batch, and the state after each of
the last batches kept for the checkpoint. The plain one is torch.utils.data.DataLoader over the same dataset, the same
collate, nothing kept. Windows per second over `--batches` batches after the first (worker start-up left out), the
median of `--reps`, and runner / plain for each worker count. With `--device cuda` both pin their batches' memory,
as training on a GPU does (the batches stay on the host: this is the loader alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name  # noqa: E402


def _rate(loader, batches: int, batch: int) -> float:
    """Windows per second over `batches` batches after the first."""
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8, help="windows per batch (the lm experiment's)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workers", default="0,2", help="loader worker counts, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--paths", nargs="*", help="files or globs (default: the standard library's sources)")
    parser.add_argument("--device", default=default_device(), help="cuda: pinned batches, as training there has")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)

    from experiments.lm.stream import TextStream, collate_windows

    def data(workers: int) -> TextStream:
        return TextStream(args.seq_len, paths=args.paths, val_every=0, batch_size=args.batch, num_workers=workers)

    out = {
        "device": device_name(device),
        "batches": args.batches,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "workers": {},
    }
    for workers in (int(w) for w in args.workers.split(",")):
        rates = {"runner": [], "plain": []}
        for _ in range(args.reps):
            module = data(workers)
            rates["runner"].append(_rate(module.train_loader(device=device), args.batches, args.batch))
            stream = data(workers).splits["train"]
            plain = torch.utils.data.DataLoader(
                stream,
                batch_size=args.batch,
                num_workers=workers,
                collate_fn=collate_windows,
                pin_memory=device.type == "cuda",
            )
            rates["plain"].append(_rate(plain, args.batches, args.batch))
        row = {name: statistics.median(values) for name, values in rates.items()}
        row["ratio"] = row["runner"] / row["plain"]
        row["ratios"] = [r / p for r, p in zip(rates["runner"], rates["plain"], strict=True)]
        out["workers"][str(workers)] = row
        print(
            f"workers {workers}: runner {row['runner']:,.0f} windows/s, plain {row['plain']:,.0f} windows/s, "
            f"runner / plain {row['ratio']:.3f} (reps {', '.join(f'{r:.3f}' for r in row['ratios'])})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
