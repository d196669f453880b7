"""Every evaluation of one SAE (or transcoder) on its source model, written as `eval.json` and `index.html` in one
folder (runner.sae_eval): the coder and its source come as runner's tools get them (runner.load.load_model: a run,
or an SAE folder of SAELens or sparsify attached to its model). The replacement evaluation reads a coder set instead
(a CLT, or a transcoder per block: replacement.py's Circuits)."""

from __future__ import annotations

import html
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from experiments.sae.sources.hooked import hooks_a_model
from experiments.sae.sources.source import SourceModel, hooked_source
from runner import ConfigError
from runner.rundir import write_atomic, write_json
from runner.tools.published import plain

EVALS = ("core", "probing", "absorption", "replacement", "ground_truth")
SINGLE = EVALS[:3]  # the default evaluations of one coder; replacement reads a set
# ground_truth: an SAE of synthetic data against its true features and codes
ONE_CODER = (*SINGLE, "ground_truth")


def source_of(cfg: DictConfig, device: torch.device) -> SourceModel:
    """The source model a coder of run config `cfg` reads (its data's hooked modules), on `device`."""
    data = cfg.data
    if not hooks_a_model(data):
        raise ConfigError(
            "the SAE's run read activations from a file or a generator, not a model: the evaluations splice it into "
            "its source model and read that model's text (an SAE of +experiment=sae_lm or sae_hf, or an imported "
            "one with source=); an SAE of data=synth_sae_bench is scored by evals=[ground_truth]"
        )
    return hooked_source(data, device)


def evaluate(
    sae: nn.Module | None,
    cfg: DictConfig,
    out: Path,
    evals: tuple[str, ...] = EVALS,
    tokens: int = 1_000_000,
    splice_tokens: int = 200_000,
    probe_tokens: int = 300_000,
    device: str = "cpu",
    working: Any = None,
    quoted: dict[str, Any] | None = None,
    circuits: Any = None,
) -> dict[str, Any]:
    """Run `evals` on `sae` of config `cfg` (None: replacement alone, on `circuits`), write out/eval.json and
    out/index.html; the results. What they say of the coder's source comes from `quoted`, the run's config as plain
    data (runner.tools.published.quoted_config; default: `cfg`'s), never a resolver's value."""
    started = time.perf_counter()
    # ground_truth regenerates the run's own synthetic data: the others read a source model
    source = source_of(cfg, torch.device(device)) if set(evals) - {"ground_truth"} else None
    if sae is not None:
        sae.to(device)
    coder = circuits.describe() if sae is None else _describe(sae, plain(cfg) if quoted is None else quoted)
    result: dict[str, Any] = {"coder": coder, "evals": {}}
    for name in evals:
        progress = (lambda done, total, name=name: working(name, done, total)) if working else None
        if name == "core":
            from experiments.sae.evals.core import core  # noqa: PLC0415

            result["evals"]["core"] = core(sae, source, tokens, min(splice_tokens, tokens), progress)
        elif name == "probing":
            from experiments.sae.evals.probing import sparse_probing  # noqa: PLC0415

            result["evals"]["probing"] = sparse_probing(sae, source, probe_tokens, progress)
        elif name == "absorption":
            from experiments.sae.evals.absorption import absorption  # noqa: PLC0415

            result["evals"]["absorption"] = absorption(sae, source, progress)
        elif name == "replacement":
            from experiments.sae.evals.replacement import replacement  # noqa: PLC0415

            result["evals"]["replacement"] = replacement(circuits, source, progress)
        elif name == "ground_truth":
            from experiments.sae.evals.ground_truth import ground_truth  # noqa: PLC0415

            result["evals"]["ground_truth"] = ground_truth(sae, cfg, tokens, device, progress)
    result["seconds"] = round(time.perf_counter() - started, 2)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "eval.json", _finite(result))
    write_atomic(out / "index.html", page(result).encode())
    return result


def _describe(sae: nn.Module, quoted: dict[str, Any]) -> dict[str, Any]:
    source, imported, data = (quoted.get(key) or {} for key in ("source", "imported", "data"))
    return {
        "class": type(sae).__name__,
        "d_in": sae.d_in,
        "d_out": sae.d_out,
        "n_latents": sae.n_latents,
        "k": getattr(sae, "k", None),
        "source": str(data.get("checkpoint")),
        "module": str(data.get("module")),
        "target": data.get("target"),
        "imported_from": imported or None,
        "skip_positions": source.get("skip_positions", data.get("skip_positions", 0)),
    }


def _finite(value: Any) -> Any:
    # JSON has no NaN: a metric that is undefined is written as null (the notes say why)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _table(title: str, rows: dict[str, Any]) -> str:
    cells = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>"
        for k, v in rows.items()
        if not isinstance(v, (dict, list))
    )
    return f"<h2>{html.escape(title)}</h2><table>{cells}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.6g}"
    return html.escape(str(value))


def _histogram(hist: dict[str, Any]) -> str:
    # log10 density bars as inline SVG, the count on the y axis (no script needed)
    counts, edges = hist["counts"], hist["log10_edges"]
    top, w, h = max(counts + [1]), 12, 120
    bars = "".join(
        f'<rect x="{40 + i * w}" y="{h - h * c / top:.1f}" width="{w - 1}" height="{h * c / top:.1f}">'
        f"<title>10^{edges[i]:.2f}..10^{edges[i + 1]:.2f}: {c}</title></rect>"
        for i, c in enumerate(counts)
    )
    axis = f'<text x="0" y="10">{top}</text><text x="0" y="{h}">0</text>'
    labels = "".join(f'<text x="{40 + i * w}" y="{h + 14}">{edges[i]:g}</text>' for i in range(0, len(counts) + 1, 8))
    width = 40 + w * len(counts) + 20
    return (
        f"<h3>Latent density (log10 fraction of positions; {hist['never_fired']} never fired)</h3>"
        f'<svg width="{width}" height="{h + 20}" font-size="10">{axis}{bars}{labels}</svg>'
    )


def page(result: dict[str, Any]) -> str:
    """The results as one static HTML page (no script)."""
    parts = [_table("Coder", result["coder"])]
    for name, got in result["evals"].items():
        for section, rows in got.items():
            if isinstance(rows, dict) and section != "tasks":
                parts.append(_table(f"{name}: {section}", rows))
        if name == "core":
            parts.append(_histogram(got["sparsity"]["density_histogram"]))
            parts += [f"<p>note: {html.escape(n)}</p>" for n in got["downstream"]["notes"]]
        for task, rows in (got.get("tasks") or {}).items():
            parts.append(_table(f"{name}: {task}", rows))
        parts += [f"<p>{html.escape(n)}</p>" for n in got.get("notes", []) if name != "core"]
    style = "body{font:14px sans-serif;margin:2em}td{padding:2px 12px}rect{fill:#4a7}"
    body = "".join(parts)
    return f"<!doctype html><meta charset=utf-8><title>SAE evaluation</title><style>{style}</style>{body}\n"


def dumps(result: dict[str, Any]) -> str:
    """The results' headline numbers, one per line, for the console."""
    lines = []
    for name, got in result["evals"].items():
        for section, rows in got.items():
            if isinstance(rows, dict) and section not in ("density_histogram",):
                for key, value in rows.items():
                    if isinstance(value, (int, float)):
                        lines.append(f"{name}/{section}/{key:<32} {_fmt(float(value))}")
    return "\n".join(lines) + "\n" + json.dumps({"seconds": result["seconds"]})
