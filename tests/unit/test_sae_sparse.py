"""The restricted encoder backward (`sparse_backward`): the same losses and, up to float summation order, the same
gradients as autograd's dense path, for TopK (with AuxK on no, a few and many dead latents, gathered and masked),
BatchTopK and Matryoshka, under accumulation; and no [B, n_latents] tensor anywhere in its backward.

One CPU thread; the module takes a few seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from experiments.sae.coders import sparse as sparse_module
from experiments.sae.coders.activations import SAE, BatchTopKSAE, TopKSAE, auxk_loss
from experiments.sae.coders.matryoshka import MatryoshkaSAE
from experiments.sae.coders.sparse import SparsePre, pick, pick_columns, pick_flat, plain, top_indices

D, N, B = 16, 96, 40  # B and N differ from every other size here, so a [B, N] tensor is recognisable


def _make(kind: str, sparse: bool, n_dead: int) -> SAE:
    torch.manual_seed(0)
    shape = {"d_in": D, "n_latents": N, "k": 4, "k_aux": 6, "sparse_backward": sparse}
    if kind == "topk":
        sae = TopKSAE(**shape)
    elif kind == "batchtopk":
        sae = BatchTopKSAE(**shape)
    else:
        sae = MatryoshkaSAE(**shape, group_sizes=[16, 32, 48], activation=kind.split("_")[1])
    dead = torch.randperm(N, generator=torch.Generator().manual_seed(1))[:n_dead]
    with torch.no_grad():
        sae.since_fired[dead] = 10_000  # dead as of the last step: AuxK trains them
    sae.after_optimizer_step()
    assert sae.n_dead == n_dead
    return sae


def _batches(n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(B, D, generator=gen) * 3 + 1 for _ in range(n)]  # a mean and a scale: normalisation matters


@pytest.mark.parametrize("n_dead", [0, 3, 30])  # no dead latent, fewer than k_aux (6), more than k_aux
@pytest.mark.parametrize("kind", ["topk", "batchtopk", "matryoshka_topk", "matryoshka_batchtopk"])
def test_sparse_backward_gives_the_dense_gradients_under_accumulation(kind: str, n_dead: int) -> None:
    seen = {}
    for sparse in (False, True):
        sae = _make(kind, sparse, n_dead)
        losses = []
        for x in _batches():  # two micro-batches: their gradients accumulate in .grad
            out = sae.training_step(x)
            (out["loss"] / 2).backward()
            losses.append(out["loss"].detach())
        seen[sparse] = losses, {name: p.grad.clone() for name, p in sae.named_parameters()}
    (dense_losses, dense), (sparse_losses, sparse) = seen[False], seen[True]
    for a, b in zip(dense_losses, sparse_losses, strict=True):
        assert torch.equal(a, b)  # the forward is the same arithmetic
    for name, grad in dense.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(sparse[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("n_dead", [0, 3, 30])
def test_masked_auxk_with_sparse_backward_gives_the_dense_gradients(n_dead: int) -> None:
    # The GPU's AuxK (masked top-k: with fewer dead latents than k_aux it also picks live ones, at -inf), run here,
    # against the dense backward of the CPU's AuxK (the dead columns gathered).
    seen = {}
    for sparse in (False, True):
        sae = _make("topk", sparse, n_dead)
        x = _batches(1)[0]
        pre = SparsePre(x, sae) if sparse else sae.pre_activations(x)
        values, indices = sae.activate(pre)
        recon = sae.decode(values, indices)
        auxk = auxk_loss(pre, sae.dead, sae.W_dec, sae.k_aux, (x - recon).detach(), masked=sparse)
        ((recon - x).pow(2).mean() + auxk).backward()
        seen[sparse] = auxk.detach(), {name: p.grad for name, p in sae.named_parameters()}
    (dense_aux, dense), (sparse_aux, sparse) = seen[False], seen[True]
    torch.testing.assert_close(sparse_aux, dense_aux)
    assert (float(dense_aux) > 0) == (n_dead > 0)
    for name, grad in dense.items():
        torch.testing.assert_close(sparse[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("product", ["sorted sparse (CPU)", "index_add (CUDA)", "index_add in slices (CUDA)"])
def test_picks_differentiate_every_input_like_indexing(product: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # In float64 and with an input that wants a gradient too (an SAE's inputs do not; the Function serves both). The
    # backward's product takes the CPU's way or CUDA's: both must give the dense path's gradients.
    if product.startswith("index_add"):
        monkeypatch.setattr(sparse_module, "scatter_rows", sparse_module.index_add_rows)
    if product.endswith("in slices (CUDA)"):  # a few entries at a time
        monkeypatch.setattr(sparse_module, "CHUNK_FLOATS", 3 * max(D, N))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, D, dtype=torch.float64, generator=gen, requires_grad=True)
    params = [torch.randn(*s, dtype=torch.float64, generator=gen, requires_grad=True) for s in [(D, N), (N,), (D,)]]
    W_enc, b_enc, b_dec = params
    indices = torch.stack([torch.randperm(N, generator=gen)[:7] for _ in range(B)])
    flat = torch.randperm(B * N, generator=gen)[:50]
    columns = torch.randperm(N, generator=gen)[:9]
    weights = [torch.randn(*s, dtype=torch.float64, generator=gen) for s in [(B, 7), (50,), (B, 9)]]
    grads = {}
    for sparse in (False, True):
        sae = torch.nn.Module()
        sae.W_enc, sae.b_enc, sae.pre_bias = W_enc, b_enc, b_dec  # an SAE centres by b_dec
        pre = SparsePre(x, sae) if sparse else (x - b_dec) @ W_enc + b_enc
        torch.testing.assert_close(plain(pre), ((x - b_dec) @ W_enc + b_enc).detach())
        picks = pick(pre, indices), pick_flat(pre, flat), pick_columns(pre, columns)
        # a top-k's own values, handed to pick, stand for the gather they spare
        torch.testing.assert_close(pick(pre, indices, plain(pre).gather(1, indices)), picks[0])
        loss = sum((p * w).sum() for p, w in zip(picks, weights, strict=True))
        grads[sparse] = torch.autograd.grad(loss, [x, *params])
    for name, dense, sparse in zip(["x", "W_enc", "b_enc", "b_dec"], grads[False], grads[True], strict=True):
        torch.testing.assert_close(sparse, dense, msg=name)


class _Shapes(TorchDispatchMode):
    """The shapes of every tensor the ops under it make."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.shapes |= {tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


def test_cuda_s_product_makes_the_entries_scaled_rows_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # all at once they are [entries, d] twice: for AuxK's d/2 picks a sample at the usual size, 9.7 GB on a GPU
    d, entries, shape = 16, 50, (20, 30)
    monkeypatch.setattr(sparse_module, "CHUNK_FLOATS", 3 * d)
    gen = torch.Generator().manual_seed(5)
    flat = torch.randperm(shape[0] * shape[1], generator=gen)[:entries]
    rows, cols = flat // shape[1], flat % shape[1]
    values, dense = torch.randn(entries, generator=gen), torch.randn(shape[1], d, generator=gen)
    with _Shapes() as seen:
        product = sparse_module.index_add_rows(rows, cols, values, shape, dense)
    torch.testing.assert_close(product, sparse_module.sparse_mm(rows, cols, values, shape, dense))
    made = {s[0] for s in seen.shapes if len(s) == 2 and s[1] == d and s != (shape[0], d)}  # but the output
    assert made and max(made) == 3


@pytest.mark.parametrize("sparse", [False, True])
def test_sparse_backward_makes_no_batch_by_latents_tensor(sparse: bool) -> None:
    sae = _make("topk", sparse, n_dead=30)
    out = sae.training_step(_batches(1)[0])
    with _Shapes() as seen:
        out["loss"].backward()
    assert ((B, N) in seen.shapes) != sparse  # the dense path's gradient of the pre-activations, and only it
    assert sae.W_enc.grad.shape == (D, N)


@pytest.mark.parametrize("case", ["skewed", "zeros", "misleading sample", "nan"])
def test_top_indices_finds_the_flat_top_k(case: str) -> None:
    gen = torch.Generator().manual_seed(5)
    n, count = 1 << 20, 5000
    if case == "skewed":  # BatchTopK's pre-activations: a few rows of far larger values hold most of the top
        flat = (torch.randn(1024, 1024, generator=gen) * torch.logspace(-1, 1, 1024).unsqueeze(1)).relu().flatten()
    elif case == "zeros":  # fewer positive values than count: the rest of the top are zeros (ties)
        flat = (torch.randn(n, generator=gen) - 4.0).relu()
        assert 0 < int((flat > 0).sum()) < count
    elif case == "nan":  # a NaN where the sample does not look: the top-k ranks it first, and so must this
        flat = torch.randn(n, generator=gen)
        flat[3] = float("nan")
    else:  # every sampled value large, the others just below: the sample's threshold passes too few
        flat = torch.rand(n, generator=gen)
        flat[:: (n // 65536) | 1] += 10.0
        count = 100_000
    idx = top_indices(flat, count)
    assert idx.shape == (count,) and len(set(idx.tolist())) == count
    if case == "nan":
        assert 3 in idx.tolist()
        flat, idx = flat[flat == flat], idx[idx != 3] - (idx[idx != 3] > 3).long()  # the rest, without the NaN
        count -= 1
    torch.testing.assert_close(flat[idx].sort().values, flat.topk(count).values.sort().values)  # ties aside


@pytest.mark.parametrize("sparse", [False, True])
def test_batchtopk_keeps_the_definition_s_codes_and_gradients_at_a_size_that_takes_the_sample(sparse: bool) -> None:
    # 512 x 1024 pre-activations: top_indices takes its sampled threshold, checked against the definition (a flat top
    # k x B of the batch's ReLU'd pre-activations, by hand), rows of very different norms.
    batch, latents = 512, 1024
    x = torch.randn(batch, D, generator=torch.Generator().manual_seed(4)) * torch.logspace(-1, 1, batch).unsqueeze(1)
    torch.manual_seed(0)
    sae = BatchTopKSAE(d_in=D, n_latents=latents, k=4, sparse_backward=sparse)
    params = [sae.W_enc, sae.b_enc, sae.b_dec, sae.W_dec]
    codes, _ = sae.activate(SparsePre(x, sae) if sparse else sae.pre_activations(x))
    recon = sae.decode(codes, None)
    grads = torch.autograd.grad((recon - x).pow(2).sum(), params)

    flat = F.relu(sae.pre_activations(x)).flatten()
    idx = flat.detach().topk(sae.k * batch).indices
    expected = torch.zeros_like(flat).scatter(0, idx, flat[idx]).view(batch, latents)
    torch.testing.assert_close(codes, expected)
    assert float(sae.threshold) == float(flat[idx].detach().min())  # the first step's: the smallest kept value
    want = torch.autograd.grad((expected @ sae.W_dec + sae.b_dec - x).pow(2).sum(), params)
    for name, got, w in zip(["W_enc", "b_enc", "b_dec", "W_dec"], grads, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=name)
