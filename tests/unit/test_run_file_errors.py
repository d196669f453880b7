"""A run folder's files that a tool cannot use (runner.finetune merge, runner.tools.report): exit 2 and one paragraph
naming the file and what to give instead, or for a report the job shown `unreadable` with the reason; never a
traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import refused
from safetensors.torch import load_file, save_file

from runner import finetune
from runner.sweeps.results import collect
from runner.tools import report

# ---- python -m runner.finetune merge ------------------------------------------------------------------------------
LORA_CONFIG = """\
model: {_target_: experiments.lm.GPT}
finetune:
  _target_: runner.finetune.Lora
  base: BASE
  rank: 2
  alpha: 4
init_from: INIT
run_dir: ${hydra:runtime.output_dir}
"""
W, A, B = torch.randn(4, 3), torch.randn(2, 3), torch.randn(4, 2)


def lora_run(folder: Path, base: str = "${init_from}", init: str = "", text: str | None = None) -> Path:
    """A finetune=lora run folder of one adapted layer `fc` (rank 2, alpha 4), its base weights at folder/base."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / "base").mkdir()
    save_file({"fc.weight": W, "fc.bias": torch.zeros(4)}, str(folder / "base" / "model.safetensors"))
    save_file({"fc.lora_A.default.weight": A, "fc.lora_B.default.weight": B}, str(folder / "model.safetensors"))
    config = (LORA_CONFIG if text is None else text).replace("BASE", base)
    (folder / ".hydra" / "config.yaml").write_text(config.replace("INIT", init or str(folder / "base")))
    return folder


def test_merge_folds_w_plus_alpha_over_rank_b_a_and_resolves_the_run_s_own_folder(tmp_path: Path, capsys) -> None:
    for run, base in (("plain", "${init_from}"), ("here", "${run_dir}/base")):
        assert finetune.main(["merge", str(lora_run(tmp_path / run, base=base))]) == 0
        merged = load_file(str(tmp_path / run / "model.merged.safetensors"))
        torch.testing.assert_close(merged["fc.weight"], W + 2.0 * B @ A)
    refused(
        finetune.main,
        ["merge", str(lora_run(tmp_path / "env", base="${oc.env:NO_SUCH_BASE_X}"))],
        capsys,
        "finetune.base=\\$\\{oc.env:NO_SUCH_BASE_X\\} in .* cannot be resolved outside the run .* --base PATH",
    )
    assert finetune.main(["merge", str(tmp_path / "env"), "--base", str(tmp_path / "env" / "base")]) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base": "${hydra:runtime.output_dir}/base"}, "finetune.base=\\$\\{hydra:runtime.output_dir\\}/base .*--base"),
        (
            {"init": "relative/base"},
            "the base \\(finetune.base\\) in .*: cannot read weights from relative/base.*--base",
        ),
        ({"text": LORA_CONFIG.replace("rank: 2", "rank: 0")}, "finetune.rank in .* must be a whole number >= 1, got 0"),
        (
            {"text": LORA_CONFIG.replace("rank: 2", "rank: 4")},
            "finetune.rank=4 in .*, but the adapters .* rank \\[2\\]",
        ),
        ({"text": LORA_CONFIG.replace("alpha: 4", "alpha: x")}, "finetune.alpha in .* must be a number, got 'x'"),
        ({"text": LORA_CONFIG.replace("INIT", "null")}, "names no base \\(finetune.base, init_from\\): give it with"),
        ({"text": LORA_CONFIG.replace("runner.finetune.Lora", "x.Y")}, "is not a finetune=lora run"),
        ({"text": "- a list\n"}, "config.yaml holds a list, not a config mapping"),
        ({"text": "a: [\n"}, "config.yaml is not a readable YAML config"),
    ],
)
def test_merge_refuses_a_config_it_cannot_use(tmp_path: Path, capsys, change: dict, message: str) -> None:
    refused(finetune.main, ["merge", str(lora_run(tmp_path / "run", **change))], capsys, message)
    assert not (tmp_path / "run" / "model.merged.safetensors").exists()


def test_merge_runs_no_resolver_that_writes(tmp_path: Path, capsys) -> None:
    from runner.config import resolvers

    resolvers.register()  # as in any process that composed a config: runner_fresh makes the folder it names
    made = tmp_path / "made by the config"
    run = lora_run(tmp_path / "fresh", base=f"${{runner_fresh:{made}}}")
    refused(
        finetune.main,
        ["merge", str(run)],
        capsys,
        r"calls resolvers that do more than read: runner_fresh \(at base\); give the base with",
    )
    assert not made.exists()


def test_merge_refuses_a_missing_folder_a_file_and_bytes_that_are_not_utf8(tmp_path: Path, capsys) -> None:
    refused(finetune.main, ["merge", str(tmp_path / "nowhere")], capsys, "nowhere does not exist: give the folder")
    (tmp_path / "file").write_text("x")
    refused(finetune.main, ["merge", str(tmp_path / "file")], capsys, "file is a file: give the folder of a finetune")
    refused(finetune.main, ["merge", str(tmp_path)], capsys, "has no .hydra/config.yaml: give the folder")
    run = lora_run(tmp_path / "run")
    (run / ".hydra" / "config.yaml").write_bytes(b"finetune: \xff\xfe\n")
    refused(finetune.main, ["merge", str(run)], capsys, "config.yaml is not a readable YAML config \\('utf-8' codec")


def test_merge_refuses_a_base_of_another_architecture_naming_what_does_not_fit(tmp_path: Path, capsys) -> None:
    run = lora_run(tmp_path / "run")
    other = tmp_path / "other.safetensors"
    save_file({"fc.weight": torch.randn(5, 3)}, str(other))
    refused(
        finetune.main,
        ["merge", str(run), "--base", str(other)],
        capsys,
        "do not fit the base: fc.weight \\(5, 3\\) vs B @ A \\(4, 2\\) @ \\(2, 3\\).*Is .* the model it fine-tuned",
    )
    save_file({"head.weight": torch.randn(4, 3)}, str(other))
    refused(finetune.main, ["merge", str(run), "--base", str(other)], capsys, "do not fit the base: fc.weight missing")
    assert not (run / "model.merged.safetensors").exists()


# ---- python -m runner.report --------------------------------------------------------------------------------------
SUMMARY = '{"stop_reason": "completed", "best": {"value": 0.5, "step": 10}, "progress": {"step": 10}}'


def job(
    sweep: Path, name: str, summary: bytes | None = None, config: bytes = b"monitor: val/loss\nmode: min\n"
) -> Path:
    """A job folder of a sweep with the given summary.json and .hydra/config.yaml bytes."""
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_bytes(config)
    if summary is not None:
        (folder / "summary.json").write_bytes(summary)
    return folder


def test_report_shows_a_job_with_unreadable_files_as_unreadable_with_the_reason(tmp_path: Path, capsys) -> None:
    sweep = tmp_path / "sweep"
    job(sweep, "0", SUMMARY.encode())
    reasons = {
        "1": ("summary.json holds a list, not a mapping", {"summary": b"[1, 2]"}),
        "2": ("summary.json holds a number, not a mapping", {"summary": b"3.5"}),
        "3": ("summary.json is not UTF-8 text", {"summary": b"\x00\xff garbage"}),
        "4": ("summary.json is not valid JSON", {"summary": b"{not json"}),
        "5": (".hydra/config.yaml holds a list, not a mapping", {"config": b"- a\n- b\n"}),
        "6": (".hydra/config.yaml is not UTF-8 text", {"config": b"mode: \xff\n"}),
        "7": ("summary.json's `best` is a number, not a mapping", {"summary": b'{"best": 3}'}),
        "8": ("mode must be 'min' or 'max', got 'up'", {"config": b"mode: up\n"}),
        "9": ("metrics.jsonl has 1 line(s) that are not JSON objects", {}),
    }
    for name, (_, files) in reasons.items():
        job(sweep, name, **files)
    (sweep / "9" / "metrics.jsonl").write_bytes(
        b'{"step": 1, "val/loss": 1.0}\n\xff\xfe\n{"step": 2, "val/loss": 0.9}\n'
    )
    job(sweep, "10")  # running: its last line half-written, as a job still writing leaves it
    (sweep / "10" / "metrics.jsonl").write_bytes(b'{"step": 1, "val/loss": 1.0}\n{"step": 2, "val/lo')
    rows = {row["job"]: row for row in collect(sweep)}
    assert rows["0"]["status"] == "completed" and rows["10"]["status"] == "running" and rows["10"]["best"] == 1.0
    for name, (reason, _) in reasons.items():
        assert rows[name]["status"] == "unreadable" and reason in rows[name]["error"], (name, rows[name])
    capsys.readouterr()
    assert report.main([str(sweep), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert out.count("unreadable") == len(reasons) and "job 3: summary.json is not UTF-8 text" in out


@pytest.mark.parametrize("top", ["-1", "0"])
def test_report_refuses_a_top_below_one(tmp_path: Path, capsys, top: str) -> None:
    job(tmp_path / "sweep", "0", SUMMARY.encode())
    refused(report.main, [str(tmp_path / "sweep"), "--top", top], capsys, f"--top {top}: show the N best jobs, N >= 1")


# ---- a forged summary.json: read as missing, never waited on -----------------------------------------------------
def test_a_summary_that_is_a_fifo_a_device_or_too_deep_is_read_as_missing(sae_lm_run: Path, tmp_path: Path) -> None:
    import os
    import shutil

    from runner.rundir import read_json
    from runner.tools import export

    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    os.mkfifo(tmp_path / "fifo.json")  # reading it would wait for a writer forever
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # reading it would never end
    (tmp_path / "ok.json").write_text('{"metrics": {"val/fve": 0.5}}')
    assert [read_json(tmp_path / f"{n}.json") for n in ("deep", "fifo", "zero")] == [None, None, None]
    assert read_json(tmp_path / "ok.json") == {"metrics": {"val/fve": 0.5}}
    run = Path(shutil.copytree(sae_lm_run, tmp_path / "run"))
    (run / "summary.json").unlink(missing_ok=True)
    os.mkfifo(run / "summary.json")
    assert export.main([str(run), "format=hf", "model_name=tiny"]) == 0  # the card quotes no metrics
    assert "| - |" in (run / "export-hf" / "README.md").read_text()
