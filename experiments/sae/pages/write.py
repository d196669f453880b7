"""The feature pages' files (experiments/sae/pages/dashboard.py computes what they show): index.html and app.js copied
from static/ (no network, no CDN); data/index.js, the run's metrics, the latents' table and the density histogram; and
data/latents-NNNN.js, CHUNK latents each (contexts, examples by interval, histogram, logit lens, neighbours). The data
are scripts that call FEATURES.index / FEATURES.chunk, so that the pages work from disk (browsers refuse fetch() of
file:// URLs), and opening one latent loads only its chunk. Corpus text only ever reaches them as token ids, which the
page renders with textContent: a corpus holding `<script>` shows it as text."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.sae.pages.neuronpedia import write_batch
from experiments.sae.pages.stats import HIST_BINS, HIST_LOW, HIST_PER_DECADE, QUANTILES
from runner.rundir import write_atomic
from runner.rundir.outputs import clear_temporaries, make_dir

STATIC = Path(__file__).resolve().parent / "static"
CHUNK = 256  # latents per data file


def _script(path: Path, call: str, payload: Any) -> None:
    # a data file the pages load with a <script> tag (fetch() is refused from file://); ensure_ascii: no character
    # of the corpus reaches the file unescaped; renamed into place, so a symlink at its name is replaced, not followed
    write_atomic(path, f"{call}({json.dumps(payload, ensure_ascii=True, separators=(',', ':'))});\n".encode())


def _rounded(t: torch.Tensor, digits: int = 4) -> list:
    return [round(v, digits) for v in t.tolist()]


def _items(inputs: Any, rows: list[int], values: list[float]) -> list[dict[str, Any]]:
    # the kept rows (-1: none) as the page shows them: the text around each, or its row number; and the activation
    return [
        {**(inputs.context(row) if inputs.texts else {"row": row}), "value": round(value, 4)}
        for row, value in zip(rows, values, strict=True)
        if row >= 0
    ]


def _intervals(inputs: Any, r: dict[str, torch.Tensor], i: int) -> list[dict[str, Any]]:
    # latent i's examples by quantile of its activations, the strongest fifth first, with the range of its bins
    out = []
    for q in reversed(range(r["sample_rows"].shape[1])):
        items = _items(inputs, r["sample_rows"][i, q].tolist(), r["sample_values"][i, q].tolist())
        if items:
            low, high = float(r["sample_low"][i, q]), float(r["sample_high"][i, q])
            out.append({"quantile": q, "low": float(f"{low:.3g}"), "high": float(f"{high:.3g}"), "items": items})
    return out


def _latent(inputs: Any, r: dict[str, torch.Tensor], views: dict[str, Any], i: int) -> dict[str, Any]:
    # everything latent i's own view shows
    latent = {
        "contexts": _items(inputs, r["top_rows"][i].tolist(), r["top_values"][i].tolist()),
        "intervals": (intervals := _intervals(inputs, r, i)),
        "hist": r["hist"][i].tolist(),
        "near": views["near"][i].tolist(),
        "near_cos": _rounded(views["near_cos"][i], 3),
    }
    if len(intervals) < QUANTILES:  # the page says why a fifth has no examples
        fired = int(r["fired"][i])
        latent["note"] = (
            f"{QUANTILES - len(intervals)} of the {QUANTILES} fifths have no examples: it fired on {fired:,} "
            f"row{'s' if fired != 1 else ''} here, and its strongest ones are shown above, not again"
        )
    if (lens := views["lens"]) is not None:
        for side in ("promoted", "suppressed"):
            pairs = zip(lens[side][i].tolist(), _rounded(lens[f"{side}_logits"][i], 3), strict=True)
            latent[side] = [list(pair) for pair in pairs]
    if views["truth"] is not None:
        latent["truth"] = [int(views["truth"][0][i]), round(float(views["truth"][1][i]), 4)]
    return latent


def _top_tokens(latent: dict[str, Any]) -> list[int]:
    # the tokens its strongest contexts fire on, the most frequent first (three at most)
    firing = [c["ids"][c["at"]] for c in latent["contexts"] if "ids" in c]
    return sorted(set(firing), key=lambda t: (-firing.count(t), t))[:3]


def write_pages(
    folder: Path,
    sae: nn.Module,
    r: dict[str, torch.Tensor],
    inputs: Any,
    views: dict[str, Any],
    head: dict[str, Any],
    neuronpedia: bool = False,
    each: Callable[[], None] | None = None,
) -> Path:
    """Write one SAE's pages to `folder`: the static files, the index data and its latents' data files, from its
    statistics `r` (LatentStats.result), the `inputs` they came from, the weights' `views` and the index's `head`;
    with `neuronpedia`, the same latents as Neuronpedia's batch files too (neuronpedia.py); `each` hears of each CHUNK
    latents written (tens of thousands of latents take minutes). Returns the index page."""
    # real folders before anything in them is listed or removed: a symlink planted at a name is replaced, never
    # followed (what a link names is someone else's: none of its files is a stale chunk or batch of these pages)
    batches = folder / "neuronpedia"
    for made in (folder, folder / "data", *([batches] if neuronpedia else [])):
        clear_temporaries(make_dir(made))  # and what a killed run left in them removed
    if batches.is_symlink():  # pages without neuronpedia=true: the link alone goes
        batches.unlink()
    for old in [*(folder / "data").glob("latents-*.js"), *batches.glob("batch-*.json")]:
        old.unlink()  # a smaller SAE (or pages without neuronpedia=true) written over others leaves no stale chunk
    for name in ("index.html", "app.js"):
        write_atomic(folder / name, (STATIC / name).read_bytes())
    n, top_tokens = sae.n_latents, []
    for start in range(0, n, CHUNK):
        chunk = {i: _latent(inputs, r, views, i) for i in range(start, min(n, start + CHUNK))}
        top_tokens += [_top_tokens(latent) for latent in chunk.values()]
        _script(
            folder / "data" / f"latents-{start // CHUNK:04d}.js", "FEATURES.chunk", {"start": start, "latents": chunk}
        )
        if neuronpedia:
            write_batch(folder / "neuronpedia" / f"batch-{start // CHUNK}.json", sae, chunk, r, inputs, head)
        if each is not None:
            each()
    density = r["density"]
    fired = density[density > 0].log10().float()
    counts = torch.histc(fired, bins=42, min=-7, max=0) if len(fired) else torch.zeros(42)
    index = {
        **head,
        "n_latents": n,
        "never_fired": int((density == 0).sum()),
        "vocab": inputs.vocab,
        "texts": inputs.texts,
        "chunk": CHUNK,
        "hist": {"low": HIST_LOW, "per_decade": HIST_PER_DECADE, "bins": HIST_BINS},
        "quantiles": QUANTILES,
        "log_density_hist": {"low": -7, "high": 0, "counts": counts.long().tolist()},
        "density": [float(f"{v:.3g}") for v in density.tolist()],
        "mean": _rounded(r["mean"]),
        "max": _rounded(r["max"]),
        "top_tokens": top_tokens,
        "lens_tied": views.get("tied"),
        "truth": None if views["truth"] is None else _rounded(views["truth"][1]),
    }
    _script(folder / "data" / "index.js", "FEATURES.index", index)
    return folder / "index.html"


def family_index(out: Path, names: list[str]) -> None:
    """A family's folder: one link per SAE (its pages are in the folder of its name)."""
    links = "\n".join(f'<li><a href="{html.escape(n)}/index.html">{html.escape(n)}</a></li>' for n in names)
    page = "<!doctype html>\n<meta charset=utf-8>\n<title>SAE family</title>\n<h1>SAEs of this run</h1>\n"
    page += f"<ul>\n{links}\n</ul>\n"
    write_atomic(make_dir(out) / "index.html", page.encode())
