"""GlobalBatchSampler: which samples make up each optimizer step depends on the seed and the global batch only."""

from __future__ import annotations

import pytest
import torch

from runner.data import DataModule, TensorData, first_rows
from runner.data.samplers import GlobalBatchSampler

# (micro-batch size, ranks, accumulation): every split of a global batch of 32
SPLITS_OF_32 = [(32, 1, 1), (16, 2, 1), (16, 1, 2), (8, 2, 2), (8, 1, 4), (4, 4, 2), (2, 8, 2), (1, 8, 4)]


def _steps(n: int, batch_size: int, world: int, accumulate: int, epoch: int = 0, **kw) -> list[list[list[list[int]]]]:
    """steps[s][m][r]: the indices rank r trains on in micro-batch m of optimizer step s."""
    samplers = [GlobalBatchSampler(n, batch_size, r, world, accumulate, seed=3, **kw) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(micro) for micro in per_rank}) == 1  # every rank runs the same number of micro-batches
    micro = [[per_rank[r][m] for r in range(world)] for m in range(len(per_rank[0]))]
    steps = [micro[i : i + accumulate] for i in range(0, len(micro), accumulate)]
    assert len(micro) == samplers[0].micro_batches == len(samplers[0])
    return steps


def _step_sets(steps) -> list[frozenset[int]]:
    return [frozenset(i for m in step for r in m for i in r) for step in steps]


@pytest.mark.parametrize("n", [1438, 100, 50, 33, 17])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_split_of_a_global_batch_trains_the_same_samples_in_every_step(n, epoch):
    reference = _step_sets(_steps(n, 32, 1, 1, epoch))
    for b, w, a in SPLITS_OF_32:
        steps = _steps(n, b, w, a, epoch)
        # fewer leftover samples than ranks cannot give every rank one: that short step alone is dropped
        expected = reference[:-1] if 0 < n % 32 < w else reference
        assert _step_sets(steps) == expected, (b, w, a)
        for step in steps:
            for micro in step:
                assert all(1 <= len(r) for r in micro)  # no rank ever gets an empty micro-batch
                sizes = [len(r) for r in micro]
                assert max(sizes) - min(sizes) <= 1  # balanced
                assert max(sizes) <= max(b, 2)  # within the micro-batch size (one sample per rank: two at most)
    seen = [i for step in reference for i in step]
    assert sorted(seen) == list(range(n))  # every sample once per epoch: no padding duplicates, nothing dropped


def test_epochs_are_reshuffled_by_seed_and_epoch_and_are_otherwise_reproducible():
    first, again, second = _steps(64, 8, 2, 1, 0), _steps(64, 8, 2, 1, 0), _steps(64, 8, 2, 1, 1)
    assert first == again and first != second
    assert _steps(64, 8, 2, 1, shuffle=False)[0] == [[list(range(8)), list(range(8, 16))]]


def test_the_short_last_step_is_dropped_with_drop_last_and_when_fewer_samples_than_ranks_are_left():
    assert [len(s) for s in _step_sets(_steps(50, 8, 2, 2, drop_last=True))] == [32]
    # 33 = 32 + 1: a single leftover sample cannot be shared by 2 ranks
    sampler = GlobalBatchSampler(33, 16, 0, 2, 1)
    assert sampler.samples_per_epoch == 32 and len(sampler) == 1
    one = GlobalBatchSampler(33, 32, 0, 1, 1)
    assert one.samples_per_epoch == 33 and len(one) == 2


def test_short_last_step_uses_as_few_micro_batches_as_fit():
    # 50 = 32 + 18 samples; 8 per rank x 2 ranks x 2: the last step has 18 samples -> 2 micro-batches of 9 (5 + 4)
    steps = _steps(50, 8, 2, 2)
    assert [[len(r) for r in micro] for micro in steps[-1]] == [[5, 4], [5, 4]]
    assert GlobalBatchSampler(50, 8, 0, 2, 2).micro_batches == 4


def test_skip_resumes_an_epoch_with_the_next_unseen_micro_batch():
    full = GlobalBatchSampler(100, 8, 1, 2, 2, seed=5)
    full.set_epoch(3)
    whole = list(full)
    resumed = GlobalBatchSampler(100, 8, 1, 2, 2, seed=5)
    resumed.set_epoch(3, skip=3)
    assert len(resumed) == len(whole) - 3 and list(resumed) == whole[3:]
    resumed.set_epoch(4)  # the skip is for one epoch only
    assert len(list(resumed)) == len(whole)


def test_train_loader_yields_the_sampled_rows_and_the_val_loader_every_row_once_over_ranks():
    x = torch.arange(20.0).reshape(20, 1)
    data = DataModule({"train": TensorData(x), "val": TensorData(x[:7])}, batch_size=4, val_batch_size=2, seed=0)
    loader = data.train_loader(rank=1, world_size=2)
    loader.batch_sampler.set_epoch(0)
    rows = [batch[0].flatten().long().tolist() for batch in loader]
    assert rows == list(loader.batch_sampler)
    val = [
        int(v)
        for rank in range(2)
        for (batch,) in data.val_loader(rank=rank, world_size=2)
        for v in batch.flatten().tolist()
    ]
    assert sorted(val) == list(range(7))


def test_setting_the_epoch_through_the_batch_samplers_sampler_lays_out_the_same_epoch():
    # Lightning calls set_epoch on loader.sampler and loader.batch_sampler.sampler, never on the batch sampler itself
    # (as code written for a BatchSampler over a DistributedSampler does): without this every epoch repeats epoch 0.
    data = DataModule({"train": TensorData(torch.arange(64.0))}, batch_size=8, seed=3)
    ours, theirs, first = data.train_loader(), data.train_loader(), list(data.train_loader().batch_sampler)
    ours.batch_sampler.set_epoch(1)
    theirs.batch_sampler.sampler.set_epoch(1)
    assert list(theirs.batch_sampler) == list(ours.batch_sampler) != first


def test_lightning_sets_the_epoch_of_runners_train_loader():
    lightning_data = pytest.importorskip("lightning.fabric.utilities.data")  # the bench extra (in dev)
    data = DataModule({"train": TensorData(torch.arange(64.0))}, batch_size=8, seed=3)
    ours, theirs = data.train_loader(), data.train_loader()
    ours.batch_sampler.set_epoch(2)
    lightning_data._set_sampler_epoch(theirs, 2)  # what Lightning's fit loop calls at the start of every epoch
    assert [b[0].tolist() for b in theirs] == [b[0].tolist() for b in ours]


def test_first_rows_cuts_the_samples_and_leaves_what_the_samples_share() -> None:
    x, y, mask = torch.arange(15.0).view(5, 3), torch.arange(5), torch.ones(3, 3)
    cut = first_rows({"x": x, "pair": (y, mask), "name": "digits"}, 2)
    assert torch.equal(cut["x"], x[:2]) and torch.equal(cut["pair"][0], y[:2]) and cut["pair"][1] is mask
    assert cut["name"] == "digits" and isinstance(cut["pair"], tuple)
    assert torch.equal(first_rows(x[:1], 2), x[:1])  # a batch shorter than n: whole
    words = {"text": ["a", "b", "c"]}
    assert first_rows(words, 2) is words  # no tensor to tell the samples by: the task gets the batch as it is
