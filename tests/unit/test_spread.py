"""distributed=spread in one process: where each SAE of a family goes, and the settings it refuses (2 ranks for real:
tests/e2e/test_spread.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from omegaconf import DictConfig

from experiments.sae.coders.spread import placement
from runner import ConfigError
from runner.build import build
from runner.data.samplers import ValidationShard
from runner.loop import fit

SMALL = ("+experiment=sae", "data.splits.d=16", "data.splits.n_features=32", "checkpoint=none")


def test_sae_s_are_placed_largest_first_on_the_least_loaded_rank() -> None:
    assert placement([10, 10, 10], 2) == [0, 1, 0]
    # 4 widths over 2 ranks: 8 + 1 against 4 + 2, not 8 + 4 against 2 + 1
    assert placement([1, 2, 4, 8], 2) == [1, 1, 1, 0]
    assert placement([8, 4, 2, 1], 4) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="2 SAEs leave 2 of the 4 ranks without one"):
        placement([1, 1], 4)


def test_one_process_trains_the_whole_family_and_a_single_model_is_refused(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    run = build(
        compose_cfg(*SMALL, "model=sae_multi", "model.ks=[2,4]", "model.base.n_latents=64", "distributed=spread")
    )
    assert run.task.distribute and run.task.mine == ["k2", "k4"]
    assert not any(p.is_meta for p in run.task.parameters())
    with pytest.raises(ConfigError, match="distributed=spread trains each SAE of a family on one rank.*TopKSAE"):
        build(compose_cfg(*SMALL, "model.n_latents=64", "distributed=spread"))


def test_distribute_set_by_hand_under_ddp_names_the_option_that_does_it(compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(*SMALL, "model=sae_multi", "model.ks=[2,4]", "model.distribute=true", "distributed=ddp")
    with pytest.raises(ConfigError, match=r"model.distribute=True, but distributed gives False.*distributed=spread"):
        build(cfg)


def test_every_rank_gets_as_many_validation_batches_each_sample_once() -> None:
    # a spread family's validation_step is a collective: 129 + 128 samples in batches of 128 would be 2 + 1 calls
    for n, world, size in ((257, 2, 128), (179, 2, 32), (10, 4, 3), (8, 2, 4)):
        shards = [list(ValidationShard(n, rank, world, size)) for rank in range(world)]
        assert len({len(batches) for batches in shards}) == 1, (n, world, size)
        assert sorted(i for batches in shards for batch in batches for i in batch) == list(range(n))
        assert all(0 < len(batch) <= size for batches in shards for batch in batches)
    assert [len(b) for b in ValidationShard(257, 1, 2, 128)] == [127, 1]


@pytest.mark.parametrize("callback", ["ema", "health", "rank_consistency"])
def test_callbacks_that_read_every_weight_are_refused_with_the_reason(
    compose_cfg: Callable[..., DictConfig], callback: str
) -> None:
    # on 2 ranks each holds only its own SAEs (the others are meta placeholders): refused on one rank as well, so
    # that a config does not start working or failing with the number of ranks
    family = ("model=sae_multi", "model.ks=[2,4]", "model.base.n_latents=64", "distributed=spread")
    run = build(compose_cfg(*SMALL, *family, f"callbacks=[{callback}]", "trainer.max_duration=2st"))
    with pytest.raises(
        ConfigError, match=rf"callbacks.{callback} does not run under distributed=spread.*distributed=ddp"
    ):
        fit(run)
    assert run.progress.step == 0
