"""Transcoders under torchrun (2 processes, gloo, DDP) on the CPU train like one process with the same global batch.

The same global batch is 1 process x 32 x accumulation 2, not 1 x 64: a coder's loss is normalised by each micro-batch's
own variance (SSE / SST), so 2 ranks x 32 sum the gradients of two halves, as accumulation does, and the synthetic data
makes a batch from the position of its first row (experiments/sae/sources/synthetic.py): rank 1's 32 rows are a
one-process run's second micro-batch, not rows 32-63 of one batch of 64. The comparisons turn the data-dependent init
off (model.normalize_input, geometric_median_init, encoder_init=fit): on 2 ranks it reads the global first micro-batch
(64 rows, all-gathered), in one process with accumulation only its first micro-batch. The init itself is checked against
the 64 rows it must have read, and for parameters identical on both ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LM, assert_close_weights, cli, jsonl, ok, torchrun, values, weights

# As in tests/e2e/test_distributed.py: the same per-sample gradients summed in another order, float32 rounding
# amplified by Adam where gradients are near zero; far below one step's change (~1e-3)
ATOL = 1e-5
STEPS = 20
SYNTHETIC = [
    "+experiment=sae",
    "data=transcoder_synthetic",
    *("data.splits.d=32", "data.splits.d_out=24", "data.splits.n_features=64", "data.splits.n_val=256"),
    *("model.n_latents=96", "model.k=4", "model.dead_window=2st"),  # AuxK and the dead-latent clock are live
    f"trainer.max_duration={STEPS}st",
    "trainer.val_interval=10st",
    "trainer.log_interval=5st",
    "logger=[console,jsonl]",
    "checkpoint=none",
]
SKIP = ["model.skip=true", "data.splits.linear=0.5"]
NO_DATA_INIT = ["model.normalize_input=false", "model.geometric_median_init=false", "model.encoder_init=unit"]
# parameters compared across the ranks at the start and every 5 steps (a failed check fails the job)
CONSISTENT = ["callbacks=[rank_consistency]", "callbacks.rank_consistency.interval=5st"]
TWO_RANKS = ["distributed=ddp", "data.batch_size=32"]
# callbacks=none: without sae_splice's validation, the KL presets' monitor (val/kl_spliced) is not produced
ONE = ["data.batch_size=32", "trainer.accumulate_grad_batches=2", "callbacks=none", "monitor=val/fve"]
# a cross-layer transcoder on the 2 blocks of tests/helpers.TINY_LM's GPT
CLT = [
    "+experiment=clt_lm",
    "source.module=[blocks.0.mlp_norm,blocks.1.mlp_norm]",
    "source.target=[blocks.0.mlp,blocks.1.mlp]",
    *("model.coder.n_latents=64", "model.coder.k=4", "model.coder.dead_window=2st"),
    *("model.normalize_input=false", "model.geometric_median_init=false"),
    *("data.buffer_size=512", "data.samples_per_epoch=2048"),  # 32 and 64 rows divide the half refilled: aligned
    *("trainer.max_duration=10st", "trainer.val_interval=10st", "trainer.log_interval=5st"),
    *("logger=[console,jsonl]", "checkpoint=none"),
]

# a transcoder trained end to end through the same GPT (experiments/sae/end_to_end.py): each rank's KL over its own
# windows, its gradient through the frozen later layers
KL = [
    "+experiment=transcoder_lm_kl",
    "source.layer=1",
    *("model.coder.n_latents=64", "model.coder.k=4", "model.coder.dead_window=2st"),
    *("model.coder.normalize_input=false", "model.coder.geometric_median_init=false"),
    *("trainer.max_duration=10st", "trainer.val_interval=10st", "trainer.log_interval=5st"),
    *("logger=[console,jsonl]", "checkpoint=none"),
]


def two_ranks(root: Path, name: str, *overrides: str) -> dict[str, Any]:
    done = ok(torchrun(*overrides, *TWO_RANKS, f"hydra.run.dir={root / name}", cwd=root))
    return {"stderr": done.stderr, "run_dir": root / name}


def one(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*overrides, *ONE, cwd=root, run_dir=root / name))
    return root / name


def lm(root: Path) -> Path:
    ok(cli(*TINY_LM, f"data.cache_dir={root / 'cache'}", cwd=root, run_dir=root / "lm"))
    return root / "lm"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs): the source GPT first (the CLT's jobs wait for it), torchruns next."""
    source = lambda: f"source.checkpoint={runs['lm'].result()}"  # noqa: E731 - asked for when the job runs
    return {
        "lm": lambda: lm(root),
        "skip_ddp": lambda: two_ranks(root, "skip_ddp", *SYNTHETIC, *SKIP, *NO_DATA_INIT, *CONSISTENT),
        "init_ddp": lambda: two_ranks(root, "init_ddp", *SYNTHETIC, *SKIP, *CONSISTENT),
        "clt_ddp": lambda: two_ranks(root, "clt_ddp", *CLT, source(), "callbacks=[sae_splice,rank_consistency]"),
        "skip_one": lambda: one(root, "skip_one", *SYNTHETIC, *SKIP, *NO_DATA_INIT),
        "clt_one": lambda: one(root, "clt_one", *CLT, source()),
        "kl_ddp": lambda: two_ranks(root, "kl_ddp", *KL, source(), "callbacks=[sae_splice,rank_consistency]"),
        "kl_one": lambda: one(root, "kl_one", *KL, source()),
    }


def _same_training(ddp: dict[str, Any], single: Path) -> None:
    run_dir = ddp["run_dir"]
    assert "ddp, backend gloo, 2 rank(s) per node" in ddp["stderr"]
    assert "rank consistency: parameters identical on every rank" in ddp["stderr"]
    # every weight and buffer: since_fired is counted over both ranks' rows, as over both micro-batches
    assert_close_weights(run_dir, single, atol=ATOL)
    for key in ("train/loss", "train/fve", "val/fve", "val/l0"):
        got, expected = values(run_dir, key), values(single, key)
        assert [s for s, _ in got] == [s for s, _ in expected] and got, key
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=ATOL), key
    assert jsonl(run_dir)[-1]["step"] == STEPS


def test_a_skip_transcoder_on_two_ranks_trains_like_one_process(runs: dict[str, Future]) -> None:
    # a skip transcoder: the transcoder's path and its skip connection (tests/unit covers each code type in one process)
    ddp, single = runs["skip_ddp"].result(), runs["skip_one"].result()
    _same_training(ddp, single)
    got = weights(ddp["run_dir"])
    assert got["W_dec"].shape == (96, 24) and got["W_enc"].shape == (32, 96)
    assert torch.count_nonzero(got["W_skip"]) > 0  # it learned the target's linear part (it starts at zero)
    assert float(got["since_fired"].max()) >= 2  # latents went dead: AuxK ran on both ranks


def test_a_transcoder_s_init_on_two_ranks_reads_both_ranks_first_rows(runs: dict[str, Future]) -> None:
    from experiments.sae.coders.init import unit_scale
    from experiments.sae.sources.synthetic import synthetic_splits

    ddp = runs["init_ddp"].result()
    assert "rank consistency: parameters identical on every rank in 4 checks" in ddp["stderr"]
    # the input's and the target's scales are those of the global first micro-batch: rank 0's rows (the batch made
    # at position 0) then rank 1's (at position 32)
    train = synthetic_splits(
        n_train=4_194_304, n_val=0, seed=0, d=32, d_out=24, n_features=64, mean_active=5.0, linear=0.5
    )["train"]
    rows = torch.cat([train.__getitems__(list(range(r * 32, r * 32 + 32)))[0] for r in (0, 1)])
    got = weights(ddp["run_dir"])
    assert torch.equal(got["input_scale"], unit_scale(rows[:, :32]))
    assert torch.equal(got["target_scale"], unit_scale(rows[:, 32:]))
    assert bool(got["initialized"]) and torch.count_nonzero(got["W_skip"]) > 0


def test_a_cross_layer_transcoder_of_a_gpt_trains_on_two_ranks(runs: dict[str, Future]) -> None:
    ddp = runs["clt_ddp"].result()
    assert "rank consistency: parameters identical on every rank" in ddp["stderr"]
    metrics = jsonl(ddp["run_dir"])[-1]
    assert "val/loss_recovered" in metrics and "val/layer1/fve" in metrics  # the spliced replacement model, on DDP
    got = weights(ddp["run_dir"])
    assert got["coders.0.W_dec"].shape == (64, 64) and got["coders.1.W_dec"].shape == (64, 32)
    assert torch.count_nonzero(got["coders.0.W_dec"][:, 32:]) > 0  # layer 0's writes to layer 1 were trained


def test_a_cross_layer_transcoder_of_a_gpt_on_two_ranks_trains_like_one_process(runs: dict[str, Future]) -> None:
    # each rank trains on its own share of the rows one process takes micro-batch after micro-batch (buffer.py)
    ddp, single = runs["clt_ddp"].result(), runs["clt_one"].result()
    assert_close_weights(ddp["run_dir"], single, atol=ATOL)


def test_an_end_to_end_transcoder_on_two_ranks_trains_like_one_process(runs: dict[str, Future]) -> None:
    ddp, single = runs["kl_ddp"].result(), runs["kl_one"].result()
    assert "rank consistency: parameters identical on every rank" in ddp["stderr"]
    assert_close_weights(ddp["run_dir"], single, atol=ATOL)
    for key in ("train/kl", "train/ce", "val/fve"):
        got, expected = values(ddp["run_dir"], key), values(single, key)
        assert got and [v for _, v in got] == pytest.approx([v for _, v in expected], abs=ATOL), key
    assert "val/kl_spliced" in jsonl(ddp["run_dir"])[-1]
