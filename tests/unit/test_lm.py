"""The language model (experiments/lm): the transformer, its token data, its callbacks, and a run of it in-process."""

from __future__ import annotations

import math
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import StopAt, assert_resume_is_exact, assert_same_state, metric_rows, read_json, read_run

from experiments.lm.corpus import held_out_files, no_val_split
from experiments.lm.data import TextBytes, TokensFile, Windows, stdlib_sources
from experiments.lm.model import GPT, Block
from runner import ConfigError
from runner.data.samplers import GlobalBatchSampler
from runner.train import train

JSON_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")  # 5 real files, ~50 kB
TINY = [
    "+experiment=lm",
    f"data.paths=[{JSON_PACKAGE}]",
    "data.val_every=2",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "trainer.log_interval=2st",
    "logger=jsonl",
    "checkpoint.interval=1000st",
]
SAMPLES = ["callbacks.text_samples.new_tokens=8", "callbacks.text_samples.n=2"]
# TINY on a corpus of its own (data.paths), with the lm experiment's default checkpoint (best by val/loss), 2 steps
SMALL_CORPUS = [*(a for a in TINY if not a.startswith(("data.", "checkpoint."))), "callbacks=none"]
SMALL_CORPUS += ["trainer.max_duration=2st", "trainer.val_interval=2st", "model.seq_len=16"]


def tiny_gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32, **kwargs})


def test_the_model_is_causal_tied_and_counts_its_flops() -> None:
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])  # no look-ahead
    assert model.head.weight is model.embed.weight
    assert len([m for m in model.modules() if isinstance(m, Block)]) == 2
    # 6 x (blocks' matrices + head) + 12 x layers x d_model x seq_len
    block = 4 * 32 * 32 + 3 * 32 * 128  # attention qkv+out; SwiGLU hidden 8/3 x 32 rounded up to 64 -> 128
    assert model.flops_per_token() == 6 * (2 * block + 256 * 32) + 12 * 2 * 32 * 16
    # the projections into the residual stream start smaller: std 0.02 / sqrt(2 n_layer)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    assert model.blocks[0].mlp.gate_up.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_model_gpt2_small_is_gpt2_small_s_shape(compose_cfg: Callable) -> None:
    from hydra.utils import instantiate

    cfg = compose_cfg("+experiment=lm", "model=gpt2_small")
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.seq_len) == (12, 768, 12, 1024)
    with torch.device("meta"):  # the shape alone: no 85M parameters made
        model = instantiate({k: v for k, v in cfg.model.items() if k != "bytes_per_token"})
    blocks = sum(p.numel() for p in model.blocks.parameters())
    assert 84e6 < blocks < 86e6  # GPT-2 small's 85M in its blocks (SwiGLU at 8/3 x d keeps the MLP's size)


def test_validation_gives_nats_bits_and_bits_per_byte() -> None:
    batch = {"tokens": torch.randint(0, 256, (3, 17)), "num_tokens": 48}
    out = tiny_gpt(bytes_per_token=1.0).validation_step(batch)
    assert out["bits_per_token"].item() == pytest.approx(out["loss"].item() / math.log(2))
    assert out["bits_per_byte"].item() == pytest.approx(out["bits_per_token"].item())
    assert out["loss"].item() == pytest.approx(math.log(256), rel=0.05)  # a fresh model is near uniform
    assert "bits_per_byte" not in tiny_gpt().validation_step(batch)  # a tokenizer's bytes per token is not known


def test_n_head_that_does_not_divide_d_model_is_refused_with_a_fix() -> None:
    with pytest.raises(ConfigError, match=r"model.d_model=100 must be a multiple of model.n_head=3.*model.n_head=2"):
        GPT(d_model=100, n_head=3)


def test_windows_carry_their_token_count_and_resume_exactly() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    windows = Windows(tokens, seq_len=10)
    assert len(windows) == 99
    batch = windows.__getitems__([0, 5])
    assert batch["num_tokens"] == 20 and batch["tokens"].dtype == torch.int64
    assert batch["tokens"][1].tolist() == list(range(50, 61))  # seq_len + 1: inputs and their next tokens
    assert len(Windows(tokens, 10, limit=7)) == 7
    # the seeded order: a sampler restarted mid-epoch yields what the uninterrupted one would have yielded next
    whole = list(GlobalBatchSampler(len(windows), 4, seed=3))
    resumed = GlobalBatchSampler(len(windows), 4, seed=3)
    resumed.set_epoch(0, skip=5)
    assert list(resumed) == whole[5:]


def test_text_bytes_encodes_once_into_a_cache_keyed_by_content(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}: " + "hello world " * 50)
    data = TextBytes(seq_len=16, paths=[str(tmp_path / "*.txt")], val_every=2, batch_size=4)
    corpus = data.info["corpus"]
    assert corpus["files"] == 4 and corpus["val_files"] == 2 and corpus["bytes"] == 4 * (8 + 12 * 50)
    assert corpus["train_bytes"] == 2 * (8 + 12 * 50) + 1  # two files, one NUL between them
    cache = Path(corpus["cache"])
    stamp = (cache / "train.u8").stat().st_mtime_ns
    again = TextBytes(seq_len=16, paths=[str(tmp_path / "*.txt")], val_every=2, batch_size=4)
    assert again.info["corpus"]["cache"] == str(cache) and (cache / "train.u8").stat().st_mtime_ns == stamp
    (tmp_path / "f0.txt").write_text("changed " * 100)
    changed = TextBytes(seq_len=16, paths=[str(tmp_path / "*.txt")], val_every=2, batch_size=4)
    assert changed.info["corpus"]["sha256"] != corpus["sha256"]
    batch = next(iter(data.train_loader()))
    assert batch["tokens"].shape == (4, 17) and batch["num_tokens"] == 64 and data.tokens_per_sample == 16


def test_the_default_corpus_is_the_standard_library_without_tests() -> None:
    files = stdlib_sources()
    assert len(files) > 300 and files == sorted(files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    assert sum(f.stat().st_size for f in files) > 5e6


@pytest.mark.parametrize(
    ("setup", "fragment"),
    [
        ("glob", "matches no file"),
        ("binary", "holds NUL bytes, a binary file"),
        ("latin-1", "is not UTF-8 text"),
        ("short", "fewer than one window of model.seq_len + 1 = 65"),
    ],
)
def test_bad_text_is_refused_with_what_to_do(setup: str, fragment: str, tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_bytes({"binary": b"ab\0cd" * 100, "latin-1": "caf\xe9".encode("latin-1") * 100}.get(setup, b"x" * 40))
    paths = [str(tmp_path / "nothing*.txt")] if setup == "glob" else [str(path)]
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TextBytes(seq_len=64, paths=paths, val_every=0, batch_size=2)


def test_tokens_files_bin_and_npy_and_their_errors(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 300, 5000)
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "val.npy", ids[:500].astype(np.int32))
    data = TokensFile(str(tmp_path / "train.bin"), 32, 300, val_path=str(tmp_path / "val.npy"), batch_size=2)
    assert data.splits["train"].tokens[:5].tolist() == ids[:5].tolist() and len(data.splits["val"]) == 15
    with pytest.raises(ConfigError, match=r"token \d+ is \d+, outside model.vocab_size=256"):
        TokensFile(str(tmp_path / "train.bin"), 32, 256, batch_size=2)
    with pytest.raises(ConfigError, match="fewer than one window"):
        TokensFile(str(tmp_path / "val.npy"), 1000, 300, batch_size=2)
    with pytest.raises(ConfigError, match="does not exist"):
        TokensFile(str(tmp_path / "nope.bin"), 32, 300, batch_size=2)


def test_lm_trains_and_writes_samples_without_touching_the_training_rng(compose_cfg: Callable, tmp_path: Path) -> None:
    # Sampling every 4 steps or never: the same training, bit for bit.
    overrides = [*TINY, "trainer.max_duration=12st", "trainer.val_interval=6st"]
    sampled = train(compose_cfg(*overrides, *SAMPLES, "callbacks.text_samples.every=4st", run_dir=tmp_path / "sampled"))
    plain = train(compose_cfg(*overrides, "callbacks=[perplexity]", run_dir=tmp_path / "plain"))
    assert_same_state(sampled, plain)
    rows = metric_rows(tmp_path / "sampled")
    assert rows == metric_rows(tmp_path / "plain")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert rows[-1]["tokens"] == 12 * 8 * 32  # steps x batch x seq_len: the token counter is exact
    last = [r for r in rows if "val/loss" in r][-1]
    assert last["val/ppl"] == pytest.approx(math.exp(last["val/loss"]))
    assert last["val/bits_per_byte"] == pytest.approx(last["val/loss"] / math.log(2))
    samples = sorted((tmp_path / "sampled" / "samples").iterdir())
    assert [p.name for p in samples] == ["step-12.txt", "step-4.txt", "step-8.txt"]
    text = samples[0].read_text()
    assert text.count("=== sample") == 2 and "|" in text
    assert read_json(tmp_path / "sampled" / "run.json")["data"]["corpus"]["files"] == 5


def test_lm_resumed_with_samples_equals_the_uninterrupted_run(compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*TINY, *SAMPLES, "trainer.max_duration=10st", "trainer.val_interval=5st"]
    overrides.append("callbacks.text_samples.every=3st")
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"))
    train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(4)])
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"))
    assert_same_state(whole, second)
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")
    for step in (6, 9):  # sampled after the resume: the same text as the uninterrupted run's
        name = f"samples/step-{step}.txt"
        assert (tmp_path / "split" / name).read_text() == (tmp_path / "whole" / name).read_text()


def test_a_compiled_lm_run_resumes_exactly(compose_cfg: Callable, tmp_path: Path) -> None:
    # Both launches compile afresh (compile=blocks; compile=model resumes alike, measured, 8 s more to test); the
    # resumed one must still continue bit for bit
    overrides = [*TINY, "callbacks=[perplexity]", "trainer.max_duration=8st", "trainer.val_interval=4st"]
    assert_resume_is_exact(compose_cfg, [*overrides, "compile=blocks"], tmp_path, stop=3)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["data.paths=[/no/such/folder/*.txt]"], "'/no/such/folder/*.txt' matches no file"),
        (["model.seq_len=100000"], "fewer than one window of model.seq_len + 1 = 100001"),
        (["model.n_head=3"], "model.d_model=32 must be a multiple of model.n_head=3"),
        (["+experiment=lm", "data=tokens_file"], "data.train_path"),
    ],
    ids=["glob", "seq_len", "n_head", "no-tokens-file"],
)
def test_lm_config_errors_come_before_the_run_folder(
    overrides: list[str], fragment: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
        train(compose_cfg(*(overrides if overrides[0] == "+experiment=lm" else [*TINY, *overrides])))
    assert len(str(caught.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_without_a_validation_split_the_lm_trains_with_no_best(compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = ["data.val_every=0", "callbacks=none", "checkpoint.monitor=null", "trainer.max_duration=2st"]
    run = train(compose_cfg(*TINY, *overrides))
    assert run.val_loader is None and run.progress.step == 2
    assert read_json(tmp_path / "run" / "summary.json")["best"] is None


def test_a_corpus_of_fewer_than_val_every_files_holds_its_last_one_out() -> None:
    assert held_out_files(1, 20) == [False]  # one file: nothing to split
    assert held_out_files(2, 20) == [False, True]
    assert held_out_files(5, 20) == [False] * 4 + [True]
    assert [i for i, held in enumerate(held_out_files(45, 20)) if held] == [19, 39]  # every 20th as before
    assert held_out_files(20, 20) == [False] * 19 + [True]
    assert not any(held_out_files(5, 0))  # 0: no validation split, whatever the size
    assert no_val_split(5, 20) is None


@pytest.mark.parametrize(
    ("files", "val_every", "fragments"),
    [
        (1, 20, ["data.paths names 1 file", "add a second file to data.paths"]),
        (5, 0, ["data.val_every=0 holds out none of the 5 files", "data.val_every=N holds out every N-th file"]),
    ],
)
def test_a_run_that_never_validates_names_the_settings_that_fix_it(
    files: int, val_every: int, fragments: list[str], compose_cfg: Callable, tmp_path: Path
) -> None:
    # the README's LoRA example on a few notes, asked to keep the best checkpoint by val/loss
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(files):
        (folder / f"{i}.md").write_text(f"note {i}: " + "some text to learn from " * 20)
    overrides = [*SMALL_CORPUS, f"data.paths=[{folder}/*.md]", f"data.val_every={val_every}"]
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg(*overrides, "checkpoint.keep_best=1"))
    message = str(caught.value)
    assert message.startswith("Checkpoint monitors 'val/loss', but this run never validates: "), message
    for fragment in [*fragments, "Or do without it: checkpoint.keep_best=0"]:
        assert fragment in message, message
    run = train(compose_cfg(*overrides))  # the way out it names: the default, no best checkpoint kept apart
    assert run.progress.step == 2 and run.val_loader is None
    if files > 1:
        run = train(compose_cfg(*overrides[:-1], "data.val_every=20", run_dir=tmp_path / "validated"))
        assert run.settings.data_info["corpus"]["val_files"] == 1 and "val/loss" in run.state.metrics


def test_samples_go_to_wandb_as_a_table_when_it_is_on(offline: None, compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*TINY, *SAMPLES, "trainer.max_duration=4st", "trainer.val_interval=4st", "logger=[jsonl,wandb]"]
    train(compose_cfg(*overrides, "callbacks.text_samples.every=2st"))
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    history = read_run(folder)["history"]
    tables = {step: row for step, row in history.items() if "text_samples/_type" in row}  # wandb nests its keys
    assert sorted(tables) == [2, 4]
    assert all(t["text_samples/_type"] == "table-file" and t["text_samples/nrows"] == 2 for t in tables.values())


def test_a_resume_may_change_how_samples_are_written(compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*TINY, *SAMPLES, "trainer.max_duration=4st", "trainer.val_interval=4st"]
    train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(2)])
    changed = [*overrides, "callbacks.text_samples.new_tokens=3", "callbacks=[text_samples]", "resume=auto"]
    resumed = train(compose_cfg(*changed, run_dir=tmp_path / "split"))  # not refused: training is the same
    assert resumed.progress.step == 4 and resumed.stop_reason == "max_duration"
