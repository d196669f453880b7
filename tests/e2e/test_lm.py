"""The language model from the command line: one process, DDP and FSDP (units [Block]) with 2 gloo ranks training like
one process, samples written by rank 0 only, and a bad corpus refused with exit code 2."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    assert_close_weights,
    assert_same_weights,
    cli,
    explain,
    jsonl,
    metric_rows,
    ok,
    read_json,
    summary,
    torchrun,
    weights,
)

JSON_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
EMAIL_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "email" / "*.py")  # 20 files: 16 train, 4 validation
# 12 steps of 8 windows of 32 bytes: 2 ranks x 4 see the same windows as 1 x 8
# (runner.data.samplers.GlobalBatchSampler).
TINY = [
    "+experiment=lm",
    f"data.paths=[{JSON_PACKAGE}]",
    "data.val_every=2",
    "data.val_windows=32",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "trainer.max_duration=12st",
    "trainer.val_interval=6st",
    "trainer.log_interval=3st",
    "logger=[console,jsonl]",
    "checkpoint.interval=6st",
    "callbacks.text_samples.every=6st",
    "callbacks.text_samples.new_tokens=16",
]
# As in the DDP and FSDP tests: the same per-sample gradients summed in another order, float32 rounding amplified by
# AdamW where gradients are near zero; far below one step's change.
ATOL = 1e-4


def _run(root: Path, name: str, *overrides: str, ranks: int = 1) -> dict[str, Any]:
    args = [*TINY, f"data.cache_dir={root / 'cache'}", *overrides]
    if ranks == 1:
        done = ok(cli(*args, cwd=root, run_dir=root / name))
    else:
        done = ok(torchrun(*args, f"hydra.run.dir={root / name}", cwd=root))
    return {"stderr": done.stderr, "run_dir": root / name}


# data=text_stream over 2 ranks x 2 loader workers (4 shards of the 16 training files); stopped after step 5 (a test
# callback asks every rank, as a preemption would) and resumed, or run whole.
STREAM = [
    *TINY[:1],
    "data=text_stream",
    f"data.paths=[{EMAIL_PACKAGE}]",
    "data.val_every=5",
    "data.num_workers=2",
    "data.block=16",
    "data.batch_size=4",
    "data.val_windows=32",
    "distributed=ddp",
    *[a for a in TINY if a.startswith(("model.", "trainer."))],
    "trainer.stop_check_interval=1st",
    "logger=jsonl",
    "callbacks=none",
    "checkpoint.interval=1000st",
    "+callbacks.stop._target_=_tasks.StopAt",
]


def _stream(root: Path) -> dict[str, Any]:
    ok(torchrun(*STREAM, "+callbacks.stop.step=1000", f"hydra.run.dir={root / 'stream_whole'}", cwd=root))
    split = [*STREAM, "+callbacks.stop.step=5", f"hydra.run.dir={root / 'stream_split'}"]
    stopped = torchrun(*split, cwd=root)
    resumed = torchrun(*split, "resume=auto", cwd=root)
    return {"whole": root / "stream_whole", "split": root / "stream_split", "stopped": stopped, "resumed": resumed}


def _lora(root: Path, runs: dict[str, Future], name: str, *strategy: str) -> dict[str, Any]:
    # LoRA adapters on the GPT of the "one" run, 6 steps of 8 windows: in one process, or 2 ranks x 4 (DDP, FSDP)
    base = runs["one"].result()["run_dir"]
    ranks = 2 if strategy else 1
    lora = [f"init_from={base}", "finetune=lora", "trainer.max_duration=6st", f"data.batch_size={8 // ranks}"]
    return _run(root, name, *lora, *strategy, ranks=ranks)


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    return {
        "one": lambda: _run(root, "one", "data.batch_size=8"),
        "ddp": lambda: _run(root, "ddp", "data.batch_size=4", "distributed=ddp", ranks=2),
        "fsdp": lambda: _run(
            root, "fsdp", "data.batch_size=4", "distributed=fsdp", "distributed.units=[Block]", ranks=2
        ),
        "stream": lambda: _stream(root),
        "lora_one": lambda: _lora(root, runs, "lora_one"),
        "lora_ddp": lambda: _lora(root, runs, "lora_ddp", "distributed=ddp"),
        "lora_fsdp": lambda: _lora(root, runs, "lora_fsdp", "distributed=fsdp", "distributed.units=[Block]"),
        "bad_glob": lambda: cli(*TINY, "data.paths=[/no/such/*.txt]", cwd=root, run_dir=root / "bad_glob"),
    }


def test_lm_from_the_command_line_writes_its_files(runs: dict[str, Future]) -> None:
    one = runs["one"].result()
    run_dir = one["run_dir"]
    done = summary(run_dir)
    assert done["stop_reason"] == "max_duration" and done["progress"]["tokens"] == 12 * 8 * 32
    corpus = read_json(run_dir / "run.json")["data"]["corpus"]
    assert corpus["files"] == 5 and len(corpus["sha256"]) == 64
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step-12.txt", "step-6.txt"]
    rows = jsonl(run_dir)
    assert all(r["train/tokens_per_s"] > 0 for r in rows if "train/loss" in r)
    assert {"val/loss", "val/bits_per_byte", "val/ppl"} <= set(rows[-1])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_the_lm_like_one_process(strategy: str, runs: dict[str, Future]) -> None:
    one, two = runs["one"].result(), runs[strategy].result()
    assert_close_weights(two["run_dir"], one["run_dir"], atol=ATOL)
    rows = [metric_rows(r["run_dir"]) for r in (two, one)]
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in rows[1]]  # global token counts, exact
    val = [[r["val/loss"] for r in run if "val/loss" in r] for run in rows]
    assert val[0] == pytest.approx(val[1], abs=1e-4)
    # every rank sampled (FSDP's forward is a collective: a rank that did not would hang the others); rank 0 wrote
    assert (two["run_dir"] / "samples" / "step-12.txt").read_text().count("=== sample") == 4
    assert two["stderr"].count("global batch") == 1


def test_a_glob_that_matches_nothing_is_exit_code_2_and_one_paragraph(runs: dict[str, Future]) -> None:
    proc = runs["bad_glob"].result()
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: data.paths: '/no/such/*.txt' matches no file"), explain(proc)
    assert "Traceback" not in proc.stderr


def test_a_stream_over_two_ranks_of_two_loader_workers_resumes_exactly(runs: dict[str, Future]) -> None:
    outcome = runs["stream"].result()
    stopped, resumed = outcome["stopped"], outcome["resumed"]
    assert "exitcode  : 75" in stopped.stderr, explain(stopped)  # preempted after step 5, with a checkpoint
    assert resumed.returncode == 0, explain(resumed)
    assert summary(outcome["split"])["progress"] == summary(outcome["whole"])["progress"]
    assert_same_weights(outcome["split"], outcome["whole"])
    assert metric_rows(outcome["split"]) == metric_rows(outcome["whole"])  # losses, tokens, validations
    assert "epoch" not in metric_rows(outcome["whole"])[-1]  # a stream has no epochs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_on_two_ranks_trains_the_adapters_like_one_process_and_rank_0_alone_speaks(
    strategy: str, runs: dict[str, Future]
) -> None:
    one, two = runs["lora_one"].result(), runs[f"lora_{strategy}"].result()
    assert_close_weights(two["run_dir"], one["run_dir"], atol=ATOL)
    assert all("lora_" in key for key in weights(two["run_dir"]))  # the adapters only (FSDP: gathered by rank 0)
    assert two["stderr"].count("init_from: loaded") == 1  # rank 0's line; rank 1 loaded the same quietly
