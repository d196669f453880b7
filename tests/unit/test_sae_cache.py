"""data=activations_lm_cached data.cache=DIR: a hooked module's activations written once (shards, then a manifest),
reused memory-mapped; refused when made from something else; an interrupted write is never read; resume on cached
data is exact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_LM, assert_resume_is_exact
from safetensors.torch import load_file

from experiments.sae.sources import cache as cache_module
from experiments.sae.sources.source import SourceModel
from runner import ConfigError
from runner.build import build
from runner.ckpt.weights import save_weights
from runner.loop import fit

# 2,500 rows in shards of 1,000: three shards, the last one short
CACHED = [
    "source.layer=1",
    "model.n_latents=64",
    "model.k=4",
    "data.batch_size=128",
    "data.cache_rows=2500",
    "data.cache_shard_rows=1000",
    "trainer.max_duration=8st",
    "trainer.val_interval=4st",
    "trainer.log_interval=2st",
    "logger=none",
    "callbacks=none",
]


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of activations the source models computed (every SourceModel.activations call appends its rows)."""
    calls: list[int] = []
    original = SourceModel.activations

    def counted(self: SourceModel, batch: object) -> torch.Tensor:
        out = original(self, batch)
        calls.append(len(out))
        return out

    monkeypatch.setattr(SourceModel, "activations", counted)
    return calls


def _sae(lm_run: Path, acts: Path, *more: str) -> list[str]:
    return [
        "+experiment=sae_lm",
        f"source.checkpoint={lm_run}",
        "data=activations_lm_cached",
        f"data.cache={acts}",
        *CACHED,
        *more,
    ]


def test_the_cache_is_written_once_and_reused_without_the_source_s_forward(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path, forwards: list[int]
) -> None:
    acts = tmp_path / "acts"
    first = build(compose_cfg(*_sae(lm_run, acts)))
    val_rows = len(first.val_loader.dataset)
    assert sum(forwards) >= val_rows + 2500  # the validation split, then the cache's rows
    manifest = json.loads((acts / "manifest.json").read_text())
    assert manifest["module"] == "blocks.1" and manifest["skip_positions"] == 1 and manifest["d"] == 32
    assert [s["rows"] for s in manifest["shards"]] == [1000, 1000, 500] and manifest["rows"] == 2500
    assert sorted(p.name for p in acts.glob("shard-*")) == [s["file"] for s in manifest["shards"]]
    forwards.clear()
    second = fit(build(compose_cfg(*_sae(lm_run, acts))))
    assert sum(forwards) == val_rows  # the validation split only: training read the cache
    assert second.progress.step == 8 and len(second.train_loader.dataset) == 2500
    # the cache holds the source's stream itself: its training inputs in order, every position from the second on
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    loader, stream = source.data.train_loader(), []
    loader.batch_sampler.set_epoch(0)
    for batch in loader:
        stream.append(source.activations(batch))
        if sum(map(len, stream)) >= 2500:
            break
    (rows,) = second.train_loader.dataset.__getitems__(list(range(2500)))
    assert torch.equal(rows, torch.cat(stream)[:2500])


def test_a_cache_from_another_hook_point_checkpoint_or_dtype_is_refused(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path
) -> None:
    acts = tmp_path / "acts"
    build(compose_cfg(*_sae(lm_run, acts)))
    with pytest.raises(ConfigError, match=rf"written from blocks.1 of run {lm_run}.*module='blocks.0'.*another"):
        build(compose_cfg(*_sae(lm_run, acts), "source.layer=0"))
    other = tmp_path / "other_lm"
    shutil.copytree(lm_run, other)
    weights = load_file(str(other / "model.safetensors"))
    weights[next(iter(weights))] += 1e-3
    save_weights(weights, other / "model.safetensors")  # other weights, as another run writes them (with their record)
    with pytest.raises(ConfigError, match=r"weights_sha256="):
        build(compose_cfg(*_sae(other, acts)))
    with pytest.raises(ConfigError, match=r"dtype='float32'.*dtype='float16'"):
        build(compose_cfg(*_sae(lm_run, acts), "data.cache_dtype=float16"))
    with pytest.raises(ConfigError, match=r"holds 2500 rows; this run asks for 3000"):
        build(compose_cfg(*_sae(lm_run, acts), "data.cache_rows=3000"))
    assert len(build(compose_cfg(*_sae(lm_run, acts), "data.cache_rows=2000")).train_loader.dataset) == 2000
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"data.cache=.*afile is a file: give a folder"):
        build(compose_cfg(*_sae(lm_run, tmp_path / "afile")))
    for key in ("cache_rows", "cache_shard_rows"):  # 0 rows: a traceback, or (cache_rows) read as the default
        with pytest.raises(ConfigError, match=rf"data.{key} must be a whole number >= 1, got 0"):
            build(compose_cfg(*_sae(lm_run, acts), f"data.{key}=0"))


def test_an_interrupted_write_is_never_read_and_gets_rewritten(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acts = tmp_path / "acts"
    with monkeypatch.context() as killed:  # killed between the last shard and the manifest
        killed.setattr(cache_module, "fsync_dir", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            build(compose_cfg(*_sae(lm_run, acts)))
    assert len(list(acts.glob("shard-*.npy"))) == 3 and not (acts / "manifest.json").exists()
    (acts / ".shard-00001.npy.4242.tmp").write_bytes(b"half a shard")  # a shard cut off mid-write
    key = cache_module.identity(str(lm_run), "blocks.1", 1, "float32", 32)
    assert cache_module.read(acts, key, 2500) is None  # no manifest: nothing a reader accepts
    run = build(compose_cfg(*_sae(lm_run, acts)))
    assert (acts / "manifest.json").exists() and not list(acts.glob(".shard-*"))
    reference = run.train_loader.dataset.__getitems__(list(range(2500)))[0]
    # a shard damaged after the manifest was written: refused, and the cache is written again
    shard = acts / "shard-00002.npy"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert cache_module.read(acts, key, 2500) is None
    again = build(compose_cfg(*_sae(lm_run, acts)))
    assert torch.equal(again.train_loader.dataset.__getitems__(list(range(2500)))[0], reference)


def test_a_waiting_rank_reads_the_cache_or_gives_up_without_a_writer(
    lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    key = cache_module.identity(str(lm_run), "blocks.1", 1, "float16", 32)
    monkeypatch.setattr(cache_module, "_rank", lambda: 1)
    monkeypatch.setattr(cache_module, "WAIT_S", 0.5)
    with pytest.raises(ConfigError, match=r"rank 1 waited 0 s for rank 0.*every rank sees"):
        cache_module.cached(tmp_path / "nobody", source, key, 100)
    cache_module.write(tmp_path / "acts", key, source, 100)  # rank 0's work
    rows = cache_module.cached(tmp_path / "acts", source, key, 100)
    assert len(rows) == 100 and np.load(tmp_path / "acts" / "shard-00000.npy").dtype == np.float16


def test_resume_on_cached_activations_is_exact(compose_cfg: Callable, lm_run: Path, tmp_path: Path) -> None:
    acts = tmp_path / "acts"
    overrides = [*_sae(lm_run, acts), "logger=jsonl", "checkpoint.interval=1000st"]
    assert assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=3)[1].progress.step == 8


def test_an_interrupted_write_is_continued_from_its_last_whole_shard(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forwards: list[int]
) -> None:
    whole = build(compose_cfg(*_sae(lm_run, tmp_path / "whole"))).train_loader.dataset.__getitems__(list(range(2500)))
    acts, written = tmp_path / "acts", []
    original = cache_module.write_atomic

    def dies_after_two_shards(path: Path, data: bytes, fsync: bool = False) -> None:
        if path.name.startswith("shard-"):
            written.append(path.name)
            if len(written) == 3:
                raise KeyboardInterrupt  # killed while writing the third shard
        original(path, data, fsync=fsync)

    with monkeypatch.context() as killed:
        killed.setattr(cache_module, "write_atomic", dies_after_two_shards)
        with pytest.raises(KeyboardInterrupt):
            build(compose_cfg(*_sae(lm_run, acts)))
    partial = json.loads((acts / ".partial.json").read_text())
    assert [s["file"] for s in partial["shards"]] == ["shard-00000.npy", "shard-00001.npy"]
    forwards.clear()
    again = build(compose_cfg(*_sae(lm_run, acts))).train_loader.dataset.__getitems__(list(range(2500)))
    continued = sum(forwards)
    assert torch.equal(again[0], whole[0])  # the same rows as a write in one go
    assert (acts / "manifest.json").exists() and not (acts / ".partial.json").exists()
    forwards.clear()
    build(compose_cfg(*_sae(lm_run, acts)))  # complete: only the validation activations are computed
    # only the last shard's inputs went through the source again (an input batch is 8 windows x 31 positions)
    assert 500 <= continued - sum(forwards) < 500 + 2 * 248, (continued, forwards)
    # another cache's progress is not continued: another hook point starts afresh
    (acts / "manifest.json").unlink()
    (acts / ".partial.json").write_text(json.dumps({**partial, "module": "blocks.0"}))
    forwards.clear()
    build(compose_cfg(*_sae(lm_run, acts)))
    assert sum(forwards) >= 2500


def test_a_source_trained_on_a_stream_writes_its_cache_from_that_stream(
    compose_cfg: Callable, tmp_path: Path, trained_once: Callable
) -> None:
    source = tmp_path / "stream_lm"
    source.mkdir()
    trained_once(source, *TINY_LM, "data=text_stream", "data.block=4")  # test_sae_lm's stream_lm_run: trained once
    run = build(compose_cfg(*_sae(source, tmp_path / "acts")))
    assert len(run.train_loader.dataset) == 2500 and (tmp_path / "acts" / "manifest.json").exists()


def test_the_source_s_identity_hashes_its_weight_files_end_to_end(tmp_path: Path) -> None:
    # a file longer than the hash's read buffer (1 MiB), its last chunk a short one, then a second file
    parts = [os.urandom((5 << 19) + 3), b"the tokenizer's text"]
    files = [tmp_path / "model-1.safetensors", tmp_path / "tokenizer.json"]
    for file, data in zip(files, parts, strict=True):
        file.write_bytes(data)
    key = cache_module.identity(str(tmp_path), "h.0", 0, "float32", 8, weights=files)
    assert key["weights_sha256"] == hashlib.sha256(b"".join(parts)).hexdigest()
