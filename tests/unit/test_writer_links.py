"""No writer removes or writes through a link it did not make: for each tool that writes into a run folder (the feature
pages and their Neuronpedia batches, an export in each format, sae_eval's evals/, runner.tools.evaluate's file), a run
folder from elsewhere plants links to a victim folder outside it, and the victim must survive byte for byte. A link at a
name the tool writes is replaced by the tool's own file or folder (never followed: runner.rundir.outputs); one that
would carry the output folder itself out of the run folder is refused with one paragraph and exit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import SAE_LM, finished_run, refused

from experiments.sae.evals import cli as sae_eval
from runner.load import load_trained
from runner.tools import evaluate, export, features


@pytest.fixture
def forged(sae_lm_run: Path, tmp_path: Path) -> Path:
    """A copy of the SAE run on the tiny GPT, for a test to plant links in."""
    return Path(shutil.copytree(sae_lm_run, tmp_path / "run"))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside the run folder holding what each writer would clear or write: none of it may change."""
    folder = tmp_path / "elsewhere"
    (folder / "data").mkdir(parents=True)
    for name in ("batch-0.json", "batch-7.json", "index.html", "eval.json", "data/latents-0000.js", "notes.txt"):
        (folder / name).write_text(f"the victim's own {name}\n")
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _batches(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("batch-*.json"))]


# ---- runner.tools.features: the pages and Neuronpedia's batches ----------------------------------------------------
@pytest.mark.parametrize("neuronpedia", [False, True])
def test_the_pages_never_clear_batches_through_a_neuronpedia_link(
    forged: Path, victim: Path, neuronpedia: bool, capsys
) -> None:
    before = _snapshot(victim)
    (forged / "features").mkdir()
    (forged / "features" / "neuronpedia").symlink_to(victim)
    args = [str(forged), "tokens=200"] + (["neuronpedia=true"] if neuronpedia else [])
    assert features.main(args) == 0, capsys.readouterr().err
    assert _snapshot(victim) == before
    batches = forged / "features" / "neuronpedia"
    assert not batches.is_symlink()
    if neuronpedia:  # written into a real folder of the pages' own
        assert [len(b["features"]) for b in _batches(batches)] == [64]
    else:  # the link alone is gone: no batch folder the pages do not match
        assert not batches.exists()


def test_the_pages_of_an_imported_saelens_folder_never_clear_batches_through_a_link(
    sae_lm_run: Path, lm_run: Path, victim: Path, tmp_path: Path, capsys
) -> None:
    sae = tmp_path / "imported"
    assert export.main([str(sae_lm_run), "format=saelens", f"out={sae}"]) == 0
    (sae / "features").mkdir()
    (sae / "features" / "neuronpedia").symlink_to(victim)
    (sae / "features" / "data").symlink_to(victim / "data")
    before = _snapshot(victim)
    assert features.main([str(sae), f"source={lm_run}", "tokens=200", "neuronpedia=true"]) == 0
    assert _snapshot(victim) == before
    pages = sae / "features"
    assert not any(p.is_symlink() for p in pages.rglob("*"))
    assert [len(b["features"]) for b in _batches(pages / "neuronpedia")] == [64]
    assert (pages / "data" / "latents-0000.js").read_text().startswith("FEATURES.chunk(")
    capsys.readouterr()


def test_a_family_s_pages_never_write_through_a_link_at_an_sae_s_folder(
    lm_run: Path, victim: Path, tmp_path: Path, capsys
) -> None:
    family = tmp_path / "family"
    family.mkdir()
    overrides = [o for o in SAE_LM if not o.startswith("model.")] + ["model=sae_multi", "model.ks=[4]"]
    overrides += ["model.base.n_latents=32", "source.module=[blocks.0,blocks.1]"]
    finished_run(family, "+experiment=sae_lm", f"source.checkpoint={lm_run}", *overrides)
    names = list(load_trained(family)[0].saes)
    (family / "features").mkdir()
    (family / "features" / names[0]).symlink_to(victim)  # an SAE's folder: what the pages clear and write
    (family / "features" / "index.html").symlink_to(victim / "index.html")  # the family's page
    before = _snapshot(victim)
    assert features.main([str(family), "tokens=200", "neuronpedia=true"]) == 0
    assert _snapshot(victim) == before
    pages = family / "features"
    assert not any(p.is_symlink() for p in pages.rglob("*"))
    assert all(_batches(pages / name / "neuronpedia") for name in names)
    assert all(name in (pages / "index.html").read_text() for name in names)
    capsys.readouterr()


# ---- runner.tools.export: every format, its default folder and out= ------------------------------------------------
@pytest.mark.parametrize("fmt", ["saelens", "sparsify", "hf"])
def test_an_export_never_writes_through_a_link_in_the_run_folder(
    forged: Path, victim: Path, fmt: str, tmp_path: Path, capsys
) -> None:
    before = _snapshot(victim)
    (forged / f"export-{fmt}").symlink_to(victim / "new")  # dangling: following it would make the folder
    refused(export.main, [str(forged), f"format={fmt}"], capsys, "outside the run folder .*Give --out DIR")
    (forged / "sub").symlink_to(victim)  # a typed out= inside the run folder follows the same rule
    refused(export.main, [str(forged), f"format={fmt}", f"out={forged / 'sub' / 'x'}"], capsys, "outside the run")
    (forged / "mine").mkdir()
    (forged / "mine" / "cfg.json").symlink_to(victim / "eval.json")  # a folder to write into that holds a link
    refused(export.main, [str(forged), f"format={fmt}", f"out={forged / 'mine'}"], capsys, "already holds files")
    (forged / f"export-{fmt}").unlink()
    (forged / f".export-{fmt}.partial-{os.getpid()}").symlink_to(victim)  # its own staging name, planted
    (forged / f".export-{fmt}.partial-999999999").symlink_to(victim)  # a dead export's
    assert export.main([str(forged), f"format={fmt}"]) == 0
    assert _snapshot(victim) == before and not (victim / "new").exists()
    written = forged / f"export-{fmt}"
    assert not any(p.is_symlink() for p in written.rglob("*")) and not list(forged.glob(".export-*"))
    assert any(p.name == "cfg.json" for p in written.rglob("*"))
    capsys.readouterr()


# ---- runner.sae_eval: evals/ ---------------------------------------------------------------------------------------
def test_the_evaluation_folder_never_leads_out_and_links_in_it_are_replaced(forged: Path, victim: Path, capsys) -> None:
    before = _snapshot(victim)
    args = [str(forged), "evals=[core]", "tokens=2000", "splice_tokens=500"]
    (forged / "evals").symlink_to(victim)
    refused(sae_eval.main, args, capsys, "outside the run folder .*Give out=DIR")
    (forged / "evals").unlink()
    (forged / "evals").mkdir()
    (forged / "evals" / "eval.json").symlink_to(victim / "eval.json")
    (forged / "evals" / "index.html").symlink_to(victim / "index.html")
    (forged / "evals" / f".eval.json.{os.getpid()}.tmp").symlink_to(victim / "notes.txt")  # write_atomic's name
    assert sae_eval.main(args) == 0
    assert _snapshot(victim) == before
    assert not (forged / "evals" / "eval.json").is_symlink() and not (forged / "evals" / "index.html").is_symlink()
    assert json.loads((forged / "evals" / "eval.json").read_text())["coder"]["n_latents"] == 64
    capsys.readouterr()


# ---- runner.tools.evaluate: eval-SPLIT.json ------------------------------------------------------------------------
def test_the_evaluation_file_replaces_a_link_and_a_split_never_names_a_path(forged: Path, victim: Path, capsys) -> None:
    before = _snapshot(victim)
    (forged / "eval-val.json").symlink_to(victim / "eval.json")
    assert evaluate.main([str(forged)]) == 0
    assert _snapshot(victim) == before and not (forged / "eval-val.json").is_symlink()
    assert json.loads((forged / "eval-val.json").read_text())["split"] == "val"
    listing = sorted(os.listdir(forged))
    for split in ("../elsewhere/x", "a/b", "/tmp/x"):  # the file it names would be eval-<split>.json
        refused(evaluate.main, [str(forged), f"split={split}"], capsys, "give the name of one of the run's data splits")
    assert sorted(os.listdir(forged)) == listing and _snapshot(victim) == before
