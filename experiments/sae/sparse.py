"""The encoder's backward restricted to the latents a TopK-style SAE selects (`sparse_backward: true`).

TopK needs every pre-activation in the forward (to find the k largest), but the loss sees only the selected ones: the
main TopK picks and AuxK's picks of dead latents. Autograd's dense path still builds a [B, n_latents] gradient of the
pre-activations with k (+ k_aux) nonzeros per row and multiplies it densely twice, for W_enc (x^T @ grad_pre) and for
b_dec (grad_pre @ W_enc^T): each as many FLOPs as the forward's product. Here the pre-activations are computed without
a graph (`SparsePre`), and gradients flow only through the values picked from them (`pick`): W_enc's gradient is a
sparse [n, B] x [B, d] product over the picked (latent, sample) pairs, b_enc's a scatter-add, and b_dec's follows from
b_enc's (grad b_dec = -W_enc @ grad b_enc), so nothing of size [B, n_latents] is made in the backward. The gradients
equal the dense path's up to float summation order (tests/unit/test_sae_sparse.py).

The sparse product moves a row of d floats per entry, at memory speed: for the k main picks per sample it is a small
fraction of a dense product, but AuxK picks up to k_aux = d/2 per sample, where it costs as much as a dense product on
the CPU (measured: 2.2 s for 4096 x 384 entries, d=768, one thread). So where the dead latents are picked out (AuxK on
the CPU), their block of columns takes its gradient densely (`pick_columns`): one [d, B] x [B, n_dead] product.

Nothing reads the device: the sparse matrix is sorted on it and declared coalesced, so a CUDA product need not
coalesce it (which would read its number of entries back to the host).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class SparsePre:
    """An SAE's pre-activations (x - b_dec) @ W_enc + b_enc of normalised inputs `x`, computed without a graph:
    select from `plain(self)`, and take gradients through `pick`."""

    def __init__(self, x: torch.Tensor, sae: nn.Module) -> None:
        self.x, self.W_enc, self.b_enc, self.b_dec = x, sae.W_enc, sae.b_enc, sae.b_dec
        with torch.no_grad():
            self.centered = x - self.b_dec  # SAE.pre_activations' arithmetic: the same values
            self.values = self.centered @ self.W_enc + self.b_enc


Pre = torch.Tensor | SparsePre  # what an SAE's activate and AuxK select from


def plain(pre: Pre) -> torch.Tensor:
    """The pre-activations [B, n] as a tensor, to select from (for a SparsePre, with no gradient)."""
    return pre.values if isinstance(pre, SparsePre) else pre


def pick(pre: Pre, indices: torch.Tensor) -> torch.Tensor:
    """pre[b, indices[b, j]] as a [B, m] tensor, differentiable (sparsely for a SparsePre)."""
    if not isinstance(pre, SparsePre):
        return pre.gather(1, indices)  # gather's backward (a scatter) is the one topk had
    rows = torch.arange(indices.shape[0], device=indices.device).unsqueeze(1)
    return pick_flat(pre, indices + rows * pre.values.shape[1])


def pick_flat(pre: Pre, flat: torch.Tensor) -> torch.Tensor:
    """pre.flatten()[flat] (any shape of `flat`, distinct entries), differentiable (sparsely for a SparsePre)."""
    if not isinstance(pre, SparsePre):
        return pre.flatten().gather(0, flat.flatten()).view_as(flat)
    return _Pick.apply(flat, pre.values, pre.centered, pre.x, pre.W_enc, pre.b_enc, pre.b_dec)


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


def sparse_mm(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor
) -> torch.Tensor:
    """The [shape] matrix holding `values` at distinct (rows, cols), times `dense`, without a dense copy of it."""
    order = (rows * shape[1] + cols).argsort()
    # Sorted and distinct: declared coalesced, which it is, so that no product coalesces it again (on CUDA, a read of
    # its size back to the host).
    matrix = torch.sparse_coo_tensor(
        torch.stack([rows[order], cols[order]]), values[order], shape, is_coalesced=True, check_invariants=False
    )
    return torch.sparse.mm(matrix, dense)


class _Pick(torch.autograd.Function):
    """Values of the pre-activations at flat indices; the backward builds the encoder's gradients from them only."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, values: torch.Tensor, centered: torch.Tensor, *inputs: torch.Tensor):
        x, W_enc, b_enc, b_dec = inputs  # passed only so that autograd routes their gradients here
        ctx.save_for_backward(flat, centered, W_enc)
        return values.flatten().gather(0, flat.flatten()).view_as(flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, centered, W_enc = ctx.saved_tensors
        _, _, _, needs_x, needs_W, needs_b_enc, needs_b_dec = ctx.needs_input_grad
        batch, n = centered.shape[0], W_enc.shape[1]
        flat, g = flat.flatten(), grad.flatten().to(W_enc.dtype)  # the backward in the weights' precision
        rows, cols = flat.div(n, rounding_mode="floor"), flat.remainder(n)
        grad_x = grad_W = grad_b_enc = grad_b_dec = None
        if needs_W:  # W_enc^T's gradient [n, d]: each picked (latent, sample) adds g x its centred input
            grad_W = sparse_mm(cols, rows, g, (n, batch), centered.to(g.dtype)).t()
        if needs_b_enc or needs_b_dec:
            grad_b_enc = torch.zeros(n, dtype=g.dtype, device=g.device).index_add_(0, cols, g)
        if needs_b_dec:  # pre = (x - b_dec) @ W_enc + ...: the column sums of grad_pre are b_enc's gradient
            grad_b_dec = -(W_enc @ grad_b_enc)
        if needs_x:
            grad_x = sparse_mm(rows, cols, g, (batch, n), W_enc.t())
        return None, None, None, grad_x, grad_W, grad_b_enc if needs_b_enc else None, grad_b_dec


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
