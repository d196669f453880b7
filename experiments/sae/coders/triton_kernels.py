"""The Triton kernels themselves (experiments/sae/coders/kernels.py calls them, and imports this module only when it
runs them: Triton's import costs a process that never uses it, and leaves nanobind's leak report on stderr at exit)."""

import triton
import triton.language as tl


@triton.jit
def transpose_kernel(
    cols, rows, vals, bounds, dense, out, n, d, dense_row, out_l, out_d,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block, part = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(bounds + block), tl.load(bounds + block + 1)
    latents = (block * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)  # offsets past 2^31 at d x n > 2^31
    columns = part * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    first = start
    while first < end:  # a while, not a range: Triton's interpreter cannot take loaded bounds as a range's
        entries = first + tl.arange(0, BLOCK_E)
        inside = entries < end
        col = tl.load(cols + entries, mask=inside, other=-1)
        row = tl.load(rows + entries, mask=inside, other=0)
        val = tl.load(vals + entries, mask=inside, other=0.0).to(tl.float32)
        where = dense + row[:, None] * dense_row + columns[None, :]
        tile = tl.load(where, mask=inside[:, None] & (columns[None, :] < d), other=0.0).to(tl.float32)
        onehot = tl.where(col[None, :] == latents[:, None], val[None, :], 0.0)
        acc += tl.dot(onehot, tile, input_precision="ieee")
        first += BLOCK_E
    where = out + latents[:, None] * out_l + columns[None, :] * out_d
    tl.store(where, acc.to(out.dtype.element_ty), mask=(latents[:, None] < n) & (columns[None, :] < d))


@triton.jit
def row_dots_kernel(
    indices, dense, matrix, out, k, dense_row, matrix_row,
    D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    picks = tl.arange(0, BLOCK_K)
    inside = picks < k
    index = tl.load(indices + b * k + picks, mask=inside, other=0)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for first in range(0, D, BLOCK_D):  # the width a constant: one kernel per model width, its loop unrolled
        columns = first + tl.arange(0, BLOCK_D)
        within = columns < D
        g = tl.load(dense + b * dense_row + columns, mask=within, other=0.0).to(tl.float32)
        where = matrix + index[:, None] * matrix_row + columns[None, :]
        rows = tl.load(where, mask=inside[:, None] & within[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(rows * g[None, :], axis=1)
    tl.store(out + b * k + picks, acc.to(out.dtype.element_ty), mask=inside)
