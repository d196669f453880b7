"""Feature dashboards of a trained SAE run (`python -m runner.features RUN_DIR`): one pass of features.LatentStats
over its inputs, then what the weights say, written by experiments/sae/pages/write.py.

Inputs: for an SAE on a language model (data=activations_hooked), the source run's text, its validation windows first
and then its training windows until `tokens` positions are seen, with each row's window and position kept so that the
pages show the text around it; for activations from a file or the synthetic preset, the SAE's validation rows (no
text; on the synthetic preset each latent shows its best-matching true feature)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from experiments.sae.metrics import summary_metric
from experiments.sae.pages.stats import (
    LatentStats,
    best_matches,
    logit_lens,
    nearest,
)
from experiments.sae.pages.write import CHUNK, family_index, write_pages
from experiments.sae.sources.hooked import hooks_a_model
from experiments.sae.sources.source import hooked_source
from runner import ConfigError
from runner.rundir import SUMMARY, read_json
from runner.rundir.outputs import within
from runner.tools.published import publish_names

BEFORE, AFTER = 24, 6  # tokens of text shown before and after a firing one
PHASES = ("statistics", "weights", "pages")  # the build's phases, in order, as the console names them
LATENTS = 1024  # latents per step of the weights' views (stats.nearest and stats.logit_lens take them so)


class _Phase:
    """A phase of the build as the console hears it ("features: pages (3 of 3)", `total` steps): each phase reports
    its own progress, so that the minutes after the pass over the text (the weights' views, writing the pages of
    tens of thousands of latents) are never silent."""

    def __init__(self, working: Callable[[str, int, int | None], None] | None, name: str, total: int | None) -> None:
        self.working = working or (lambda *_: None)
        self.what = f"features: {name} ({PHASES.index(name) + 1} of {len(PHASES)})"
        self.done, self.total = 0, total
        self.working(self.what, 0, total)  # its clock starts now, not at its first step's end

    def step(self, total: int | None = None) -> None:
        """One more step done; `total`: the phase's length where it is learnt as it goes."""
        self.done += 1
        self.total = max(total or self.total or 0, self.done)
        self.working(self.what, self.done, self.total)

    def end(self) -> None:
        """The phase is over, however short of its estimate (its line and heartbeat stop)."""
        if self.done != self.total:
            self.working(self.what, self.done, self.done)


def _windows(source: Any, tokens: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, Any, str]]:
    # the source's held-out windows, then its training windows: (the window tokens, the positions that give rows
    # (source.positions), the batch, its split)
    seen = 0
    for split, loader in (("val", source.data.val_loader()), ("train", source.data.train_loader())):
        for batch in loader or ():
            if seen >= tokens:
                return
            windows = batch["tokens"] if isinstance(batch, dict) and "tokens" in batch else None
            if windows is None:
                raise ConfigError("the source's batches carry no 'tokens': only token windows have text to show")
            positions = source.positions(batch, windows.shape[1] - 1)
            seen += len(positions)
            yield windows, positions, batch, split


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

    texts = True

    def __init__(self, cfg: DictConfig, device: torch.device, tokens: int) -> None:
        self.source = hooked_source(cfg.data, device)  # a transcoder's: the pages read the input side of its rows
        self.tokens, self.windows, self.positions, self.splits, self.read = tokens, [], [], {}, 0
        if self.source.pretrained is not None:
            self.vocab = self.source.pretrained.vocab()
        else:
            self.vocab = _byte_vocab() if getattr(self.source.model, "vocab_size", None) == 256 else None

    def batches(self) -> Iterator[torch.Tensor]:
        for windows, positions, batch, split in _windows(self.source, self.tokens):
            self.positions.append(positions + self.read)
            self.read += windows[:, :-1].numel()
            self.windows.append(windows[:, :-1].to(torch.int32))
            self.splits[split] = self.splits.get(split, 0) + len(windows)
            yield self.source.activations(batch).float()

    @property
    def window(self) -> int:
        """Tokens a window holds (0 before the first)."""
        return int(self.windows[0].shape[1]) if self.windows else 0

    def context(self, row: int) -> dict[str, Any]:
        """The tokens around `row`'s position, and where in them it is."""
        window, position = divmod(int(self.all_positions[row]), self.windows[0].shape[1])
        tokens = self.all_windows[window]
        start = max(0, position - BEFORE)
        return {"ids": tokens[start : position + AFTER + 1].tolist(), "at": position - start}

    def unembedding(self) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
        """The source's (unembedding, final norm's gain, tied) for the logit lens, when it has an output head."""
        hf = self.source.pretrained
        return hf.unembedding() if hf is not None else _unembedding(self.source.model)

    @functools.cached_property
    def all_windows(self) -> torch.Tensor:
        """Every window read, [windows, T] (asked once the pass is over)."""
        return torch.cat(self.windows)

    @functools.cached_property
    def all_positions(self) -> torch.Tensor:
        """Each row's place in all_windows, flat (window x T + position)."""
        return torch.cat(self.positions)


class _Rows:
    """The validation rows of an SAE run on activations (a file, the synthetic preset): no text."""

    texts = False

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
    family: list[tuple[str, nn.Module]],
    cfg: DictConfig,
    run_dir: Path,
    out: Path,
    tokens: int = 1_000_000,
    top: int = 16,
    device: str = "cpu",
    batch_rows: int = 4096,
    rows_of: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    working: Callable[[str, int, int | None], None] | None = None,
    neuronpedia: bool = False,
    publish: dict[str, Any] | None = None,
) -> list[Path]:
    """Look at each SAE of `family` ((metric prefix, SAE) pairs of a run of `cfg` in `run_dir`; a MultiSAE's give
    `rows_of`, the columns each reads; a cross-layer transcoder's, each layer's normalised input) over `tokens` rows and
    write its pages under `out` (one folder per SAE of a family); returns the index pages written. A transcoder's
    latents are looked at where they read: its input's contexts; the logit lens reads what they write. `working`
    (what, done, total) hears of each phase's progress (PHASES: the pass, the weights' views, the pages);
    `neuronpedia`: the pages' data as Neuronpedia's upload batches too (pages/neuronpedia.py), under the names
    `publish` ({model_name, sae_set}: runner.tools.published; default: the source's hub name or its folder's name,
    and the run folder's name)."""
    started, device_ = time.perf_counter(), torch.device(device)
    hooked = hooks_a_model(cfg.data)
    if neuronpedia and not hooked:  # said before the pass, not after it
        raise ConfigError("neuronpedia=true: Neuronpedia's features are shown on text; this run's rows have none")
    inputs: _Text | _Rows = _Text(cfg, device_, tokens) if hooked else _Rows(cfg, tokens)
    for _, sae in family:
        sae.to(device_)
    stats = {prefix: LatentStats(sae.n_latents, top=top) for prefix, sae in family}
    first = _look(family, inputs, stats, tokens, device_, batch_rows, rows_of, _Phase(working, "statistics", None))
    seconds = time.perf_counter() - started
    views = _family_views(family, inputs, working)
    writing = _Phase(working, "pages", sum(-(-sae.n_latents // CHUNK) for _, sae in family))
    summary, written = _final_metrics(run_dir), []
    if publish is None:
        publish = publish_names({"data": {"checkpoint": cfg.data.get("checkpoint")}}, run_dir)[0]
    for prefix, sae in family:
        metrics = {name: summary_metric(summary, f"val/{prefix}{name}") for name in ("fve", "l0", "dead_fraction")}
        title = f"{type(sae).__name__} {prefix.rstrip('/')}".strip()
        module = cfg.data.get("module")
        head = {
            "title": title,
            "rows": first,
            "seconds": round(seconds, 1),
            "splits": inputs.splits,
            "metrics": metrics,
            "hook": module if isinstance(module, str) else prefix.rstrip("/"),
            "model": publish["model_name"] or "",  # a publishing name, never a local path
            "sae_set": publish["sae_set"],
        }
        folder = within(out, prefix.rstrip("/"))  # a family's SAE names come from the run's config
        r = stats[prefix].result()
        written.append(write_pages(folder, sae, r, inputs, views[prefix], head, neuronpedia, writing.step))
    writing.end()
    if len(family) > 1:
        family_index(out, [p.rstrip("/") for p, _ in family])
        written.insert(0, out / "index.html")
    return written


def _final_metrics(run_dir: Path) -> dict[str, Any]:
    # the metrics of the run's summary.json ({} where it has none)
    summary = read_json(run_dir / SUMMARY)
    summary = summary.get("metrics") if isinstance(summary, dict) else None  # a summary.json is data: any shape
    return summary if isinstance(summary, dict) else {}


@torch.no_grad()
def _look(
    family: list[tuple[str, nn.Module]],
    inputs: _Text | _Rows,
    stats: dict[str, LatentStats],
    tokens: int,
    device: torch.device,
    batch_rows: int,
    rows_of: Callable[[torch.Tensor, str], torch.Tensor] | None,
    phase: _Phase,
) -> int:
    # the pass: every SAE of the family encodes each batch of the inputs into its `stats`; returns the rows seen
    first, batches = 0, None
    for acts in inputs.batches():
        batches = batches or -(-tokens // len(acts))  # the pass's length, from its first batch's rows
        for chunk in acts.to(device).split(batch_rows):
            for prefix, sae in family:
                x = rows_of(chunk, prefix.rstrip("/")) if rows_of else sae.split(chunk)[0]
                stats[prefix].add(*sae.codes(x), first)
            first += len(chunk)
        phase.step(batches)
    phase.end()
    return first


def _family_views(family: list[tuple[str, nn.Module]], inputs: Any, working: Callable | None) -> dict[str, Any]:
    # each SAE's weights' views (its prefix: them), as the build's second phase
    lens = inputs.unembedding() if isinstance(inputs, _Text) else None
    weighing = _Phase(working, "weights", sum(-(-s.n_latents // LATENTS) * (1 + (lens is not None)) for _, s in family))
    views = {prefix: _weights_views(sae, inputs, lens, weighing.step) for prefix, sae in family}
    weighing.end()
    return views


def _weights_views(sae: nn.Module, inputs: Any, found: tuple | None, each: Callable[[], None]) -> dict[str, Any]:
    # what the weights alone say: neighbours, the logit lens (`found`: the source's unembedding, final norm's gain and
    # tying), true features (synthetic); `each` hears of every LATENTS latents done
    W_dec = sae.W_dec.detach().cpu()
    near, cos = nearest(W_dec, each=each)
    views: dict[str, Any] = {"near": near, "near_cos": cos, "lens": None, "truth": None}
    if found is not None:
        unembed, gain, tied = found
        # a cross-layer transcoder's row writes to several layers: the lens reads its own layer's block, the first
        own = W_dec[:, : unembed.shape[1]]
        views["lens"] = logit_lens(own, unembed.cpu(), None if gain is None else gain.detach().cpu(), each=each)
        views["tied"] = tied
    if isinstance(inputs, _Rows):
        val = inputs.data.splits.get("val")
        # a transcoder's decoder writes the target's directions; an SAE's, the input's
        truth = getattr(val, "true_targets" if getattr(sae, "transcoder", False) else "true_features", None)
        if truth is not None:
            views["truth"] = best_matches(W_dec, truth.cpu())
    return views
