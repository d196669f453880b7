"""Triton kernels for a TopK-style SAE's sparse products on CUDA (`model.kernels`: auto, triton or torch).

Two products, each without the [entries, d] temporaries of the torch path (sparse.py's `index_add_rows`, which makes
an entry's scaled row before adding it, 2^25 floats at a time):
- `transpose_product`: S^T @ D for a sparse [B, n] matrix S (COO entries) and a dense [B, d] matrix D: the encoder
  weight's gradient (S the picked pre-activations' gradients, D the centred inputs) and the decoder's (S the codes,
  D the reconstruction's gradient). The entries are sorted by latent; a program owns a block of latents and a
  block of d, reads its latents' entries in slices, and sums each slice with one product of a one-hot
  [latents, entries] matrix (holding the entries' values) and the entries' rows of D: the segment sums of sorted
  entries, on the matrix units, written once, in either layout (the encoder's [d, n] or the decoder's [n, d]).
- `row_dots`: out[b, j] = D[b] . M[indices[b, j]]: the codes' gradient through a gathered decoder.
The torch path (sparse.py, F.embedding_bag) is the reference and the fallback; tests/unit/test_sae_kernels.py checks
these against it on the CPU with Triton's interpreter (TRITON_INTERPRET=1). The sums run in fp32 whatever the
inputs (one-hot products in IEEE fp32, not TF32): the weights' gradients equal the torch path's up to summation order.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from runner import ConfigError

# Triton comes with torch's CUDA builds (and the dev extra); elsewhere the torch path runs. It is imported only where
# the kernels run (triton_kernels.py).
HAVE_TRITON = importlib.util.find_spec("triton") is not None

CHOICES = ("auto", "triton", "torch")


def check_choice(kernels: str) -> str:
    """`kernels` if it is a choice this machine can honour at all; else a ConfigError saying what to give."""
    if kernels not in CHOICES:
        raise ConfigError(f"model.kernels={kernels!r}: give one of {', '.join(CHOICES)}")
    if kernels == "triton" and not HAVE_TRITON:
        raise ConfigError("model.kernels=triton: Triton is not installed (it comes with torch's CUDA builds)")
    return kernels


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device`: on CUDA unless `kernels` is torch; elsewhere only
    when asked for by name under Triton's interpreter (TRITON_INTERPRET=1: the tests' way)."""
    if kernels == "torch" or not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return kernels == "triton" and os.environ.get("TRITON_INTERPRET") == "1"


BLOCK_L, BLOCK_E, BLOCK_D = 32, 32, 64


def transpose_product(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, n: int, dense: torch.Tensor, layout: str = "nd"
) -> torch.Tensor:
    """S^T @ dense for the [B, n] matrix S holding `values` at distinct (rows, cols): [n, d] (layout "nd"), or its
    transpose [d, n] written as such (layout "dn", an encoder weight's). In dense's dtype; nothing is read back."""
    compiled = importlib.import_module("experiments.sae.coders.triton_kernels")
    dense = dense.contiguous()
    d = dense.shape[1]
    cols, order = cols.flatten().sort()
    rows, values = rows.flatten()[order], values.flatten()[order]
    blocks = -(-n // BLOCK_L)
    starts = torch.arange(blocks + 1, device=cols.device) * BLOCK_L
    bounds = torch.searchsorted(cols, starts.to(cols.dtype))
    out = torch.empty((n, d) if layout == "nd" else (d, n), dtype=dense.dtype, device=dense.device)
    out_l, out_d = (d, 1) if layout == "nd" else (1, n)
    grid = (blocks, -(-d // BLOCK_D))
    compiled.transpose_kernel[grid](cols, rows, values, bounds, dense, out, n, d, dense.stride(0), out_l, out_d,
                            BLOCK_L=BLOCK_L, BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D)  # fmt: skip
    return out


def row_dots(indices: torch.Tensor, dense: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """out[b, j] = dense[b] . matrix[indices[b, j]] for indices [B, k], dense [B, d], matrix [n, d]; fp32 sums."""
    compiled = importlib.import_module("experiments.sae.coders.triton_kernels")
    indices, dense, matrix = indices.contiguous(), dense.contiguous(), matrix.contiguous()
    batch, k = indices.shape
    out = torch.empty(batch, k, dtype=dense.dtype, device=dense.device)
    block_k = max(16, 1 << (k - 1).bit_length())  # a power of two, as tl.arange takes
    compiled.row_dots_kernel[(batch,)](indices, dense, matrix, out, k, dense.stride(0), matrix.stride(0),
                               D=dense.shape[1], BLOCK_K=block_k, BLOCK_D=64)  # fmt: skip
    return out


class GatheredDecode(torch.autograd.Function):
    """F.embedding_bag(indices, W, per_sample_weights=codes, mode="sum") with a backward of these kernels: the
    codes' gradient by row_dots, W's by transpose_product (the torch path's backward sorts and reduces too, with
    temporaries of the entries' size)."""

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, codes: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices, codes, W)
        return torch.nn.functional.embedding_bag(indices, W, per_sample_weights=codes, mode="sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        indices, codes, W = ctx.saved_tensors
        grad = grad.to(W.dtype)
        grad_codes = row_dots(indices, grad, W).to(codes.dtype) if ctx.needs_input_grad[1] else None
        grad_W = None
        if ctx.needs_input_grad[2]:
            rows = torch.arange(indices.shape[0], device=indices.device).repeat_interleave(indices.shape[1])
            grad_W = transpose_product(rows, indices, codes, W.shape[0], grad)
        return None, grad_codes, grad_W
