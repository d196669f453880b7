"""What the writers quote of a config is plain data (runner.tools.published): a forged run folder whose config reads an
environment variable (a token an uploader holds) in every field they quote gets its outputs written with the config's
own text there, never the variable's value: the model card and SAELens/sparsify cfg.json of runner.tools.export, the
pages and Neuronpedia batches of runner.tools.features, sae_eval's eval.json and index.html; a value the run's config
resolves from its own keys (`${source.module}`) still shows. Markdown and HTML from the config stay text in the card,
and the pages (HTML) escape what they show."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import finished_run, hf_text, refused, tiny_hf_model
from omegaconf import OmegaConf

from experiments.sae.evals import cli as sae_eval
from experiments.sae.evals.run import page
from experiments.sae.formats import hub_card
from experiments.sae.pages.write import STATIC, family_index
from runner import ConfigError
from runner.tools import export, features
from runner.tools.published import plain

SECRET = "hf_SeCrEtToKeN0123456789abcdef"  # what an uploader's HF_TOKEN looks like
HOSTILE = "<img src=x onerror=alert(1)>|\n# injected"
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf)")


def _written(*folders: Path) -> dict[Path, bytes]:
    files = {p: p.read_bytes() for folder in folders for p in folder.rglob("*") if p.is_file()}
    assert files, folders
    return files


def _forge(run: Path, **values: str) -> None:
    # the run's own .hydra/config.yaml with `values` (dotted keys) written into it as a forger would
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")


def _writers(run: Path, *attach: str, forged_source: bool = False) -> list[Path]:
    # every writer of a run folder, each into its default folder: what they wrote. A source named by a resolver names
    # no model: the writers that name one are refused without model_name=, and take it
    name = ["model_name=tiny"] if forged_source else []
    out = []
    if not attach:
        for fmt in ("hf", "saelens", "sparsify"):
            if name and fmt != "sparsify":
                assert export.main([str(run), f"format={fmt}"]) == 2
            assert export.main([str(run), f"format={fmt}", *(name if fmt != "sparsify" else [])]) == 0
            out.append(run / f"export-{fmt}")
    assert features.main([str(run), *attach, *name, "tokens=200", "neuronpedia=true"]) == 0
    assert sae_eval.main([str(run), *attach, "evals=[core]", "tokens=2000", "splice_tokens=500"]) == 0
    return [*out, run / "features", run / "evals"]


def test_plain_resolves_the_config_s_own_references_and_quotes_every_other_resolver(monkeypatch) -> None:
    monkeypatch.setenv("RUNNER_TEST_SECRET", SECRET)
    cfg = OmegaConf.create(
        {
            "source": {"layer": 2, "module": "blocks.${source.layer}", "inputs": {"paths": ["a/*.txt"]}},
            "data": {
                "module": "${source.module}",
                "inputs": "${oc.select:source.inputs,null}",
                "checkpoint": "${oc.env:RUNNER_TEST_SECRET}",
                "through_a_key": "${data.checkpoint}",  # a reference to a key that reads the environment
                "as_default": "${oc.select:nowhere,${oc.env:RUNNER_TEST_SECRET}}",
                "dated": "runs/${now:%Y}",
                "escaped": "\\${oc.env:RUNNER_TEST_SECRET}",
                "missing": "${nowhere}",
                "mandatory": "???",
            },
        }
    )
    quoted = plain(cfg)
    assert SECRET not in json.dumps(quoted)
    assert quoted["data"] == {
        "module": "blocks.2",
        "inputs": {"paths": ["a/*.txt"]},
        "checkpoint": "${oc.env:RUNNER_TEST_SECRET}",
        "through_a_key": "${oc.env:RUNNER_TEST_SECRET}",
        "as_default": "${oc.select:nowhere,${oc.env:RUNNER_TEST_SECRET}}",
        "dated": "runs/${now:%Y}",
        "escaped": "${oc.env:RUNNER_TEST_SECRET}",
        "missing": "${nowhere}",
        "mandatory": "???",
    }
    with pytest.raises(ConfigError, match="in a cycle"):
        plain(OmegaConf.create({"a": {"b": "${c}"}, "c": {"d": "${a}"}}))
    doubling = {"l0": {"x": 1}, **{f"l{i}": {"a": f"${{l{i - 1}}}", "b": f"${{l{i - 1}}}"} for i in range(1, 30)}}
    # the bound is the test, not its size (10,000 take ~3 s)
    monkeypatch.setattr("runner.tools.published.MAX_VALUES", 1000)
    with pytest.raises(ConfigError, match="over 1,000 times"):  # 2**29 values from 60 lines
        plain(OmegaConf.create(doubling))


def test_no_writer_quotes_an_environment_variable_of_a_forged_runner_run(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # the source model's folder read from the environment: its value is the secret
    run = Path(shutil.copytree(sae_lm_run, tmp_path / "run"))
    monkeypatch.setenv("RUNNER_TEST_MODEL", str(lm_run))
    _forge(run, **{"source.checkpoint": "${oc.env:RUNNER_TEST_MODEL}"})
    files = _written(*_writers(run, forged_source=True))
    assert not [p for p, data in files.items() if str(lm_run).encode() in data]
    # the run's own references still resolve: the hook point through ${source.module} (blocks.${source.layer})
    assert json.loads((run / "export-saelens" / "cfg.json").read_text())["metadata"]["hook_name"] == (
        "blocks.1.hook_resid_post"
    )
    coder = json.loads((run / "evals" / "eval.json").read_text())["coder"]
    assert (coder["source"], coder["module"], coder["skip_positions"]) == ("${oc.env:RUNNER_TEST_MODEL}", "blocks.1", 1)
    capsys.readouterr()


@needs_hf
def test_no_writer_quotes_an_environment_variable_through_a_glob_of_a_transformers_source(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    # the card's text quotes source.inputs.paths: a glob whose character class still matches the text files with
    # the variable's value inside, and HTML, a table's `|` and a line break with it
    model, text = tiny_hf_model(tmp_path / "gpt2", "gpt2"), tmp_path / "text"
    hf_text(text)
    run = tmp_path / "run"
    run.mkdir()
    finished_run(run, "+experiment=sae_hf", f"source.checkpoint={model}", "source.module=transformer.h.1",
                 f"source.inputs.paths=[{text}/0*.py]", "source.inputs.val_every=2", "source.inputs.context=16",
                 "source.inputs.batch_size=4", "model.n_latents=64", "model.k=8", "data.batch_size=32",
                 "data.buffer_size=256", "data.samples_per_epoch=1024", "trainer.max_duration=4st", "logger=none",
                 "checkpoint=none")  # fmt: skip
    monkeypatch.setenv("RUNNER_TEST_SECRET", SECRET)
    monkeypatch.setenv("RUNNER_TEST_MODEL", str(model))
    glob = f"{text}/0[0-9][0-9{HOSTILE}${{oc.env:RUNNER_TEST_SECRET}}].py"
    _forge(run, **{"source.inputs.paths": [glob], "source.checkpoint": "${oc.env:RUNNER_TEST_MODEL}"})
    files = _written(*_writers(run, forged_source=True))
    assert not [p for p, data in files.items() if SECRET.encode() in data or str(model).encode() in data]
    card = (run / "export-hf" / "README.md").read_text()
    unescaped = re.sub(r"\\(.)", r"\1", card)
    assert f"on the text of {glob.replace(chr(10), ' ')}, 1,024 positions an epoch" in unescaped  # the config's words
    assert "activations of `transformer.h.1` of `tiny`" in card  # the module resolved through ${source.module}
    assert "<" not in card.replace("\\<", "")  # no HTML from the config, raw
    _renders_safely(card, rows=1)
    capsys.readouterr()


def test_an_imported_folder_s_metadata_resolver_stays_text(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    sae = tmp_path / "imported"
    assert export.main([str(sae_lm_run), "format=saelens", f"out={sae}"]) == 0
    cfg = json.loads((sae / "cfg.json").read_text())
    cfg["metadata"]["model_name"] = "${oc.env:RUNNER_TEST_SECRET}"
    (sae / "cfg.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("RUNNER_TEST_SECRET", SECRET)
    files = _written(*_writers(sae, f"source={lm_run}"))
    assert not [p for p, data in files.items() if SECRET.encode() in data]
    imported = json.loads((sae / "evals" / "eval.json").read_text())["coder"]["imported_from"]
    assert imported["model"] == "${oc.env:RUNNER_TEST_SECRET}"
    capsys.readouterr()


def test_a_hook_point_named_by_a_resolver_is_refused_and_nothing_is_written(
    sae_lm_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # the module names a folder and SAELens's hook_name: a value from the environment would be a wrong name or a leak
    run = Path(shutil.copytree(sae_lm_run, tmp_path / "run"))
    monkeypatch.setenv("RUNNER_TEST_LAYER", "1")
    _forge(run, **{"source.layer": "${oc.env:RUNNER_TEST_LAYER}"})
    listing = sorted(os.listdir(run))
    message = r"data.module of .*config.yaml reads 'blocks.\$\{oc.env:RUNNER_TEST_LAYER\}': .*write the module's own"
    refused(export.main, [str(run), "format=hf"], capsys, message)
    refused(features.main, [str(run), "tokens=200"], capsys, message)
    refused(sae_eval.main, [str(run), "evals=[core]", "tokens=2000"], capsys, message)
    assert sorted(os.listdir(run)) == listing


# ---- markdown and HTML ---------------------------------------------------------------------------------------------
def _renders_safely(card: str, rows: int) -> None:
    # rendered as CommonMark with GFM tables (as the hub renders a card): no element from the config, one title, a
    # table of `rows` rows of 11 cells, no link
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(card)
    assert "<img" not in html and "<a " not in html and html.count("<h1>") == 1 and "<h2>" not in html, html
    body = html.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr>") == rows and all(row.count("<td>") == 11 for row in body.split("<tr>")[1:]), body


def test_markdown_and_html_in_quoted_values_stay_text_in_the_card(tmp_path: Path) -> None:
    folder = tmp_path / "repo" / "blocks|1`x"
    folder.mkdir(parents=True)
    meta = {"hook_name": f"blocks.1 {HOSTILE} ``", "model_name": "gpt2"}
    saelens = {"architecture": "topk", "d_in": 4, "d_sae": 8, "k": 2, "metadata": meta}
    (folder / "cfg.json").write_text(json.dumps(saelens))
    data = {"checkpoint": "gpt2", "module": f"blocks.1{HOSTILE}", "inputs": {"dataset": f"[x](javascript:1) {HOSTILE}"}}
    summary = {"progress": {"step": 300}, "metrics": {"val/fve": 0.5, "val/l0": "<b>no</b>"}}
    card = hub_card(tmp_path / "repo", {folder: ""}, {"data": data, "publish": {"model_name": "gpt2"}}, summary)
    text = card.read_text()
    _renders_safely(text, rows=1)
    assert "(300 steps)" in text and "| 0.5 | - |" in text  # a figure that is no number is not printed
    assert 'SAE.load_from_disk("blocks|1`x")' in text  # the snippet's name as a Python string literal


def test_the_pages_escape_what_they_show(tmp_path: Path) -> None:
    # the family's page and the evaluation page are written HTML: escaped; the feature pages set text with
    # textContent only (no HTML sink in the page's script, which renders the data files)
    family_index(tmp_path / "family", ["ok", HOSTILE.replace("\n", " ")])
    written = (tmp_path / "family" / "index.html").read_text()
    assert "<img" not in written and "&lt;img src=x onerror=alert(1)&gt;" in written
    coder = {"class": "TopKSAE", "source": HOSTILE, "module": "</td><script>alert(1)</script>"}
    html = page({"coder": coder, "evals": {}, "seconds": 0.1})
    assert "<img" not in html and "<script>" not in html and "&lt;script&gt;" in html
    script = (STATIC / "app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)
