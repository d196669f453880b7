"""One CLI convention for every tool (runner/tools/cli.py): KEY=VALUE, with `--key VALUE`, `--key=VALUE` and dashed keys
read the same, so that a user who guesses either spelling is understood. Each tool is called both ways and must do
the same thing: the options it reads, or the files it writes."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import finished_run

from experiments.sae.evals import cli as sae_eval
from runner import ConfigError, finetune
from runner import sae_eval as sae_eval_command  # the documented command, the SAE workbench's registered tool
from runner.tools import evaluate, export, features, generate, report
from runner.tools import scaffold as init
from runner.train import train


def test_the_reading_tools_take_both_spellings_alike() -> None:
    same = [
        (
            features._options,
            ["RUN", "tokens=100", "out=pages", "top=4", "--serve", "port=9000"],
            ["RUN", "--tokens", "100", "--out=pages", "--top", "4", "--serve", "--port", "9000"],
        ),
        (
            sae_eval._options,
            ["SAE", "evals=[core]", "tokens=1000", "--limit", "source=hf:gpt2", "skip_positions=1"],
            ["SAE", "--evals", "[core]", "--tokens=1000", "--limit", "--source", "hf:gpt2", "--skip-positions", "1"],
        ),
        (
            generate._options,
            ["RUN", "max_new_tokens=5", "prompt=hello world", "seed=3"],
            ["RUN", "--max-new-tokens", "5", "--prompt", "hello world", "--seed=3"],
        ),
        (
            evaluate._arguments,
            ["RUN", "split=test", "data.batch_size=4", "device=cpu"],
            ["RUN", "--split", "test", "--data.batch_size=4", "--device", "cpu"],
        ),
    ]
    for parse, key_value, dashed in same:
        assert parse(dashed) == parse(key_value), parse.__module__
    with pytest.raises(ConfigError, match="--tokens needs a value: give --tokens VALUE, or tokens=VALUE"):
        features._options(["RUN", "--tokens"])
    with pytest.raises(ConfigError, match="'--colour=red': give KEY=VALUE with KEY one of tokens, out"):
        features._options(["RUN", "--colour=red"])  # an unknown key is refused with the keys, either spelling


def test_export_report_init_and_finetune_take_both_spellings_alike(
    compose_cfg: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sae = tmp_path / "sae"
    sae.mkdir()
    finished_run(sae, "+experiment=sae", "model.n_latents=64", "data.batch_size=64", "trainer.max_duration=2st",
                 "logger=none", "checkpoint=none")  # fmt: skip
    assert export.main([str(sae), "format=sparsify", f"out={tmp_path / 'a'}"]) == 0
    assert export.main([str(sae), "--format", "sparsify", "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "sae.safetensors").read_bytes() == (tmp_path / "b" / "sae.safetensors").read_bytes()

    train(compose_cfg("+experiment=digits", "trainer.max_duration=3st", "trainer.log_interval=1st", "logger=jsonl",
                      "checkpoint=none", "callbacks=none"))  # fmt: skip
    run = tmp_path / "run"
    assert report.main([str(run), f"out={tmp_path / 'r1'}", "no_plot=true", "top=1"]) == 0
    assert report.main([str(run), "--out", str(tmp_path / "r2"), "--no-plot", "--top", "1"]) == 0
    assert (tmp_path / "r1" / "results.csv").read_text() == (tmp_path / "r2" / "results.csv").read_text()
    assert not (tmp_path / "r1" / "plots").exists()

    assert init.main([str(tmp_path / "p1"), "name=mine"]) == 0
    assert init.main([str(tmp_path / "p2"), "--name", "mine"]) == 0
    assert sorted(p.name for p in (tmp_path / "p1").rglob("*")) == sorted(p.name for p in (tmp_path / "p2").rglob("*"))
    assert (tmp_path / "p1" / "mine").is_dir()

    merged = []
    monkeypatch.setattr(finetune, "merge", lambda run_dir, base: merged.append((run_dir, base)) or "merged")
    assert finetune.main(["merge", "RUN", "base=BASE"]) == finetune.main(["merge", "RUN", "--base", "BASE"]) == 0
    assert merged == [("RUN", "BASE"), ("RUN", "BASE")]


@pytest.mark.parametrize("tool", [features, sae_eval_command, evaluate, generate, export, report, finetune])
@pytest.mark.parametrize("asked", ["--help", "-h"])
def test_help_prints_the_tool_s_usage_and_exits_0(tool, asked: str, capsys) -> None:
    try:
        code = tool.main([asked])
    except SystemExit as exited:  # the argparse tools exit themselves
        code = exited.code
    out = capsys.readouterr()
    assert code == 0 and f"python -m runner.{tool.__name__.rsplit('.', 1)[1]}" in out.out, out
    assert "error" not in out.err


@pytest.mark.parametrize("tool", ["evaluate", "export", "features", "generate", "report", "sae_eval"])
def test_every_documented_python_m_command_still_runs_its_tool(tool: str, capsys, monkeypatch) -> None:
    # the tools live in runner.tools (the SAE workbench's in experiments.sae): `python -m runner.X` stays the command
    monkeypatch.setattr(sys, "argv", [f"runner/{tool}.py", "--help"])
    monkeypatch.delitem(sys.modules, f"runner.{tool}", raising=False)  # as a fresh `python -m` finds it
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"runner.{tool}", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0 and f"python -m runner.{tool}" in capsys.readouterr().out


def test_a_project_that_runner_init_wrote_still_imports_buildable() -> None:
    from runner.config.trust import buildable
    from runner.trust import buildable as old

    assert old is buildable
