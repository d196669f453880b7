"""Streaming data (runner/data/streaming.py, experiments/lm/stream.py): shards by rank and loader worker, the bytes of
every pass read once, exact resume from torchdata's StatefulDataLoader state, and a stream's refusals (epochs, too many
shards, another layout on resume)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import StopAt, assert_resume_is_exact

from experiments.lm.stream import TextStream, TextStreamShards
from runner import ConfigError
from runner.build import build
from runner.ckpt.files import CheckpointError
from runner.data.streaming import ShardedStream, StreamingData
from runner.train import train

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email" / "*.py")  # 20 real files, ~360 kB
TINY_STREAM = [
    "+experiment=lm",
    "data=text_stream",
    f"data.paths=[{EMAIL}]",
    "data.val_every=5",
    "data.val_windows=16",
    "data.block=16",
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "trainer.max_duration=12st",
    "trainer.val_interval=6st",
    "trainer.log_interval=2st",
    "logger=jsonl",
    "callbacks=none",
    "checkpoint.interval=1000st",
]


def corpus(tmp_path: Path, sizes: list[int]) -> list[Path]:
    """Text files of the given sizes, each of its own letter."""
    files = []
    for i, size in enumerate(sizes):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_bytes(bytes([ord("a") + i]) * size)
    return files


def test_each_pass_shares_the_files_out_between_the_shards_in_a_new_order(tmp_path: Path) -> None:
    files, passes = corpus(tmp_path, [10] * 7), []
    for p in range(3):
        shards = []
        for index in range(3):
            stream = TextStreamShards(files, seq_len=4, seed=3)  # each worker holds a copy of its own
            stream.shard = lambda index=index: (index, 3)  # rank x worker `index` of 3
            shards.append(stream._mine(p))
        assert sorted(f for s in shards for f in s) == list(range(7))  # every file once, in one shard
        passes.append(shards)
    assert passes[0] != passes[1] != passes[2]  # shuffled anew at every pass


def test_a_shard_reads_its_files_whole_window_after_window_across_files_and_passes(tmp_path: Path) -> None:
    files = corpus(tmp_path, [7, 0, 11])
    text = b"aaaaaaa\0\0ccccccccccc\0"  # every file ends with a NUL byte, an empty one too
    stream = TextStreamShards(files, seq_len=4, shuffle=False, block=3)
    windows = [w for w, _ in zip(iter(stream), range(12), strict=False)]
    assert all(len(w) == 5 for w in windows)  # seq_len + 1: inputs and their next tokens
    read = bytes(windows[0][:1].tolist()) + b"".join(bytes(w[1:].tolist()) for w in windows)
    assert read == (text * 3)[: len(read)]  # consecutive windows share one byte; pass after pass
    (tmp_path / "distinct.txt").write_bytes(bytes(range(1, 200)))
    rows = [
        [tuple(w.tolist()) for w, _ in zip(iter(stream), range(12), strict=False)]
        for stream in (
            TextStreamShards([tmp_path / "distinct.txt"], seq_len=4, shuffle=False, block=3),
            TextStreamShards([tmp_path / "distinct.txt"], seq_len=4, shuffle=True, block=3, seed=1),
        )
    ]
    assert rows[0] != rows[1]
    for i in range(0, 12, 3):  # handed out in a random order within each block of 3 consecutive windows
        assert sorted(rows[0][i : i + 3]) == sorted(rows[1][i : i + 3])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_resumed_from_its_state_goes_on_with_exactly_the_next_batches(workers: int) -> None:
    def loader(rank: int = 0):
        data = TextStream(seq_len=16, paths=[EMAIL], val_every=0, block=8, batch_size=4, num_workers=workers)
        return data.train_loader(rank, world_size=2)

    whole = loader()
    fetched = [b for b, _ in zip(whole, range(12), strict=False)]
    assert all(b["num_tokens"] == 4 * 16 and b["tokens"].shape == (4, 17) for b in fetched)
    batches = [b["tokens"] for b in fetched]
    state = whole.state_dict(7)  # the loop has fetched ahead of what it trained: the state as of batch 7
    resumed = loader()
    resumed.load_state_dict(state, 7)
    again = [b["tokens"] for b, _ in zip(resumed, range(5), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(again, batches[7:], strict=True))
    other_rank = [b["tokens"] for b, _ in zip(loader(rank=1), range(4), strict=False)]
    assert not any(torch.equal(a, b) for a in other_rank for b in batches)  # rank 1 reads files of its own


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_stream_run_stopped_and_resumed_with_two_loader_workers_equals_the_uninterrupted_run(
    compose_cfg: Callable, tmp_path: Path, accumulate: int
) -> None:
    overrides = [*TINY_STREAM, "data.num_workers=2", f"trainer.accumulate_grad_batches={accumulate}"]
    whole, _ = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=5)
    metrics = (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert '"tokens": ' in metrics and '"epoch"' not in metrics  # counted in tokens; a stream has no epochs
    assert whole.progress.tokens == 12 * accumulate * 8 * 32 and whole.progress.micro_batch == 12 * accumulate


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_duration=1ep", "trainer.max_duration=1ep"),
        ("trainer.val_interval=0.5ep", "trainer.val_interval=0.5ep"),
        ("checkpoint.interval=2ep", "checkpoint.interval=2ep"),
    ],
)
def test_epochs_are_refused_for_a_stream_naming_the_setting(compose_cfg: Callable, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key} counts epochs, but the training data is a stream.*\(st\)"):
        build(compose_cfg(*TINY_STREAM, override))


def test_more_shards_than_files_and_epoch_limits_are_clear_errors(compose_cfg: Callable, tmp_path: Path) -> None:
    small = [*TINY_STREAM, f"data.paths=[{tmp_path}/*.txt]", "data.val_every=0"]
    corpus(tmp_path, [100, 100])
    with pytest.raises(ConfigError, match=r"split 2 way\(s\).*1 rank\(s\) x 3 loader worker\(s\) need 3"):
        build(compose_cfg(*small, "data.num_workers=3"))
    with pytest.raises(ConfigError, match="a stream has none"):
        build(compose_cfg(*TINY_STREAM, "+data.limit_train_batches=2"))


def test_a_resume_with_other_loader_workers_or_other_files_is_refused(compose_cfg: Callable, tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    files = corpus(tmp_path / "text", [300] * 4)
    args = [*TINY_STREAM, f"data.paths=[{tmp_path}/text/*.txt]", "data.val_every=2", "data.num_workers=2"]
    train(compose_cfg(*args, run_dir=tmp_path / "run"), extra_callbacks=[StopAt(4)])
    with pytest.raises(CheckpointError, match=r"split over 1 rank\(s\) x 2 loader worker\(s\).*now 1 x 1"):
        train(compose_cfg(*args, "data.num_workers=1", "resume=auto", run_dir=tmp_path / "run"))
    files[0].write_bytes(b"x" * 301)
    with pytest.raises(CheckpointError, match="reads other data than the checkpoint's"):
        train(compose_cfg(*args, "resume=auto", run_dir=tmp_path / "run"))


class Counting(ShardedStream):
    """A finite stream of your own: the numbers below `n` of this shard, one pass, then the next pass from 0."""

    def __init__(self, n: int) -> None:
        self.n, self.next = n, 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]

    def __iter__(self):
        index, count = self.shard()
        while self.next < self.n:
            self.next += 1
            if (self.next - 1) % count == index:
                yield torch.tensor(self.next - 1)
        self.next = 0


def test_a_stream_of_your_own_that_ends_starts_its_next_pass_and_an_empty_one_is_an_error() -> None:
    loader = StreamingData(Counting(5), batch_size=2).train_loader()
    assert [b.tolist() for b, _ in zip(loader, range(5), strict=False)] == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    with pytest.raises(RuntimeError, match="the stream Counting yields no batch"):
        next(iter(StreamingData(Counting(0), batch_size=2).train_loader()))
