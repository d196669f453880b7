"""Feature dashboards of a trained SAE run: one pass of features.LatentStats over held-out inputs, written as static
pages (`python -m runner.features RUN_DIR`).

Inputs: for an SAE on a language model (data=activations_hooked), the source run's text, its validation windows first
and then its training windows until `tokens` positions are seen, with each row's window and position kept so that the
pages show the text around it; for activations from a file or the synthetic preset, the SAE's validation rows (no
text; on the synthetic preset each latent shows its best-matching true feature).

The folder (one per SAE of a family, under its name): index.html and app.js (copied from pages/; no network, no
CDN), data/index.js (the run's metrics, the latents' table, the density histogram) and data/latents-NNNN.js (CHUNK
latents each: contexts, intervals, histogram, logit lens, neighbours), loaded as scripts so that the pages work from
disk (browsers refuse fetch() of file:// URLs). Corpus text only ever reaches the page as token ids rendered with
textContent: a corpus holding `<script>` shows it as text.
"""

from __future__ import annotations

import functools
import html
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from experiments.sae.features import (
    GROUP,
    HIST_BINS,
    HIST_LOW,
    HIST_PER_DECADE,
    LatentStats,
    best_matches,
    logit_lens,
    nearest,
)
from experiments.sae.multi import MultiSAE, members
from runner import ConfigError
from runner.rundir import SUMMARY, read_json
from runner.trained import TRUSTED_TARGETS

PAGES = Path(__file__).resolve().parent / "pages"
CHUNK = 256  # latents per data file
BEFORE, AFTER = 24, 6  # tokens of text shown before and after a firing one


def _windows(source: Any, tokens: int) -> Iterator[tuple[torch.Tensor, Any, str]]:
    # the source's held-out windows, then its training windows: (the window tokens, the batch, its split)
    seen = 0
    for split, loader in (("val", source.data.val_loader()), ("train", source.data.train_loader())):
        for batch in loader or ():
            if seen >= tokens:
                return
            windows = batch["tokens"] if isinstance(batch, dict) and "tokens" in batch else None
            if windows is None:
                raise ConfigError("the source's batches carry no 'tokens': only token windows have text to show")
            seen += windows.shape[0] * (windows.shape[1] - 1 - source.skip)
            yield windows, batch, split


def _byte_vocab() -> list[str]:
    # byte-level text: printable ASCII as itself, newline and tab as themselves (the page makes them visible), the
    # rest (parts of UTF-8 characters, controls) as \xNN
    visible = {9: "\t", 10: "\n", 13: "\r"}
    return [chr(i) if 32 <= i < 127 else visible.get(i, f"\\x{i:02x}") for i in range(256)]


def _unembedding(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
    # (unembedding [vocab, d], the final norm's gain, tied to the embedding) of a runner GPT-like model, else None
    head = next(
        (getattr(model, n) for n in ("head", "lm_head") if isinstance(getattr(model, n, None), nn.Linear)), None
    )
    if head is None:
        return None
    norm = next((getattr(model, n) for n in ("norm", "ln_f", "final_norm") if hasattr(model, n)), None)
    embed = next(
        (getattr(model, n) for n in ("embed", "wte") if isinstance(getattr(model, n, None), nn.Embedding)), None
    )
    tied = embed is not None and embed.weight is head.weight
    return head.weight.detach(), getattr(norm, "weight", None), tied


class _Text:
    """The source model of a hooked run and the text it reads: rows of activations with their windows."""

    def __init__(self, cfg: DictConfig, device: torch.device, tokens: int) -> None:
        from experiments.sae.hooked import SourceModel  # noqa: PLC0415 - only SAEs on a language model need it

        data = cfg.data
        trusted = list(data.get("trusted_targets") or TRUSTED_TARGETS)
        self.source = SourceModel(data.checkpoint, data.module, device, trusted, int(data.get("skip_positions", 0)))
        self.tokens, self.windows, self.splits = tokens, [], {}
        self.vocab = _byte_vocab() if getattr(self.source.model, "vocab_size", None) == 256 else None

    def batches(self) -> Iterator[torch.Tensor]:
        for windows, batch, split in _windows(self.source, self.tokens):
            self.windows.append(windows[:, :-1].to(torch.int32))
            self.splits[split] = self.splits.get(split, 0) + len(windows)
            yield self.source.activations(batch).float()

    def context(self, row: int) -> dict[str, Any]:
        """The tokens around `row`'s position, and where in them it is."""
        per_window = self.windows[0].shape[1] - self.source.skip
        window, position = divmod(row, per_window)
        position += self.source.skip
        tokens = self.all_windows[window]
        start = max(0, position - BEFORE)
        return {"ids": tokens[start : position + AFTER + 1].tolist(), "at": position - start}

    @functools.cached_property
    def all_windows(self) -> torch.Tensor:
        """Every window read, [windows, T] (asked once the pass is over)."""
        return torch.cat(self.windows)


class _Rows:
    """The validation rows of an SAE run on activations (a file, the synthetic preset): no text."""

    def __init__(self, cfg: DictConfig, rows: int) -> None:
        from runner.build import build_data  # noqa: PLC0415 - runner's, not needed by text runs

        self.data, self.rows, self.vocab, self.splits = build_data(cfg), rows, None, {}
        if self.data.split_loader("val") is None:
            raise ConfigError("the run's data has no validation split to look at the latents on")

    def batches(self) -> Iterator[torch.Tensor]:
        seen = 0
        for batch in self.data.split_loader("val"):
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            if seen >= self.rows:
                return
            seen += len(x)
            self.splits["val"] = seen
            yield x.float()


def write(
    task: nn.Module,
    cfg: DictConfig,
    run_dir: Path,
    out: Path,
    tokens: int = 1_000_000,
    top: int = 16,
    device: str = "cpu",
    batch_rows: int = 4096,
) -> list[Path]:
    """Look at every SAE of `task` (a run of `cfg` in `run_dir`) over `tokens` rows and write its pages under `out`
    (one folder per SAE of a family); returns the index pages written."""
    started, device_ = time.perf_counter(), torch.device(device)
    hooked = str(cfg.data.get("_target_", "")).endswith("HookedData")
    inputs: _Text | _Rows = _Text(cfg, device_, tokens) if hooked else _Rows(cfg, tokens)
    family = members(task)
    task.to(device_)
    stats = {prefix: LatentStats(sae.n_latents, top=top) for prefix, sae in family}
    first = 0
    with torch.no_grad():
        for acts in inputs.batches():
            for chunk in acts.to(device_).split(batch_rows):
                for prefix, sae in family:
                    x = task.rows_of(chunk, prefix.rstrip("/")) if isinstance(task, MultiSAE) else chunk
                    stats[prefix].add(*sae.codes(x), first)
                first += len(chunk)
    seconds = time.perf_counter() - started
    summary, written = (read_json(run_dir / SUMMARY) or {}).get("metrics", {}), []
    for prefix, sae in family:
        metrics = {name: summary.get(f"val/{prefix}{name}") for name in ("fve", "l0", "dead_fraction")}
        title = f"{type(sae).__name__} {prefix.rstrip('/')}".strip()
        head = {
            "title": title,
            "rows": first,
            "seconds": round(seconds, 1),
            "splits": inputs.splits,
            "metrics": metrics,
        }
        views = _weights_views(sae, inputs)
        written.append(_pages(out / prefix.rstrip("/"), sae, stats[prefix].result(), inputs, views, head))
    if len(family) > 1:
        _family_index(out, [p.rstrip("/") for p, _ in family])
        written.insert(0, out / "index.html")
    return written


def _weights_views(sae: nn.Module, inputs: Any) -> dict[str, Any]:
    # what the weights alone say: neighbours, the logit lens (a source with an unembedding), true features (synthetic)
    W_dec = sae.W_dec.detach().cpu()
    near, cos = nearest(W_dec)
    views: dict[str, Any] = {"near": near, "near_cos": cos, "lens": None, "truth": None}
    if isinstance(inputs, _Text) and (found := _unembedding(inputs.source.model)) is not None:
        unembed, gain, tied = found
        views["lens"] = logit_lens(W_dec, unembed.cpu(), None if gain is None else gain.detach().cpu())
        views["tied"] = tied
    if isinstance(inputs, _Rows):
        truth = getattr(inputs.data.splits.get("val"), "true_features", None)
        if truth is not None:
            views["truth"] = best_matches(W_dec, truth.cpu())
    return views


def _script(path: Path, call: str, payload: Any) -> None:
    # a data file the pages load with a <script> tag (fetch() is refused from file://); ensure_ascii: no character
    # of the corpus reaches the file unescaped
    path.write_text(f"{call}({json.dumps(payload, ensure_ascii=True, separators=(',', ':'))});\n")


def _rounded(t: torch.Tensor, digits: int = 4) -> list:
    return [round(v, digits) for v in t.tolist()]


def _items(inputs: Any, rows: list[int], values: list[float]) -> list[dict[str, Any]]:
    # the kept rows (-1: none) as the page shows them: the text around each, or its row number; and the activation
    return [
        {**(inputs.context(row) if isinstance(inputs, _Text) else {"row": row}), "value": round(value, 4)}
        for row, value in zip(rows, values, strict=True)
        if row >= 0
    ]


def _intervals(inputs: Any, r: dict[str, torch.Tensor], i: int) -> list[dict[str, Any]]:
    # latent i's sampled examples by interval of activation, the strongest first
    out = []
    for interval in reversed(range(r["sample_rows"].shape[1])):
        items = _items(inputs, r["sample_rows"][i, interval].tolist(), r["sample_values"][i, interval].tolist())
        if items:
            # the first interval also holds what is below 1e-3, the last what is above 1e3
            low = 10 ** (HIST_LOW + interval * GROUP / HIST_PER_DECADE) if interval else 0.0
            high = 10 ** (HIST_LOW + (interval + 1) * GROUP / HIST_PER_DECADE)
            out.append({"low": float(f"{low:.3g}"), "high": float(f"{high:.3g}"), "items": items})
    return out


def _latent(inputs: Any, r: dict[str, torch.Tensor], views: dict[str, Any], i: int) -> dict[str, Any]:
    # everything latent i's own view shows
    latent = {
        "contexts": _items(inputs, r["top_rows"][i].tolist(), r["top_values"][i].tolist()),
        "intervals": _intervals(inputs, r, i),
        "hist": r["hist"][i].tolist(),
        "near": views["near"][i].tolist(),
        "near_cos": _rounded(views["near_cos"][i], 3),
    }
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


def _pages(
    folder: Path, sae: nn.Module, r: dict[str, torch.Tensor], inputs: Any, views: dict[str, Any], head: dict[str, Any]
) -> Path:
    # the folder's static files, its index data and its latents' data files
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for old in (folder / "data").glob("latents-*.js"):
        old.unlink()  # a smaller SAE written over a bigger one leaves no stale chunk
    for name in ("index.html", "app.js"):
        shutil.copyfile(PAGES / name, folder / name)
    n, top_tokens = sae.n_latents, []
    for start in range(0, n, CHUNK):
        chunk = {i: _latent(inputs, r, views, i) for i in range(start, min(n, start + CHUNK))}
        top_tokens += [_top_tokens(latent) for latent in chunk.values()]
        _script(
            folder / "data" / f"latents-{start // CHUNK:04d}.js", "FEATURES.chunk", {"start": start, "latents": chunk}
        )
    density = r["density"]
    fired = density[density > 0].log10().float()
    counts = torch.histc(fired, bins=42, min=-7, max=0) if len(fired) else torch.zeros(42)
    index = {
        **head,
        "n_latents": n,
        "never_fired": int((density == 0).sum()),
        "vocab": inputs.vocab,
        "texts": isinstance(inputs, _Text),
        "chunk": CHUNK,
        "hist": {"low": HIST_LOW, "per_decade": HIST_PER_DECADE, "bins": HIST_BINS},
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


def _family_index(out: Path, names: list[str]) -> None:
    # a family's folder: one link per SAE (its pages are in the folder of its name)
    links = "\n".join(f'<li><a href="{html.escape(n)}/index.html">{html.escape(n)}</a></li>' for n in names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(
        "<!doctype html>\n<meta charset=utf-8>\n<title>SAE family</title>\n<h1>SAEs of this run</h1>\n"
        f"<ul>\n{links}\n</ul>\n"
    )
