"""Run under torchrun with 2 or 4 gloo ranks (tests/e2e/test_sharded_source.py): a source model sharded over the ranks
(source.shard=fsdp) gives the activations and the spliced losses of the whole model, each rank holding 1/world of its
parameters and reading only its slices of the weights file; an FSDP init_from, its task's parameters built on the
meta device, reads its slices the same way. argv[1]: the finished GPT run. Exits non-zero on the first broken
expectation."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from experiments.sae.sources.sharded import source_parameters
from experiments.sae.sources.source import SourceModel
from runner.ckpt import sliced
from runner.ckpt.sliced import built
from runner.distributed.fsdp import FSDP
from runner.rundir import read_run_config

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
whole = SourceModel(sys.argv[1], ["blocks.0", "blocks.1"], skip_positions=1)
read, opened = [0], sliced.safe_open


class Counted:
    """safe_open's handle, counting the bytes of the slices and tensors read through it."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        return self._count(self.handle.get_tensor(key))

    def get_slice(self, key):
        part = self.handle.get_slice(key)
        return type(
            "Slice", (), {"get_shape": lambda _: part.get_shape(), "__getitem__": lambda _, i: self._count(part[i])}
        )()

    def _count(self, tensor):
        read[0] += tensor.numel() * tensor.element_size()
        return tensor


sliced.safe_open = lambda *args, **kwargs: Counted(opened(*args, **kwargs))
sharded = SourceModel(sys.argv[1], ["blocks.0", "blocks.1"], skip_positions=1, shard="fsdp")
file_bytes = sum(t.numel() * t.element_size() for t in whole.model.state_dict().values())
# its slices only (the tied head and embedding are one tensor in the model, two in the file: each rank reads both)
assert 0 < read[0] <= file_bytes / world + 4096, (rank, read[0], file_bytes)
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
# an FSDP init_from: the task built with its parameters on the meta device, sharded by the strategy's wrap, given
# storage for its shards, then each rank reads its slices
strategy, read[0] = FSDP(device="cpu"), 0
assert strategy.empty_init(strict=True) and not strategy.empty_init(strict=False)
config = read_run_config(Path(sys.argv[1]))
task = built(lambda: instantiate(config.model), torch.device("cpu"), empty=True)
assert all(p.is_meta for p in task.parameters()) and torch.equal(task.rope, whole.model.rope)
strategy.init_from(task, str(Path(sys.argv[1]) / "model.safetensors"), say=False)
assert read[0] == 0  # nothing read before the model is sharded
strategy.wrap(task)
assert 0 < read[0] <= file_bytes / world + 4096, (rank, read[0], file_bytes)
assert task.head.weight is task.embed.weight  # tied: one sharded Parameter
for name, tensor in task.state_dict().items():
    assert torch.equal(tensor.full_tensor(), whole.model.state_dict()[name]), (rank, name)
assert torch.equal(task.rope, whole.model.rope)  # the constructor's, on every rank (not in the file)
with torch.no_grad():  # and it computes what the whole model does
    batch = next(iter(whole.data.val_loader()))
    assert torch.equal(task.validation_step(batch)["loss"], whole.model.validation_step(batch)["loss"]), rank
print(f"rank {rank}: ok")
dist.destroy_process_group()
