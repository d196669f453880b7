"""source.shard=fsdp for real on gloo ranks: the frozen source sharded with FSDP2, each rank running its slice of every
batch, trains the SAE exactly as the replicated source does, holding 1/world of the source's parameters; and a family
spread over the ranks (distributed=spread) on the live residual stream matches one process, spliced losses too."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import TINY_LM, assert_same_weights, cli, metric_rows, ok, python, read_json, torchrun

RANKS_SCRIPT = str(Path(__file__).parents[1] / "_shard_ranks.py")


def _sae(lm: Path) -> list[str]:
    return [
        "+experiment=sae_lm",
        f"source.checkpoint={lm}",
        "source.layer=1",
        "data.buffer_size=1024",
        "trainer.max_duration=10st",
        "trainer.val_interval=10st",
        "trainer.log_interval=5st",
        "checkpoint=none",
        "logger=jsonl",
    ]


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""

    def lm() -> Path:
        ok(cli(*TINY_LM, cwd=root, run_dir=root / "lm"))
        return root / "lm"

    def launch(name: str, *overrides: str, ranks: bool = True) -> Path:
        sae = _sae(runs["lm"].result())
        if ranks:
            ok(torchrun(*sae, *overrides, f"hydra.run.dir={root / name}", cwd=root))
        else:
            ok(cli(*sae, *overrides, cwd=root, run_dir=root / name))
        return root / name

    single = ["model.n_latents=64", "model.k=4", "data.batch_size=64", "distributed=ddp"]
    family = ["model=sae_multi", "model.ks=[2,4]", "model.base.n_latents=64"]
    return {
        "lm": lm,
        "replicated": lambda: launch("replicated", *single),
        "sharded": lambda: launch("sharded", *single, "source.shard=fsdp"),
        "spread": lambda: launch("spread", *family, "data.batch_size=64", "distributed=spread"),
        "one": lambda: launch("one", *family, "data.batch_size=128", ranks=False),
        "ranks4": lambda: python(
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=4",
            RANKS_SCRIPT,
            str(runs["lm"].result()),
            cwd=root,
        ),
    }


def test_a_sharded_source_trains_the_sae_bit_for_bit_as_the_replicated_one(runs: dict[str, Future]) -> None:
    sharded, replicated = runs["sharded"].result(), runs["replicated"].result()
    # every rank's ring is filled alike, each rank running half of every batch of windows through its shards
    assert_same_weights(sharded, replicated)
    assert metric_rows(sharded) == metric_rows(replicated)  # the spliced losses too: the splicing pass is sharded
    held = read_json(sharded / "run.json")["data"]["source_parameters"]
    assert held["on_this_rank"] == held["whole"] // 2  # every tensor of the tiny GPT splits evenly over 2 ranks


def test_the_sharded_source_matches_the_whole_model_on_4_ranks(runs: dict[str, Future]) -> None:
    # (on 2 ranks: the first test, through a whole run)
    proc = ok(runs["ranks4"].result())  # the assertions are in tests/_shard_ranks.py, on each rank
    assert all(f"rank {r}: ok" in proc.stdout for r in range(4)), proc.stdout


def test_a_spread_family_on_the_live_stream_matches_one_process_spliced_losses_included(
    runs: dict[str, Future],
) -> None:
    spread, one = metric_rows(runs["spread"].result()), metric_rows(runs["one"].result())
    assert [row["step"] for row in spread] == [row["step"] for row in one]
    last, want = spread[-1], one[-1]
    for key in ("val/k2/ce_spliced", "val/k4/kl_spliced", "val/loss_recovered", "val/k2/fve", "train/loss"):
        assert abs(last[key] - want[key]) <= 1e-6 * max(1.0, abs(want[key])), key
