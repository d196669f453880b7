"""compile=blocks for real under torchrun (2 processes, gloo): DDP, and FSDP2 with activation checkpointing, train
like one eager process; a model without the units is a one-paragraph error. The model is tests/_tasks.py TinyLM."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from helpers import assert_close_weights, cli, explain, ok, summary, torchrun

# 10 steps of 16 sequences (2 x 8 on two ranks), inside the first epoch (448 sequences), one validation at the end
LM = [
    "model._target_=_tasks.TinyLM",
    "data.splits._target_=_tasks.token_splits",
    "trainer.max_duration=10st",
    "trainer.val_interval=10st",
    "logger=[console,jsonl]",
    "callbacks=none",
    "checkpoint=none",
]
# the distributed tests' tolerance: the same gradients summed in another order (and here fused by inductor)
ATOL = 1e-5


def two_ranks(root: Path, name: str, *overrides: str) -> dict[str, Any]:
    done = ok(torchrun(*LM, "data.batch_size=8", *overrides, f"hydra.run.dir={root / name}", cwd=root))
    return {"stderr": done.stderr, "run_dir": root / name}


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*LM, *overrides, cwd=root, run_dir=root / name))
    return root / name


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    fsdp = ["distributed=fsdp", "distributed.units=[Block]", "compile=blocks", "activation_checkpointing=blocks"]
    return {
        "ddp": lambda: two_ranks(root, "ddp", "distributed=ddp", "compile=blocks"),
        "fsdp": lambda: two_ranks(root, "fsdp", *fsdp),
        "one": lambda: single(root, "one", "data.batch_size=16"),
        "no_blocks": lambda: cli("+experiment=digits", "compile=blocks", cwd=root, run_dir=root / "no_blocks"),
    }


def test_ddp_with_compiled_blocks_trains_like_one_eager_process(runs: dict[str, Future]) -> None:
    ddp, one = runs["ddp"].result(), runs["one"].result()
    assert "3 x Block (inductor, mode default)" in ddp["stderr"]  # the startup table's compile line
    assert_close_weights(ddp["run_dir"], one, atol=ATOL)
    assert summary(ddp["run_dir"])["compile_time_s"] > 0 and summary(one)["compile_time_s"] is None


def test_fsdp_with_checkpointed_and_compiled_blocks_trains_like_one_eager_process(runs: dict[str, Future]) -> None:
    fsdp, one = runs["fsdp"].result(), runs["one"].result()
    assert_close_weights(fsdp["run_dir"], one, atol=ATOL)


def test_compiling_blocks_of_a_model_without_any_is_a_one_paragraph_error(runs: dict[str, Future]) -> None:
    proc = runs["no_blocks"].result()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    assert "its classes are MLPClassifier, Sequential, Linear, ReLU, Dropout" in proc.stderr
