"""The encoder's backward restricted to the latents a TopK-style SAE selects (`sparse_backward: true`).

TopK needs every pre-activation in the forward (to find the k largest), but the loss sees only the selected ones: the
main TopK picks and AuxK's picks of dead latents. Autograd's dense path still builds a [B, n_latents] gradient of the
pre-activations with k (+ k_aux) nonzeros per row and multiplies it densely twice, for W_enc (x^T @ grad_pre) and for
b_dec (grad_pre @ W_enc^T): each as many FLOPs as the forward's product. Here the pre-activations are computed without a
graph (`SparsePre`), and gradients flow only through the values picked from them (`pick`): W_enc's gradient adds each
picked (latent, sample) pair's g x centred input into that latent's column (`scatter_rows`: on CUDA an index_add, as
sparsify's fused encoder does; on the CPU a sorted sparse product), b_enc's is a scatter-add, and b_dec's follows from
b_enc's (grad b_dec = -W_enc @ grad b_enc), so nothing of size [B, n_latents] is made in the backward. The gradients
equal the dense path's up to float summation order (tests/unit/test_sae_sparse.py); on CUDA index_add sums with atomics,
in no fixed order.

The product moves a row of d floats per entry, at memory speed: for the k main picks per sample it is a small
fraction of a dense product, but AuxK picks up to k_aux = d/2 per sample, where it costs as much as a dense product on
the CPU. So where the dead latents are picked out (AuxK on the CPU), their block of columns takes its gradient densely
(`pick_columns`): one [d, B] x [B, n_dead] product.

Nothing reads the device: the CPU's sparse matrix is sorted and declared coalesced, never coalesced again.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.sae.coders.kernels import GatheredDecode, transpose_product, use_triton


class SparsePre:
    """An SAE's pre-activations (x - b_dec) @ W_enc + b_enc of normalised inputs `x`, computed without a graph:
    select from `plain(self)`, and take gradients through `pick`."""

    def __init__(self, x: torch.Tensor, sae: nn.Module) -> None:
        self.x, self.W_enc, self.b_enc, self.b_dec = x, sae.W_enc, sae.b_enc, sae.pre_bias
        self.triton = use_triton(getattr(sae, "kernels", "auto"), x.device)  # W_enc's gradient by its kernel
        with torch.no_grad():
            self.centered = x - self.b_dec  # SAE.pre_activations' arithmetic: the same values
            self.values = torch.addmm(self.b_enc, self.centered, self.W_enc)


Pre = torch.Tensor | SparsePre  # what an SAE's activate and AuxK select from


def plain(pre: Pre) -> torch.Tensor:
    """The pre-activations [B, n] as a tensor, to select from (for a SparsePre, with no gradient)."""
    return pre.values if isinstance(pre, SparsePre) else pre


def pick(pre: Pre, indices: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """pre[b, indices[b, j]] as a [B, m] tensor, differentiable (sparsely for a SparsePre); `values`: those entries
    if the caller has them already (a top-k's), which spares the gather."""
    if not isinstance(pre, SparsePre):
        # gather's backward (a scatter) is the one topk had; a top-k's own values have that backward already
        return pre.gather(1, indices) if values is None else values
    rows = torch.arange(indices.shape[0], device=indices.device).unsqueeze(1)
    flat = indices + rows * pre.values.shape[1]
    if values is None:
        values = pre.values.flatten().gather(0, flat.flatten()).view_as(flat)
    return _Pick.apply(pre.triton, flat, values.detach(), pre.centered, pre.x, pre.W_enc, pre.b_enc, pre.b_dec)


def pick_flat(pre: Pre, flat: torch.Tensor) -> torch.Tensor:
    """pre.flatten()[flat] (any shape of `flat`, distinct entries), differentiable (sparsely for a SparsePre)."""
    if not isinstance(pre, SparsePre):
        return pre.flatten().gather(0, flat.flatten()).view_as(flat)
    values = pre.values.flatten().gather(0, flat.flatten()).view_as(flat)
    return _Pick.apply(pre.triton, flat, values, pre.centered, pre.x, pre.W_enc, pre.b_enc, pre.b_dec)


def pick_columns(pre: Pre, columns: torch.Tensor) -> torch.Tensor:
    """pre[:, columns] (distinct columns), differentiable (for a SparsePre, densely in those columns only)."""
    if not isinstance(pre, SparsePre):
        return pre[:, columns]
    return _PickColumns.apply(columns, pre.values, pre.centered, pre.x, pre.W_enc, pre.b_enc, pre.b_dec)


def top_indices(flat: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest values of the 1-D `flat`, in no order: flat.topk(count).indices, ties aside.

    On the CPU a top-k over millions of values costs many passes over them (19 ms for BatchTopK's 2M pre-activations
    at the preset size, against ~2 ms here): the candidates are the values at or above a threshold read off a strided
    sample (its value of rank 1.25 x count's share); if at least `count` values pass it, the count-th largest passes
    too, so the candidates hold the whole top (else the sample misled: the plain top-k). Elsewhere that count would be
    a read of the device every step: the plain top-k.
    """
    sample_size = 65536
    if flat.device.type != "cpu" or flat.numel() <= 4 * sample_size:
        return flat.topk(count, sorted=False).indices
    sample = flat[:: (flat.numel() // sample_size) | 1]  # an odd stride, across the columns of a power-of-two width
    share = math.ceil(len(sample) * count / flat.numel() * 1.25) + 16
    if share < len(sample):
        # NaN stays a candidate: top-k ranks it above everything, and so must this (a NaN code makes the step's loss
        # non-finite, which skips the step; left out, it would train on silently)
        candidates = ((flat >= sample.topk(share, sorted=False).values.min()) | flat.isnan()).nonzero().flatten()
        if len(candidates) >= count:
            return candidates[flat[candidates].topk(count, sorted=False).indices]
    return flat.topk(count, sorted=False).indices


def bag(indices: torch.Tensor, weights: torch.Tensor, W: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """F.embedding_bag(indices, W, per_sample_weights=weights, mode="sum"): the rows of W at indices [B, m], weighted
    and summed per row; its backward by the Triton kernels where `kernels` runs them on W's device."""
    if torch.is_grad_enabled() and use_triton(kernels, W.device):
        return GatheredDecode.apply(indices, weights, W)
    return F.embedding_bag(indices, W, per_sample_weights=weights, mode="sum")


def sparse_mm(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor
) -> torch.Tensor:
    """The [shape] matrix holding `values` at distinct (rows, cols), times `dense`, without a dense copy of it."""
    order = (rows * shape[1] + cols).argsort()
    matrix = torch.sparse_coo_tensor(
        torch.stack([rows[order], cols[order]]), values[order], shape, is_coalesced=True, check_invariants=False
    )
    return torch.sparse.mm(matrix, dense)


def scatter_rows(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor
) -> torch.Tensor:
    """What sparse_mm gives, the product's way on each device. CUDA: every entry's row of `dense`, scaled, added
    into its output row (index_add: atomics, no sort, nothing read back; sparsify's fused encoder does this). CPU:
    the sorted sparse product, which reads the rows of `dense` from cache instead of writing and reading an
    [entries, d] temporary (1.3 against 3.1 ms a step at 1024 x 32 entries, d 128)."""
    args = rows, cols, values, shape, dense
    return sparse_mm(*args) if dense.device.type == "cpu" else index_add_rows(*args)


# The entries' scaled rows are made this many floats at a time (128 MiB in fp32): all at once they were [entries, d]
# twice over, 0.5 GB for AuxK's d/2 picks a sample at the preset size on an H200 (610 MiB of peak against the
# hand loop's 105) and 9.7 GB at the usual size. A slice's bounds are shapes, known without reading the device.
CHUNK_FLOATS = 2**25


def index_add_rows(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor
) -> torch.Tensor:
    """sparse_mm's product as an index_add of the entries' scaled rows of `dense` (CUDA's way; see scatter_rows),
    a slice of at most CHUNK_FLOATS floats of them at a time."""
    out = dense.new_zeros(shape[0], dense.shape[1])
    step = max(1, CHUNK_FLOATS // max(1, dense.shape[1]))
    for start in range(0, values.numel(), step):
        part = slice(start, start + step)
        out.index_add_(0, rows[part], values[part].unsqueeze(1) * dense.index_select(0, cols[part]))
    return out


class _Pick(torch.autograd.Function):
    """Picked pre-activations (`values`, at flat indices); the backward makes the encoder's gradients from them only."""

    @staticmethod
    def forward(
        ctx: Any, triton: bool, flat: torch.Tensor, values: torch.Tensor, centered: torch.Tensor, *inputs: torch.Tensor
    ):
        x, W_enc, b_enc, b_dec = inputs  # passed only so that autograd routes their gradients here
        ctx.save_for_backward(flat, centered, W_enc)
        ctx.triton = triton
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, centered, W_enc = ctx.saved_tensors
        _, _, _, _, needs_x, needs_W, needs_b_enc, needs_b_dec = ctx.needs_input_grad
        batch, n = centered.shape[0], W_enc.shape[1]
        g = grad.to(W_enc.dtype).flatten()  # the backward in the weights' precision
        rows, cols = flat.div(n, rounding_mode="floor").flatten(), flat.remainder(n).flatten()
        grad_x = grad_W = grad_b_enc = grad_b_dec = None
        if needs_W and ctx.triton:  # the same sums, written as W_enc's [d, n] by one kernel (coders/kernels.py)
            grad_W = transpose_product(rows, cols, g, n, centered.to(g.dtype), layout="dn")
        elif needs_W:  # W_enc^T's gradient [n, d]: each picked (latent, sample) adds g x its centred input
            grad_W = scatter_rows(cols, rows, g, (n, batch), centered.to(g.dtype)).t()
        if needs_b_enc or needs_b_dec:
            grad_b_enc = W_enc.new_zeros(n).index_add_(0, cols, g)
        if needs_b_dec:  # pre = (x - b_dec) @ W_enc + ...: the column sums of grad_pre are b_enc's gradient
            grad_b_dec = -(W_enc @ grad_b_enc)
        if needs_x:  # each pick adds g x its latent's encoder column to its sample's row
            grad_x = scatter_rows(rows, cols, g, (batch, n), W_enc.t())
        return None, None, None, None, grad_x, grad_W, grad_b_enc if needs_b_enc else None, grad_b_dec


class _PickColumns(torch.autograd.Function):
    """A block of columns of the pre-activations; the backward is dense in those columns and touches no other."""

    @staticmethod
    def forward(ctx: Any, columns: torch.Tensor, values: torch.Tensor, centered: torch.Tensor, *inputs: torch.Tensor):
        x, W_enc, b_enc, b_dec = inputs  # passed only so that autograd routes their gradients here
        ctx.save_for_backward(columns, centered, W_enc)
        return values[:, columns]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        columns, centered, W_enc = ctx.saved_tensors
        _, _, _, needs_x, needs_W, needs_b_enc, needs_b_dec = ctx.needs_input_grad
        g = grad.to(W_enc.dtype)
        block, sums = W_enc[:, columns], g.sum(0)
        grad_x = g @ block.t() if needs_x else None
        grad_W = torch.zeros_like(W_enc).index_copy_(1, columns, centered.t().to(g.dtype) @ g) if needs_W else None
        grad_b_enc = W_enc.new_zeros(W_enc.shape[1]).index_copy_(0, columns, sums) if needs_b_enc else None
        grad_b_dec = -(block @ sums) if needs_b_dec else None
        return None, None, None, grad_x, grad_W, grad_b_enc, grad_b_dec
