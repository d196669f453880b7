"""Publishing names are not local paths (runner.tools.published): the model card's title, SAELens's `model_name` and
Neuronpedia's `model_id` / `sae_set` are the source's hub name or a folder's name by default (said on the console, with
how to choose others), or what model_name= and sae_set= give, checked to be safe as parts of URLs and file names; the
card counts "1 step", "300 steps"."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import finished_run, refused

from experiments.sae.formats import hub_card
from runner import ConfigError
from runner.tools import export, features
from runner.tools.published import publish_names

HOME = "/home/someone/work"  # a machine's absolute path: never part of a name


@pytest.mark.parametrize(
    ("checkpoint", "run_dir", "names", "how"),
    [
        ("hf:EleutherAI/pythia-70m", "outputs/2026-12-01/22-05-10", ("EleutherAI/pythia-70m", "2026-12-01_22-05-10"),
         "the source's hub name"),
        ("hf-cache:gpt2", f"{HOME}/saes/res k32 (v2)", ("gpt2", "res-k32-v2"), "the source's hub name"),
        (f"{HOME}/outputs/2026-12-01/22-01-22", f"{HOME}/sae", ("2026-12-01_22-01-22", "sae"), "folder name"),
        (f"{HOME}/lm/model.safetensors", f"{HOME}/sae-1", ("lm", "sae-1"), "folder name"),
        (f"{HOME}/models/gpt2-local", f"{HOME}/2026-12-01/22-05-10-1", ("gpt2-local", "2026-12-01_22-05-10-1"), ""),
        (None, f"{HOME}/sae", (None, "sae"), ""),  # activations from a file: no model to name
    ],
)  # fmt: skip
def test_default_names_are_a_hub_name_or_a_folder_s_name_never_a_path(
    checkpoint: str | None, run_dir: str, names: tuple, how: str
) -> None:
    chosen, said = publish_names({"data": {"checkpoint": checkpoint}}, Path(run_dir))
    assert (chosen["model_name"], chosen["sae_set"]) == names
    assert how in said and "sae_set=NAME" in said and HOME not in said
    assert ("model_name=NAME" in said) == (checkpoint is not None)
    given, said = publish_names({"data": {"checkpoint": checkpoint or "x"}}, Path(run_dir), "gpt2", "res-jb")
    assert given == {"model_name": "gpt2", "sae_set": "res-jb"} and said == ""


@pytest.mark.parametrize("checkpoint", ["${oc.env:HF_HOME}/x/${oc.env:MODEL}", "hf:../../etc/passwd"])
def test_a_source_named_in_no_plain_words_needs_model_name(checkpoint: str) -> None:
    # another folder's name (the SAE's) would misname the model in the card and in SAELens's cfg.json
    with pytest.raises(ConfigError, match="names no model in plain words: give its name, model_name=NAME"):
        publish_names({"data": {"checkpoint": checkpoint}}, Path(f"{HOME}/sae"))
    given, said = publish_names({"data": {"checkpoint": checkpoint}}, Path(f"{HOME}/sae"), "gpt2")
    assert given["model_name"] == "gpt2" and "model_name" not in said
    unused = publish_names({"data": {"checkpoint": checkpoint}}, Path(f"{HOME}/sae"), used=("sae_set",))[0]
    assert unused == {"model_name": None, "sae_set": "sae"}  # where no output names the model


def test_an_export_names_its_source_by_a_folder_s_name_and_says_so(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path, capsys
) -> None:
    run = Path(shutil.copytree(sae_lm_run, tmp_path / "run"))
    (run / "summary.json").write_text(json.dumps({"progress": {"step": 300, "samples": 1, "tokens": 9600}}))
    assert export.main([str(run), "format=hf", f"out={tmp_path / 'repo'}"]) == 0
    err = capsys.readouterr().err
    assert f"publishing as model_name={lm_run.name} (the source's folder name) and sae_set=run" in err
    assert "give model_name=NAME sae_set=NAME to choose others" in err
    folder = tmp_path / "repo" / "blocks.1.hook_resid_post"
    assert json.loads((folder / "cfg.json").read_text())["metadata"]["model_name"] == lm_run.name
    card = (tmp_path / "repo" / "README.md").read_text()
    assert f"# run: sparse autoencoders of {lm_run.name}\n" in card
    assert "(300 steps, 1 sample, 9,600 tokens)" in card
    for path in (tmp_path / "repo").rglob("*"):  # no file names a path of this machine
        assert path.is_dir() or str(tmp_path).encode() not in path.read_bytes(), path


def test_the_given_names_reach_the_card_cfg_json_and_neuronpedia_s_batches(
    sae_lm_run: Path, tmp_path: Path, capsys
) -> None:
    names = ["model_name=EleutherAI/pythia-70m", "sae_set=res-k4"]
    assert export.main([str(sae_lm_run), "format=hf", f"out={tmp_path / 'repo'}", *names]) == 0
    assert "publishing as" not in capsys.readouterr().err  # nothing chosen by default, nothing to say
    cfg = json.loads((tmp_path / "repo" / "blocks.1.hook_resid_post" / "cfg.json").read_text())
    assert cfg["metadata"]["model_name"] == "EleutherAI/pythia-70m"
    assert "# res-k4: sparse autoencoders of EleutherAI/pythia-70m\n" in (tmp_path / "repo" / "README.md").read_text()
    assert export.main([str(sae_lm_run), "--format", "saelens", "--model-name", "gpt2", f"--out={tmp_path / 's'}"]) == 0
    assert json.loads((tmp_path / "s" / "cfg.json").read_text())["metadata"]["model_name"] == "gpt2"
    assert features.main([str(sae_lm_run), "tokens=200", "neuronpedia=true", f"out={tmp_path / 'p'}", *names]) == 0
    batch = json.loads((tmp_path / "p" / "neuronpedia" / "batch-0.json").read_text())
    dashed = ["--model-name", "EleutherAI/pythia-70m", "--sae-set=res-k4", "--neuronpedia", "true"]
    assert features._options(["RUN", *dashed]) == features._options(["RUN", "neuronpedia=true", *names])
    # Neuronpedia's URL is MODEL_ID/LAYER-SAE_SET/INDEX: a hub id's name alone
    assert (batch["model_id"], batch["layer"], batch["sae_set"]) == ("pythia-70m", 1, "res-k4")
    capsys.readouterr()


BAD = ["../etc", "a/b/c", "/abs", "ok/..", "x\ny", "tab\there", "gpt2 small", "é", "a" * 97, "", ".hidden"]


@pytest.mark.parametrize("value", BAD)
def test_a_name_that_is_no_plain_name_is_refused_and_nothing_is_written(
    sae_lm_run: Path, tmp_path: Path, value: str, capsys
) -> None:
    out = tmp_path / "out"
    for key in ("model_name", "sae_set"):
        message = re.escape(f"{key}={value!r}: give one ") + f".* e.g. {key}="
        refused(features.main, [str(sae_lm_run), "neuronpedia=true", f"{key}={value}", f"out={out}"], capsys, message)
        if value:  # an empty value is argparse's to refuse
            refused(export.main, [str(sae_lm_run), "format=hf", f"{key}={value}", f"out={out}"], capsys, message)
        assert not out.exists() and sorted(os.listdir(tmp_path)) == []


def test_a_name_where_nothing_takes_it_is_refused(sae_lm_run: Path, tmp_path: Path, capsys) -> None:
    run = sae_lm_run
    refused(export.main, [str(run), "format=sparsify", "model_name=gpt2"], capsys, "only format=saelens and format=hf")
    refused(export.main, [str(run), "format=saelens", "sae_set=x"], capsys, "only format=hf names one")
    refused(features.main, [str(run), "sae_set=x"], capsys, "sae_set=x: it names Neuronpedia's batches: give neuron")
    # a hub id's org/name is a model's, never a set's
    refused(features.main, [str(run), "neuronpedia=true", "sae_set=org/set"], capsys, "sae_set='org/set': give one")
    synthetic = tmp_path / "synthetic"
    synthetic.mkdir()
    finished_run(synthetic, "+experiment=sae", "model.n_latents=32", "data.splits.n_train=256", "data.splits.n_val=64",
                 "data.splits.d=16", "trainer.max_duration=2st", "logger=none", "checkpoint=none")  # fmt: skip
    refused(export.main, [str(synthetic), "format=hf", "model_name=gpt2"], capsys, "there is no model to name")
    assert not (synthetic / "export-hf").exists()
    assert export.main([str(synthetic), "format=hf"]) == 0
    card = (synthetic / "export-hf" / "README.md").read_text()
    assert "# synthetic: sparse autoencoders\n" in card and " of " not in card.split("\n# ")[1].split("\n")[0]
    capsys.readouterr()


def test_the_card_counts_one_step_and_more_steps_and_skips_what_is_no_count(tmp_path: Path) -> None:
    folder = tmp_path / "repo" / "blocks.0"
    folder.mkdir(parents=True)
    saelens = {"architecture": "topk", "d_in": 4, "d_sae": 8, "k": 2, "metadata": {"hook_name": "blocks.0"}}
    (folder / "cfg.json").write_text(json.dumps(saelens))
    cfg = {"data": {"checkpoint": "gpt2", "module": "blocks.0"}, "publish": {"model_name": "gpt2", "sae_set": "s"}}
    for progress, said in [
        ({"step": 1, "samples": 32}, "(1 step, 32 samples)"),
        ({"step": 300, "tokens": 1}, "(300 steps, 1 token)"),
        ({"step": "300", "samples": True, "tokens": 0}, "at the hook points below."),  # data of any shape
    ]:
        card = hub_card(tmp_path / "repo", {folder: ""}, cfg, {"progress": progress, "metrics": ["not", "a", "dict"]})
        assert said in card.read_text()
    assert "Trained with runner" in hub_card(tmp_path / "repo", {folder: ""}, cfg, ["a", "list"]).read_text()
