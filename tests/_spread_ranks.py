"""Run under torchrun with 2 gloo ranks (tests/e2e/test_spread.py): a family spread over the ranks (distributed=spread)
trains each SAE as one process does on the global batch, for SAEs of two hooked modules that read different columns
and batches whose sizes differ between ranks. Exits non-zero on the first broken expectation."""

import functools

import torch
import torch.distributed as dist

from experiments.sae.coders.activations import TopKSAE
from experiments.sae.coders.multi import MultiSAE

dist.init_process_group("gloo")
rank = dist.get_rank()
base = functools.partial(TopKSAE, n_latents=32, dead_window="2st")
hooks = {"blocks.0": 6, "blocks.1": 10}  # columns 0-5 and 6-15 of each row
torch.manual_seed(0)
spread = MultiSAE(base=base, ks=[2, 4], hooks=hooks, distribute=True)
torch.manual_seed(0)
alone = MultiSAE(base=base, ks=[2, 4], hooks=hooks)  # the whole family, as one process builds it
for sae in alone.saes.values():
    sae.sees_global_batch = True  # it trains on the global batch, as one process
mine = {"blocks_0_k2", "blocks_1_k2"} if rank == 0 else {"blocks_0_k4", "blocks_1_k4"}  # equal sizes: alternating
assert set(spread.mine) == mine, (rank, spread.mine)
assert all(spread.saes[n].W_enc.is_meta == (n not in mine) for n in spread.saes), rank
for name in mine:  # each SAE starts as one process starts it: a seed of its own
    assert torch.equal(spread.saes[name].W_enc, alone.saes[name].W_enc), name
opt = torch.optim.Adam(spread.parameters(), lr=1e-2)
opt_alone = torch.optim.Adam(alone.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
for step in range(6):
    whole = torch.randn(24, 16, generator=g) * torch.linspace(0.5, 2, 16)
    cut = 14 if step % 2 else 12  # rank 0's rows, then rank 1's: unequal on odd steps
    out = spread.training_step((whole[:cut] if rank == 0 else whole[cut:],))
    ref = alone.training_step((whole,))
    assert set(out) == set(ref), (rank, set(out) ^ set(ref))
    for key, value in ref.items():  # every SAE's metrics on every rank, and the family's loss
        assert torch.allclose(out[key].detach(), value.detach(), rtol=1e-6, atol=1e-7), (rank, step, key)
    out["loss"].backward()
    ref["loss"].backward()
    opt.step(), opt_alone.step(), opt.zero_grad(), opt_alone.zero_grad()
    spread.after_optimizer_step(), alone.after_optimizer_step()
for name in mine:
    for key, value in alone.saes[name].state_dict().items():
        assert torch.allclose(spread.saes[name].state_dict()[key], value, rtol=1e-5, atol=1e-6), (name, key)
val = spread.validation_summary(
    {k: v for k, v in spread.validation_step(torch.randn(5 + 3 * rank, 16, generator=g)).items()}
)
assert {"fve", "blocks_0_k2/fve", "blocks_1_k4/fve"} <= set(val), sorted(val)
print(f"rank {rank}: ok")
dist.destroy_process_group()
