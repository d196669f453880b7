"""The Triton kernels of a TopK-style SAE (experiments/sae/coders/kernels.py) against the torch path they replace on
CUDA: the products on random COO matrices of awkward sizes, and whole training steps (TopK with its masked AuxK,
BatchTopK) whose losses and gradients must equal the torch path's. On the CPU they run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU); on a GPU, compiled, on the GPU."""

from __future__ import annotations

import os
import platform
import sys

import pytest
import torch

if sys.platform != "linux" or platform.machine() != "x86_64":
    pytest.importorskip("triton")  # the dev extra installs it on x86-64 Linux, where CI runs: there it must be there

from experiments.sae.coders import kernels
from experiments.sae.coders.activations import BatchTopKSAE, TopKSAE, auxk_loss
from experiments.sae.coders.sparse import SparsePre
from runner import ConfigError

pytestmark = pytest.mark.triton  # benchmarks/gpu_check.py runs these on the GPU with the `gpu` tests
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHOICES = ("torch", "triton")


def _coo(batch: int, n: int, per_row: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    cols = torch.stack([torch.randperm(n, generator=gen)[:per_row] for _ in range(batch)])
    rows = torch.arange(batch).repeat_interleave(per_row)
    values = torch.randn(batch * per_row, generator=gen)
    return rows, cols, values


@pytest.mark.parametrize(("batch", "n", "d", "per_row"), [(37, 100, 70, 3), (64, 33, 8, 33), (5, 1000, 130, 1)])
def test_transpose_product_is_the_dense_product_in_both_layouts(batch: int, n: int, d: int, per_row: int) -> None:
    # sizes that are no multiple of the blocks; every latent of the second has entries in every row (a full
    # matrix: one latent's entries span many slices); most of the third's have none (their rows must be written 0)
    gen = torch.Generator().manual_seed(batch)
    rows, cols, values = _coo(batch, n, per_row, gen)
    dense = torch.randn(batch, d, generator=gen)
    S = torch.zeros(batch, n).index_put_((rows, cols.flatten()), values)
    want = (S.t().double() @ dense.double()).float()
    args = rows.to(DEVICE), cols.to(DEVICE), values.to(DEVICE), n, dense.to(DEVICE)
    nd, dn = kernels.transpose_product(*args), kernels.transpose_product(*args, layout="dn")
    assert nd.shape == (n, d) and dn.shape == (d, n) and dn.is_contiguous()
    torch.testing.assert_close(nd.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dn.cpu(), want.t(), rtol=1e-5, atol=1e-5)


def test_gathered_decode_is_embedding_bag_forward_and_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    n, d, batch, k = 200, 72, 30, 7
    _, cols, values = _coo(batch, n, k, gen)
    indices, codes = cols.to(DEVICE), values.view(batch, k).to(DEVICE)
    W = torch.randn(n, d, generator=gen).to(DEVICE)
    grad = torch.randn(batch, d, generator=gen).to(DEVICE)
    seen = []
    for decode in (kernels.GatheredDecode.apply, lambda i, c, w: torch.nn.functional.embedding_bag(
        i, w, per_sample_weights=c, mode="sum")):  # fmt: skip
        c, w = codes.clone().requires_grad_(), W.clone().requires_grad_()
        out = decode(indices, c, w)
        out.backward(grad)
        seen.append((out.detach(), c.grad, w.grad))
    for ours, theirs in zip(*seen, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _step(sae_cls: type, kernels_choice: str, n_dead: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    assert kernels.use_triton(kernels_choice, DEVICE) == (kernels_choice == "triton")  # each path is the one named
    torch.manual_seed(0)
    sae = sae_cls(d_in=24, n_latents=160, k=6, k_aux=12, kernels=kernels_choice).to(DEVICE)
    with torch.no_grad():
        sae.since_fired[torch.randperm(160, generator=torch.Generator().manual_seed(1))[:n_dead]] = 10_000
    sae.after_optimizer_step()
    sae.auxk_active = True  # CUDA's AuxK runs while the last log row saw dead latents
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(2):  # two micro-batches: the kernels' gradients accumulate in .grad like the torch path's
        out = sae.training_step((torch.randn(50, 24, generator=gen) * 2 + 1).to(DEVICE))
        (out["loss"] / 2).backward()
        losses.append(out["loss"].detach())
    return losses, {name: p.grad.clone() for name, p in sae.named_parameters()}


@pytest.mark.parametrize("n_dead", [0, 40])
@pytest.mark.parametrize("sae_cls", [TopKSAE, BatchTopKSAE])
def test_a_training_step_with_the_kernels_equals_the_torch_paths(sae_cls: type, n_dead: int) -> None:
    (torch_losses, torch_grads), (triton_losses, triton_grads) = (_step(sae_cls, k, n_dead) for k in CHOICES)
    for a, b in zip(torch_losses, triton_losses, strict=True):
        torch.testing.assert_close(a, b)  # the forward is the same arithmetic
    for name, grad in torch_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(triton_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_masked_auxk_with_the_kernels_equals_the_torch_path() -> None:
    # CUDA's AuxK (masked top-k over every latent, decoded through the gathered decoder) on 30 dead latents
    seen = []
    for choice in ("torch", "triton"):
        assert kernels.use_triton(choice, DEVICE) == (choice == "triton")
        torch.manual_seed(0)
        sae = TopKSAE(d_in=16, n_latents=96, k=4, k_aux=6, kernels=choice).to(DEVICE)
        with torch.no_grad():
            sae.since_fired[:30] = 10_000
        sae.after_optimizer_step()
        x = (torch.randn(40, 16, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
        pre = SparsePre(x, sae)
        values, indices = sae.activate(pre)
        recon = sae.decode(values, indices)
        auxk = auxk_loss(pre, sae.dead, sae.W_dec, sae.k_aux, (x - recon).detach(), True, sae.kernels)
        ((recon - x).pow(2).mean() + auxk).backward()
        seen.append((auxk.detach(), {name: p.grad for name, p in sae.named_parameters()}))
    (aux_torch, torch_grads), (aux_triton, triton_grads) = seen
    assert float(aux_torch) > 0
    torch.testing.assert_close(aux_triton, aux_torch)
    for name, grad in torch_grads.items():
        torch.testing.assert_close(triton_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_kernels_choice_is_checked_and_auto_keeps_the_cpu_on_torch() -> None:
    with pytest.raises(ConfigError, match=r"model.kernels='cuda': give one of auto, triton, torch"):
        TopKSAE(d_in=8, n_latents=16, kernels="cuda")
    assert not kernels.use_triton("auto", torch.device("cpu"))  # the interpreter only when asked for by name
    interpreted = kernels.HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
    assert kernels.use_triton("triton", torch.device("cpu")) == interpreted
    assert not kernels.use_triton("torch", torch.device("cuda"))
