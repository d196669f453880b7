"""Run under torchrun with 2 gloo ranks (tests/e2e/test_distributed.py): an SAE's data-dependent init and its
dead-latent accounting are every rank's, the same on each. Exits non-zero on the first broken expectation."""

import torch
import torch.distributed as dist

from experiments.sae.coders.activations import TopKSAE, geometric_median

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(2, 64, 16) + 3.0  # both ranks' first batches; each rank trains on its own
for unit in ("st", "sa"):
    torch.manual_seed(1)
    sae = TopKSAE(d_in=16, n_latents=8, k=2, dead_window="2st" if unit == "st" else "100sa")
    sae.training_step((x[rank],))
    # init from the global batch: input scale and b_dec as one process would compute them from both ranks' rows
    whole = x.reshape(128, 16)
    scale = 16**0.5 / whole.norm(dim=1).mean()
    assert torch.allclose(sae.input_scale, scale), (rank, sae.input_scale, scale)
    assert torch.allclose(sae.b_dec, geometric_median(whole * scale)), rank
    # latent 3 fires on rank 1's rows only, latent 5 on rank 0's only: neither is dead on any rank
    sae.since_fired.zero_()
    sae.fired.zero_()
    fired = torch.zeros(8, dtype=torch.bool)
    fired[5 if rank == 0 else 3] = True
    sae._track(fired, batch=64)
    sae.after_optimizer_step()
    sae._track(torch.zeros(8, dtype=torch.bool), batch=64)
    sae.after_optimizer_step()
    expected = torch.full((8,), 2.0 if unit == "st" else 256.0)  # 2 steps, or 2 x 64 rows on 2 ranks
    expected[[3, 5]] = 1.0 if unit == "st" else 128.0
    assert torch.equal(sae.since_fired, expected), (unit, rank, sae.since_fired)
print(f"rank {rank}: ok")
dist.destroy_process_group()
