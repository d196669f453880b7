"""The attribution graph's page (experiments/sae/circuits/page.py): index.html beside graph.json embeds the graph whole
and loads nothing from the network; a prompt holding `</script>` or `<!--` stays inside the data block; the tokens
are shown as text (bytes of runner's GPT, or ids, or the text the data gives); a feature links to its latent's feature
page only where the features tool wrote them (a CLT's folder per layer, a transcoder's by the hook its pages read).
The page in a browser: tests/e2e/test_attribution_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import clt_graph

from experiments.sae.circuits.page import byte_text, served_root, write_page

HOSTILE = "</script><script>alert(1)</script><!--x"
DATA_BLOCK = re.compile(r'<script type="application/json" id="graph-data">(.*?)</script>', re.DOTALL)


def _embedded(page: Path) -> dict[str, Any]:
    return json.loads(DATA_BLOCK.search(page.read_text()).group(1))


@pytest.fixture(scope="module")
def hostile() -> dict[str, Any]:
    """The graph of a prompt that would end a <script> element."""
    return clt_graph(HOSTILE, ["no-such-run"])


def test_the_page_embeds_the_graph_and_loads_nothing(hostile: dict[str, Any], tmp_path: Path) -> None:
    page = write_page(tmp_path / "attribution", hostile)
    assert page == tmp_path / "attribution" / "index.html"
    embedded = _embedded(page)
    assert embedded["graph"] == hostile  # the whole graph, every node and edge
    assert embedded["view"]["pages"] == {}  # no feature pages: no link
    text = page.read_text()
    # offline: no script, style, font or image from anywhere
    assert not re.search(r"<script[^>]*\ssrc=|<link|@import|url\(|https?://(?!www\.w3\.org/2000/svg)", text)


def test_a_hostile_prompt_stays_inside_the_data_block(hostile: dict[str, Any], tmp_path: Path) -> None:
    text = write_page(tmp_path, hostile).read_text()
    block = DATA_BLOCK.search(text).group(1)
    assert "</" not in block and "<!--" not in block and "<script" not in block
    assert "alert(1)" not in text.replace(block, "")  # the prompt is nowhere but in the data
    assert text.count("</script>") == 2  # the data's and the page's code: the prompt ended neither early
    assert json.loads(block)["graph"]["prompt"] == HOSTILE


def test_nan_scores_are_shown_as_missing(hostile: dict[str, Any], tmp_path: Path) -> None:
    # JSON.parse refuses NaN: a page with one would draw nothing
    data = {**hostile, "scores": {"replacement": float("nan"), "completeness": float("inf")}}
    block = DATA_BLOCK.search(write_page(tmp_path, data).read_text()).group(1)
    assert "NaN" not in block and "Infinity" not in block
    assert json.loads(block)["graph"]["scores"] == {"replacement": None, "completeness": None}


def test_tokens_are_shown_as_bytes_as_ids_or_as_the_text_given(tmp_path: Path) -> None:
    prompt = "a b\n\x01é"
    data = clt_graph(prompt, [])
    view = _embedded(write_page(tmp_path, data))["view"]
    assert view["tokens"] == ["a", "\u2423", "b", "\u21b5", "\\x01", "\\xc3", "\\xa9"]
    logit = next(n for n in data["nodes"] if n["kind"] == "logit")
    byte = logit["token"]
    assert view["logits"][str(logit["id"])] == byte_text(byte) and byte_text(0x7E) == "~" and byte_text(9) == "\u21e5"
    # another vocabulary (tokens that are not the prompt's bytes): the ids, or the text the data gives
    other = {**data, "tokens": [50256, 464, 2068, 7586, 21831, 18045, 625]}
    view = _embedded(write_page(tmp_path, other))["view"]
    assert view["tokens"][:2] == ["#50256", "#464"] and view["logits"][str(logit["id"])] == f"#{byte}"
    named = {**other, "token_text": ["<|endoftext|>", "The", " quick", " brown", " fox", " jumps", " over"]}
    named["nodes"] = [{**n, "text": " lazy"} if n["kind"] == "logit" else n for n in other["nodes"]]
    view = _embedded(write_page(tmp_path, named))["view"]
    assert view["tokens"][:2] == ["<|endoftext|>", "The"] and view["logits"][str(logit["id"])] == " lazy"


def _features(folder: Path, hook: str | None = None) -> Path:
    # what `python -m runner.features` leaves: an index page, and a single SAE's data naming the hook it reads
    folder.mkdir(parents=True)
    (folder / "index.html").write_text("<!doctype html>")
    if hook is not None:
        (folder / "data").mkdir()
        (folder / "data" / "index.js").write_text(f"FEATURES.index({json.dumps({'title': 't', 'hook': hook})});\n")
    return folder / "index.html"


def test_features_link_to_their_pages_only_where_they_exist(hostile: dict[str, Any], tmp_path: Path) -> None:
    clt = tmp_path / "clt run #1"  # a name a URL must quote
    (clt / "attribution").mkdir(parents=True)
    data = {**hostile, "coder": [str(clt)]}
    assert _embedded(write_page(clt / "attribution", data))["view"]["pages"] == {}
    _features(clt / "features" / "layer1")  # a CLT's pages: one folder per layer; layer 0's not written
    pages = _embedded(write_page(clt / "attribution", data))["view"]["pages"]
    assert pages == {"1": "../features/layer1/index.html"}
    elsewhere = _embedded(write_page(tmp_path / "out", data))["view"]["pages"]
    assert elsewhere == {"1": "../clt%20run%20%231/features/layer1/index.html"}  # relative, quoted
    # one transcoder per layer, given in any order: each run's pages name the block they read
    runs = [tmp_path / "t0", tmp_path / "t1"]
    _features(runs[1] / "features", "blocks.0.mlp_norm")
    _features(runs[0] / "features")  # no data/index.js: which layer is unknown, so no link
    pages = _embedded(write_page(tmp_path / "out", {**hostile, "coder": [str(r) for r in runs]}))["view"]["pages"]
    assert pages == {"0": "../t1/features/index.html"}


def test_serve_serves_the_run_folder_only_when_the_page_is_in_it(hostile: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "run"
    _features(run / "features" / "layer0")
    data = {**hostile, "coder": [str(run)]}
    assert served_root(run / "attribution", data) == run.resolve()  # ../features/layer0 is reached
    assert served_root(tmp_path / "out", data) == tmp_path / "out"  # never a wider folder than a run's
    assert served_root(run / "attribution", {**data, "coder": []}) == run / "attribution"
