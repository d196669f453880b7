"""index.html beside graph.json: the pruned attribution graph as one static page (static/page.html, graph.css,
graph.js inlined; no network, no CDN), laid out by layer (embeddings at the bottom, logits at the top) and position.
The graph's data is embedded as JSON in a <script type="application/json"> block with every `<`, `>` and `&`
escaped, so a prompt holding `</script>` or `<!--` cannot end the block; the page sets every string with
textContent. A feature links to its latent's feature page where `python -m runner.features` wrote them in its coder's
run folder (RUN/features/, a CLT's RUN/features/layerN/): by a relative link, so the folders open from disk."""

from __future__ import annotations

import json
import math
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from runner.rundir.files import write_atomic

STATIC = Path(__file__).resolve().parent / "static"
SHOWN = {9: "\u21e5", 10: "\u21b5", 13: "\u240d", 32: "\u2423"}  # whitespace drawn, as the feature pages draw it
DATA = "/*GRAPH*/"  # where the template takes the data
# the block a transcoder's hook reads (blocks.3.mlp_norm, transformer.h.3.ln_2): the graph's coder runs are the ones
# load.py accepted as MLP input/output pairs, so the first number of their hook is the layer
BLOCK = re.compile(r"[A-Za-z_.]*?\.(\d+)\.")


def _finite(value: Any) -> Any:
    # JSON.parse refuses NaN and Infinity (a score of an empty graph): they are shown as missing
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def byte_text(token: int) -> str:
    """One byte of runner's byte-level GPT as printable text: ASCII as itself, whitespace drawn, the rest `\\xNN`."""
    return SHOWN.get(token) or (chr(token) if 32 < token < 127 else f"\\x{token:02x}")


def _labels(data: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    # the text of the prompt's tokens and of the logit nodes' tokens: data["token_text"] (one per prompt token) and a
    # logit node's "text" where given; bytes where the tokens are the prompt's bytes (runner's GPT); else the ids
    tokens, prompt = data.get("tokens") or [], data.get("prompt")
    given = data.get("token_text")
    is_bytes = isinstance(prompt, str) and all(isinstance(t, int) and 0 <= t < 256 for t in tokens)
    is_bytes = is_bytes and list(prompt.encode()) == tokens
    if isinstance(given, list) and len(given) == len(tokens) and all(isinstance(t, str) for t in given):
        shown = list(given)
    else:
        shown = [byte_text(t) if is_bytes else f"#{t}" for t in tokens]
    logits = {}
    for node in data.get("nodes") or []:
        if node.get("kind") == "logit":
            text, token = node.get("text"), node.get("token")
            logits[str(node["id"])] = text if isinstance(text, str) else byte_text(token) if is_bytes else f"#{token}"
    return shown, logits


def _hook(index_js: Path) -> str | None:
    # the module a single SAE's feature pages read (data/index.js: `FEATURES.index({...});`), or None
    try:
        text = index_js.read_text()
        head = json.loads(text[text.index("(") + 1 : text.rindex(")")])
    except (OSError, ValueError):
        return None
    hook = head.get("hook") if isinstance(head, dict) else None
    return hook if isinstance(hook, str) else None


def _runs(data: dict[str, Any]) -> list[Path]:
    # the coders' run folders (a RUN given as a file in it: its folder)
    runs = [Path(p) for p in data.get("coder") or [] if isinstance(p, str)]
    return [run if run.is_dir() else run.parent for run in runs if run.exists()]


def feature_pages(data: dict[str, Any]) -> dict[int, Path]:
    """Layer -> the index page of that layer's feature pages, for the layers whose coder run has them."""
    runs, pages = _runs(data), {}
    if len(runs) == 1:  # a CLT's pages: a folder per layer (experiments/sae/tools.py clt_features)
        for layer in range(int(data.get("n_layers") or 0)):
            if (page := runs[0] / "features" / f"layer{layer}" / "index.html").is_file():
                pages[layer] = page
    for run in runs:  # one transcoder's pages: which block it reads is the hook its pages name
        page = run / "features" / "index.html"
        hook = _hook(run / "features" / "data" / "index.js") if page.is_file() else None
        if hook and (block := BLOCK.match(hook)):
            pages.setdefault(int(block[1]), page)
    return pages


def _link(folder: Path, page: Path) -> str:
    # relative, so the page and the feature pages open from disk and from any server of a folder holding both
    relative = os.path.relpath(page.resolve(), folder.resolve())
    return urllib.parse.quote(Path(relative).as_posix())


def embedded_json(payload: Any) -> str:
    """`payload` as JSON that is safe inside a <script> element: no `<`, `>` or `&` (hence no `</script>`, no
    `<!--`), every non-ASCII character escaped too (U+2028 and U+2029 included)."""
    text = json.dumps(_finite(payload), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_page(folder: Path, data: dict[str, Any]) -> Path:
    """Write `folder`/index.html, the page of the graph `data` (output.graph_data); returns its path."""
    tokens, logits = _labels(data)
    pages = {str(layer): _link(folder, page) for layer, page in feature_pages(data).items()}
    view = {"tokens": tokens, "logits": logits, "pages": pages}
    page = (STATIC / "page.html").read_text()
    page = page.replace("/*STYLE*/", (STATIC / "graph.css").read_text())
    page = page.replace("/*SCRIPT*/", (STATIC / "graph.js").read_text())
    head, tail = page.split(DATA)  # the data last, so that nothing in it is taken for a marker
    folder.mkdir(parents=True, exist_ok=True)
    return write_atomic(folder / "index.html", (head + embedded_json({"graph": data, "view": view}) + tail).encode())


def served_root(folder: Path, data: dict[str, Any]) -> Path:
    """The folder to serve (`--serve`) so that the page in `folder` and the feature pages it links are all reached:
    the coder's run folder where the page lies in it (the default, RUN/attribution), else `folder` alone (the links
    then work from disk only: a wider folder could be the whole disk)."""
    linked = [page.resolve() for page in feature_pages(data).values()]
    for run in (run.resolve() for run in _runs(data)):
        if folder.resolve().is_relative_to(run) and any(page.is_relative_to(run) for page in linked):
            return run
    return folder
