"""The command line's configuration errors, in-process: each is refused with a message that names the problem and the
way out, before any file is written. What a user sees of one (exit code 2, the message alone on stderr):
tests/e2e/test_cli.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra.errors import CompactHydraException

from runner import ConfigError
from runner.train import train

# id: (overrides, the error, fragments its message must contain). Hydra's composition errors are compact ones,
# which Hydra prints without a traceback (exit code 1); a ConfigError is printed by runner's CLI (exit code 2).
ERROR_CASES: dict[str, tuple[list[str], type[Exception], list[str]]] = {
    "unknown-experiment": (["+experiment=nope"], CompactHydraException, ["experiment/nope", "digits"]),
    "unknown-model": (["+experiment=digits", "model=nope"], CompactHydraException, ["model/nope", "mlp"]),
    "misspelled-key": (["+experiment=digits", "trainer.max_duraton=3ep"], CompactHydraException, ["max_duraton"]),
    "bad-duration": (
        ["+experiment=digits", "trainer.max_duration='3 epochs'"],
        ConfigError,
        ["3 epochs", "st (optimizer steps)", "ep (epochs)", "sa (samples)"],
    ),
    "too-short": (
        ["+experiment=digits", "trainer.max_duration=0.01ep"],
        ConfigError,
        ["shorter than one optimizer step"],
    ),
    "accumulate-too-large": (
        ["+experiment=digits", "trainer.accumulate_grad_batches=1000"],
        ConfigError,
        ["accumulate_grad_batches=1000", "does not fit", "45 micro-batches"],
    ),
    "plateau-on-train-metric": (
        ["+experiment=digits", "scheduler=plateau", "scheduler.monitor=train/loss"],
        ConfigError,
        ["'train/loss'", "val/"],
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_config_errors_are_refused_with_a_clear_message_before_any_file_is_written(
    case: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    overrides, kind, fragments = ERROR_CASES[case]
    with pytest.raises(kind) as caught:
        train(compose_cfg(*overrides))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert len(message.strip().splitlines()) <= 15, message
    assert not (tmp_path / "run").exists()  # train() refused before making the run folder
