"""Run under torchrun with 2 or 4 gloo ranks (tests/e2e/test_sharded_source.py): a source model sharded over the ranks
(source.shard=fsdp) gives the activations and the spliced losses of the whole model, each rank holding 1/world of its
parameters. argv[1]: the finished GPT run. Exits non-zero on the first broken expectation."""

import sys

import torch
import torch.distributed as dist

from experiments.sae.sources.sharded import source_parameters
from experiments.sae.sources.source import SourceModel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
whole = SourceModel(sys.argv[1], ["blocks.0", "blocks.1"], skip_positions=1)
sharded = SourceModel(sys.argv[1], ["blocks.0", "blocks.1"], skip_positions=1, shard="fsdp")
held = source_parameters(sharded.model)
assert held["whole"] == sum(p.numel() for p in whole.model.parameters()), held
assert held["on_this_rank"] <= held["whole"] / world + 64, (rank, held)  # + the uneven rows of a small tensor
for batch in list(sharded.data.val_loader())[:3]:
    assert torch.equal(sharded.activations(batch), whole.activations(batch)), rank
    # a batch of fewer windows than ranks: every rank runs it whole, in step
    small = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    assert torch.equal(sharded.activations(small), whole.activations(small)), rank
    assert source_parameters(sharded.model) == held  # what a forward gathered is freed again
halve = ("blocks.1", lambda out: out * 0.5)
got, want = sharded.compare({"clean": None, "halved": halve}), whole.compare({"clean": None, "halved": halve})
assert got == want, (rank, got, want)
print(f"rank {rank}: ok")
dist.destroy_process_group()
