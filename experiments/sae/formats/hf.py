"""A Hugging Face repository folder of SAEs, ready for `huggingface_hub.upload_folder` (runner.tools.export
format=hf): each SAE in SAELens's layout (experiments/sae/formats/saelens.py) in a folder named by its hook point
(SAELens's `sae_id`), and a README.md model card (`hub_card`) naming the source model (by its publishing name, never a
local path: runner.tools.published), hook, width, k, the data and the run's metrics, what it quotes escaped (markdown
and HTML stay text). Nothing is uploaded: that is the user's call."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from experiments.sae.formats.common import CFG
from experiments.sae.formats.saelens import METADATA, WIDTHS, hook_name
from experiments.sae.metrics import summary_metric
from runner.rundir import write_atomic

CARD_METRICS = {  # the run's summary metrics a card quotes, by what it calls them
    "fve": "explained variance (held out)",
    "l0": "L0",
    "dead_fraction": "dead fraction (never fired on the validation split)",
    "loss_recovered": "loss recovered (zero ablation)",
    "kl_spliced": "KL spliced (nats/token)",
}


def sae_id(hook: str | None, name: str | None = None) -> str:
    """The folder of an SAE in a repository: its hook point as SAELens names it (its `sae_id`), else its name."""
    return hook_name(hook) or name or "sae"


def hub_card(out: Path, folders: dict[Path, str], cfg: Any, summary: dict[str, Any] | None) -> Path:
    """Write `out`/README.md, the model card of a repository holding SAELens folders (their cfg.json say what each
    is), each with the prefix of its metrics in the run's summary (a family's SAE name and "/"; one SAE: ""), trained
    by the run whose quoted config (plain data, with its `publish` names: runner.tools.published) is `cfg` and whose
    summary.json is `summary`; returns its path. What it quotes is escaped: markdown and HTML in them stay text."""
    summary, publish = summary if isinstance(summary, dict) else {}, cfg.get("publish") or {}
    metrics, progress = ({} if not isinstance(v := summary.get(k), dict) else v for k in ("metrics", "progress"))
    data = cfg.get("data") or {}
    rows, models = [], set()
    for folder, prefix in folders.items():
        saelens = json.loads((folder / CFG).read_text())
        meta = saelens.get("metadata") or {}
        models.add(meta.get(METADATA["model"]))
        quoted = [summary_metric(metrics, f"val/{prefix}{key}") for key in CARD_METRICS]
        cells = [_code(folder.relative_to(out), cell=True), _md(saelens["architecture"]),
                 _code(meta.get(METADATA["hook"]), cell=True), str(saelens[WIDTHS["d_in"]]),
                 f"{saelens[WIDTHS['n_latents']]:,}", str(saelens.get(WIDTHS["k"], "-")),
                 *(f"{v:.4g}" if _number(v) else "-" for v in quoted)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    model = publish.get("model_name") or ", ".join(sorted(str(m) for m in models if m))
    head = ["sae_id (folder)", "architecture", "hook", "d_in", "width", "k", *CARD_METRICS.values()]
    counts = [(progress.get(k), k) for k in ("step", "samples", "tokens")]
    trained = ", ".join(f"{n:,} {k.rstrip('s')}{'' if n == 1 else 's'}" for n, k in counts if _number(n, True) and n)
    title = f"{_md(publish['sae_set'])}: sparse autoencoders" if publish.get("sae_set") else "Sparse autoencoders"
    text = [
        "---",
        "library_name: saelens",
        "tags:\n- sparse-autoencoder\n- mechanistic-interpretability\n- runner",
        "---",
        "",
        f"# {title}" + (f" of {_md(model)}" if model else ""),
        "",
        f"Trained with runner{f' on the activations of {_code(model)}' if model else ''} at the hook points below"
        + (f" ({trained})." if trained else "."),
        f"Data: {_data_words(data)}.",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
        *rows,
        "",
        "Metrics are the run's last validation (its summary.json); each folder is SAELens's layout, so:",
        "",
        "```python",
        "from sae_lens import SAE",
        f"sae = SAE.load_from_disk({json.dumps(str(next(iter(folders)).relative_to(out)))})  # in a clone of this "
        "repository",
        "```",
        "",
        "or, with runner, `SAE.load_from_disk(path)` (experiments.sae.coders.base.SAE).",
        "",
    ]
    path = out / "README.md"
    write_atomic(path, "\n".join(text).encode())
    return path


def _number(value: Any, whole: bool = False) -> bool:
    # a figure the card can print (a summary.json is data: a string there is none)
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return False
    return whole or math.isfinite(value)


def _md(value: Any) -> str:
    # a value as markdown text on one line: what would be markup (HTML, links, emphasis, a table's cell break) is
    # escaped into text
    return re.sub(r"([\\`*_{}\[\]<>()#+!|~&])", r"\\\1", re.sub(r"[\x00-\x1f\x7f]", " ", str(value)))


def _code(value: Any, cell: bool = False) -> str:
    # a value as an inline code span, whose HTML and markdown stay text: a fence longer than any run of backticks in
    # it, on one line, and in a table's cell `|` escaped (GFM splits a row into cells before anything else)
    text = re.sub(r"[\x00-\x1f\x7f]", " ", str(value))
    text = text.replace("|", "\\|") if cell else text
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _data_words(data: Any) -> str:
    # what a card says the SAEs were trained on, from the run's quoted data config
    if data.get("checkpoint") is None:
        return f"{_md(data.get('_target_', 'activations'))} rows"
    words = f"activations of {_code(data.get('module'))} of {_code(data.get('checkpoint'))}"
    inputs = data.get("inputs") if isinstance(data.get("inputs"), dict) else {}
    text = inputs.get("dataset") or inputs.get("paths")
    if text:  # free text, escaped (a path's characters would be a link, emphasis or HTML)
        words += f", on the text of {_md(', '.join(map(str, text)) if isinstance(text, list) else text)}"
    if _number(data.get("samples_per_epoch"), True) and data["samples_per_epoch"] > 0:
        words += f", {data['samples_per_epoch']:,} positions an epoch"
    return words
