"""What the peer drivers share (they run in the peers' own virtualenvs: torch, numpy and safetensors, never runner).

A driver reads a job (JSON: the files, sizes, schedule and seed that benchmarks/sae_peers.py chose), trains its tool on
the training file's rows in file order, stamps the optimizer steps (benchmarks.common.Stamps), and writes the trained
SAE in one form every contender shares, the tool's own held-out figure, and the stamps.

The shared form: codes = TopK_k(ReLU((x * scale - center) @ W_enc + b_enc)), reconstruction
(codes @ W_dec + b_dec) / scale, with W_enc [d, n], W_dec [n, d]: each tool's weights rewritten into it exactly.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import Stamps


def job() -> dict[str, Any]:
    """The job file named on the command line, with torch's threads set from it."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec["threads"])
    return spec


def rows(path: str) -> np.ndarray:
    """The [N, d] float32 rows of a .npy file, memory-mapped (as runner's data=activations_file reads it)."""
    return np.load(path, mmap_mode="r")


def batches(path: str, batch: int) -> Iterator[torch.Tensor]:
    """The training file's rows in order, `batch` at a time (the last partial batch dropped)."""
    array = rows(path)
    for start in range(0, len(array) - batch + 1, batch):
        yield torch.from_numpy(np.ascontiguousarray(array[start : start + batch]))


def stamp_steps(optimizer: torch.optim.Optimizer, spec: dict[str, Any]) -> Stamps:
    """Stamps taken after each of `optimizer`'s steps (a post-step hook: the tool's loop is left as it is; on CUDA
    only the stamped steps wait for the GPU)."""
    stamps = Stamps(spec["warmup_steps"], spec["steps"], spec["device"])
    count = [0]

    def after(*_: Any) -> None:
        count[0] += 1
        stamps.step(count[0])

    optimizer.register_step_post_hook(after)
    return stamps


def write(spec: dict[str, Any], stamps: Stamps, weights: dict[str, torch.Tensor], own: dict[str, Any]) -> None:
    """The SAE in the shared form, then the figures (the parent waits for the figures)."""
    from safetensors.torch import save_file

    out = Path(spec["out"])
    # cloned: safetensors refuses tensors that share memory (sparsify's center is its b_dec)
    tensors = {name: value.detach().float().cpu().clone().contiguous() for name, value in weights.items()}
    save_file(tensors, str(out.with_suffix(".safetensors")))
    stamps.write(out, own=own)


def own_fve(forward: Any, spec: dict[str, Any], chunk: int = 4096) -> float:
    """1 - SSE/SST over the held-out rows through the tool's own forward (float32, SST about the split's mean)."""
    array = rows(spec["heldout"])
    sse = total = 0.0
    mean = torch.from_numpy(np.asarray(array, dtype=np.float64).mean(0))
    with torch.no_grad():
        for start in range(0, len(array), chunk):
            x = torch.from_numpy(np.array(array[start : start + chunk]))
            sse += float((forward(x) - x).pow(2).sum())
            total += float((x.double() - mean).pow(2).sum())
    return 1 - sse / total
