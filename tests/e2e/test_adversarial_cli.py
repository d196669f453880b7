"""A crafted run folder runs no code through the real commands: its config spells torch.load as a path under a trusted
package (`runner.data.torch.load`), with a pickle whose unpickling would write a marker file. Both readers of run
folders, `python -m runner.evaluate RUN` and `python -m runner +experiment=sae_digits source.checkpoint=RUN`, must
refuse it with exit 2 and one paragraph, and write nothing."""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import yaml
from helpers import cli, ok, python


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable]:
    """One job: a 3-step digits run, its config forged, then both commands on it."""

    def attack() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, Path]:
        source, marker = root / "source run", root / "pwned"
        ok(cli("+experiment=digits", "trainer.max_duration=3st", "logger=none", cwd=root, run_dir=source))
        torch.save(_Payload(marker), root / "evil.pt")  # what torch.load(weights_only=False) would run
        config = source / ".hydra" / "config.yaml"
        cfg = yaml.safe_load(config.read_text())
        cfg["model"] = {"_target_": "runner.data.torch.load", "f": str(root / "evil.pt"), "weights_only": False}
        config.write_text(yaml.safe_dump(cfg))
        evaluated = python("-m", "runner.evaluate", str(source), cwd=root)
        sae = cli("+experiment=sae_digits", f"source.checkpoint={source}", "logger=none", cwd=root, run_dir=root / "s")
        return evaluated, sae, marker

    return {"attack": attack}


def test_a_forged_run_folder_is_refused_by_evaluate_and_by_source_checkpoint(runs: dict[str, Future]) -> None:
    evaluated, sae, marker = runs["attack"].result()
    for proc in (evaluated, sae):
        assert proc.returncode == 2, proc.stderr
        assert "model._target_=runner.data.torch.load reaches the module `torch`" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not marker.exists()
