"""What the peer drivers share (they run in the peers' own virtualenvs: torch, numpy and safetensors, never runner).

A driver reads a job (JSON: the files, sizes, schedule and seed that benchmarks/sae_peers.py chose), trains its tool on
the training file's rows in file order, stamps the optimizer steps (benchmarks.common.Stamps), and writes the trained
SAE in one form every contender shares, the tool's own held-out figure, and the stamps. A transcoder's job has `d_out`:
each row's last d_out columns are its target y, the others its input x (an SAE's: y is x); `skip` asks for a skip
connection.

The shared form: codes = TopK_k(ReLU((x * scale - center) @ W_enc + b_enc)), prediction
(codes @ W_dec + b_dec + x * scale @ W_skip) / target_scale, with W_enc [d_in, n], W_dec [n, d_out], W_skip
[d_in, d_out] (only with a skip connection), target_scale = scale unless given: each tool's weights rewritten into it
exactly.
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


def split(rows: torch.Tensor, spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of rows: a transcoder's last d_out columns are its target; an SAE's target is its input."""
    d_out = spec.get("d_out")
    return (rows[..., :-d_out], rows[..., -d_out:]) if d_out else (rows, rows)


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
    """1 - SSE/SST over the held-out rows through the tool's own forward (float32, SST about the split's mean; a
    transcoder's: its prediction of the target from the input)."""
    array = rows(spec["heldout"])
    sse = total = 0.0
    mean = split(torch.from_numpy(np.asarray(array, dtype=np.float64)), spec)[1].mean(0)
    with torch.no_grad():
        for start in range(0, len(array), chunk):
            x, y = split(torch.from_numpy(np.array(array[start : start + chunk])), spec)
            sse += float((forward(x) - y).pow(2).sum())
            total += float((y.double() - mean).pow(2).sum())
    return 1 - sse / total


@torch.no_grad()
def score(
    weights: dict[str, torch.Tensor], heldout: np.ndarray, k: int, d_out: int | None = None, chunk: int = 8192
) -> dict[str, float]:
    """The shared scorer (benchmarks/sae_peers.py runs it on every contender's weights in the shared form): held-out
    FVE in float64 (SST about the split's mean; with d_out, of the rows' last d_out columns, the target, predicted
    from the others), L0, and the share of latents that never fire on the rows."""
    w = {name: t.double() for name, t in weights.items()}
    rows = torch.from_numpy(np.asarray(heldout, dtype=np.float64))
    x_all, y_all = (rows[:, :-d_out], rows[:, -d_out:]) if d_out else (rows, rows)
    mean = y_all.mean(0)
    out_scale = w.get("target_scale", w["scale"])
    sse = sst = l0 = 0.0
    fired = torch.zeros(w["W_enc"].shape[1], dtype=torch.bool)
    for x, y in zip(x_all.split(chunk), y_all.split(chunk), strict=True):
        xs = x * w["scale"]
        pre = (xs - w["center"]) @ w["W_enc"] + w["b_enc"]
        values, indices = pre.topk(k, dim=1)
        values = values.relu()
        codes = torch.zeros_like(pre).scatter(1, indices, values)
        recon = codes @ w["W_dec"] + w["b_dec"]
        if "W_skip" in w:
            recon = recon + xs @ w["W_skip"]
        sse += float((recon / out_scale - y).pow(2).sum())
        sst += float((y - mean).pow(2).sum())
        l0 += float((values > 0).sum())
        fired |= (codes > 0).any(0)
    return {"fve": 1 - sse / sst, "l0": l0 / len(x_all), "dead": float((~fired).double().mean())}
