"""The attribution graph's page in a real browser (headless Chromium, Debian's `chromium`; skipped where it is missing),
opened from disk as `python -m runner.attribute` leaves it: every node and edge drawn, no console error, a prompt
holding `</script>` shown as text and run as nothing; #node=ID opens the panel on a feature, with its strongest edges
and the link to its latent's feature page."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import CHROMIUM, clt_graph, headless_chromium

from experiments.sae.circuits.output import write_graph
from experiments.sae.circuits.page import write_page

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
PROMPT = "x = '</script><script>alert(1)</script>'"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A CLT run's folder with layer 0's feature pages, and the graph of a random 2-block GPT written in it as the
    command writes it (graph.json, index.html)."""
    run = tmp_path_factory.mktemp("clt")
    (run / "features" / "layer0").mkdir(parents=True)
    (run / "features" / "layer0" / "index.html").write_text("<!doctype html><title>layer 0</title>")
    data = clt_graph(PROMPT, [str(run)])
    write_graph(run / "attribution" / "graph.json", data)
    return write_page(run / "attribution", data), data


def test_every_node_and_edge_is_drawn_with_no_console_error(page: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    index, data = page
    dom, console = headless_chromium(index.as_uri())
    assert console == [], console
    assert len(re.findall(r'<g class="node \w+" data-id="\d+"', dom)) == len(data["nodes"])
    assert len(re.findall(r'<line class="edge', dom)) == len(data["edges"])
    assert f'data-drawn="{len(data["nodes"])}"' in dom  # the script ran to its end
    assert len(re.findall(r"<script", dom)) == 2 and "<script>alert" not in dom  # the prompt made no element
    shown = html.unescape(re.search(r'<code id="prompt">(.*?)</code>', dom).group(1))
    assert shown == PROMPT  # as text
    assert f"{data['scores']['replacement']:.4f}"[:5] in dom
    shot = tmp_path / "graph.png"
    headless_chromium(index.as_uri(), f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.stat().st_size > 10_000


def test_a_feature_s_panel_shows_its_edges_and_links_its_feature_page(page: tuple[Path, dict[str, Any]]) -> None:
    index, data = page
    # the most influential feature of layer 0 (its pages exist) and of layer 1 (none written)
    features = [n for n in data["nodes"] if n["kind"] == "feature"]
    layer = {n: max((f for f in features if f["layer"] == n), key=lambda f: f["influence"]) for n in (0, 1)}
    dom, console = headless_chromium(f"{index.as_uri()}#node={layer[0]['id']}")
    assert console == [], console
    panel = re.search(r'<aside id="panel">(.*?)</aside>', dom, re.DOTALL).group(1)
    assert f"L0 latent {layer[0]['latent']} @ {layer[0]['pos']}" in html.unescape(panel)
    link = re.search(r'<a href="([^"]+)" class="feature-page">', panel).group(1)
    assert link == f"../features/layer0/index.html#latent={layer[0]['latent']}"
    assert (index.parent / link.split("#")[0]).resolve().is_file()
    inputs = sum(e["target"] == layer[0]["id"] for e in data["edges"])
    assert f"strongest inputs ({min(inputs, 8)} of {inputs})" in panel
    assert re.search(rf'class="node feature picked[^"]*" data-id="{layer[0]["id"]}"', dom)
    dom, console = headless_chromium(f"{index.as_uri()}#node={layer[1]['id']}")
    assert console == [] and 'class="feature-page"' not in dom and "no feature pages for this layer" in dom


def test_graph_json_and_the_page_hold_the_same_graph(page: tuple[Path, dict[str, Any]]) -> None:
    index, data = page
    block = re.search(r'id="graph-data">(.*?)</script>', index.read_text(), re.DOTALL).group(1)
    assert json.loads(block)["graph"] == json.loads((index.parent / "graph.json").read_text()) == data
