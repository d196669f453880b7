"""A trained SAE or transcoder in the folder layout that SAELens or EleutherAI's sparsify loads (runner.export).

- SAELens: `cfg.json` + `sae_weights.safetensors` (W_enc [d_in, n], b_enc, W_dec [n, d_out], b_dec [d_out],
  `threshold` for jumprelu, W_skip [d_out, d_in] for a skip transcoder); `sae_lens.SAE.load_from_disk(DIR)` loads it,
  and its forward(x) is the reconstruction (a transcoder's: the predicted target).
- sparsify: `cfg.json` + `sae.safetensors` (encoder.weight [n, d], encoder.bias, W_dec [n, d], b_dec, W_skip [d, d]
  with skip_connection); `sparsify.SparseCoder.load_from_disk(DIR)` loads it, and `forward(x).sae_out` is the
  reconstruction (a transcoder's target `y` only enters its losses).

runner's SAE scales its inputs by `input_scale` s_in inside (E||x|| = sqrt(d)) and its target by s_out (a transcoder's
`target_scale`; an SAE's target is its input, s_out = s_in); the export takes raw inputs and returns the raw target
instead. Its codes are runner's divided by s_out, so the decoder rows stay as trained (unit norm): W_enc and W_skip are
multiplied by s_in / s_out (1 for an SAE), and b_enc, b_dec and any threshold divided by s_out. The top-k picks the same
latents, and the output is runner's to float rounding (tests/unit/test_sae_export.py; with the real packages,
tests/e2e/test_sae_peers_load.py).

Which architecture becomes which:
- TopK, and Matryoshka on TopK codes: `topk` in both tools.
- BatchTopK, and Matryoshka on BatchTopK codes: SAELens `jumprelu`, every latent at the learned global threshold (what
  their inference is).
- JumpReLU: `jumprelu`. ReLU: SAELens `standard`. Gated: SAELens `gated` (b_enc written as b_gate, with r_mag and
  b_mag; SAELens has no gated transcoder, so a gated transcoder is refused).
- sparsify has top-k only: anything else is refused, with the format that takes it.
- hf: a Hugging Face repository folder, ready for `huggingface_hub.upload_folder`: each SAE in SAELens's layout in a
  folder named by its hook point (SAELens's `sae_id`), and a README.md model card (`hub_card`) naming the source
  model (by its publishing name, never a local path: runner.published), hook, width, k, the data and the run's
  metrics, what it quotes escaped (markdown and HTML stay text). Nothing is uploaded: that is the user's call.
- Transcoders: SAELens's `transcoder` (ReLU) and `jumprelu_transcoder` (JumpReLU, BatchTopK), with a skip connection
  `skip_transcoder` and `jumprelu_skip_transcoder`; their encoders read the input uncentred
  (`apply_b_dec_to_input` false), as runner's do. SAELens has no top-k transcoder: sparsify's (`transcode`, and
  `skip_connection`) takes it, but its coders' outputs are as wide as their inputs, so only where d_out = d_in.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from experiments.sae.metrics import summary_metric
from runner import ConfigError
from runner.rundir import write_atomic

FORMATS = ("saelens", "sparsify", "hf")  # hf: a Hugging Face repository folder of SAELens folders and a model card
# SAELens's transcoder classes, by (inference, skip connection); it has no top-k one
TRANSCODERS = {
    ("standard", False): "transcoder",
    ("standard", True): "skip_transcoder",
    ("jumprelu", False): "jumprelu_transcoder",
    ("jumprelu", True): "jumprelu_skip_transcoder",
}


def architecture(sae: nn.Module) -> str:
    """What the SAE's inference is, in SAELens's names (its class's `inference`): topk, jumprelu, standard or gated."""
    kind = getattr(sae, "inference", None)
    if kind not in ("topk", "jumprelu", "standard", "gated"):
        raise ConfigError(f"{type(sae).__name__} has no counterpart in SAELens or sparsify to export to")
    return kind


def _refuse(sae: nn.Module, fmt: str, kind: str) -> None:
    # what a format has no class for, refused with the format that has one (or that neither has)
    name, square = type(sae).__name__, sae.d_out == sae.d_in
    if sae.transcoder and kind == "gated":
        raise ConfigError(
            f"neither format takes {name}, a gated transcoder: SAELens has no gated transcoder (gated SAEs "
            "only), sparsify top-k coders only"
        )
    if fmt == "sparsify" and kind != "topk":
        raise ConfigError(f"sparsify has top-k SAEs only; this is {name} ({kind} at inference): --format saelens")
    if fmt == "sparsify" and not square:  # a top-k transcoder, then: SAELens has none either
        raise ConfigError(
            f"neither format takes {name}, a top-k transcoder from width {sae.d_in} to {sae.d_out}: sparsify's "
            "transcoders predict a target as wide as their input, and SAELens has no top-k transcoder"
        )
    if fmt == "saelens" and sae.transcoder and kind == "topk":
        where = "--format sparsify" if square else f"neither format takes one from width {sae.d_in} to {sae.d_out}"
        raise ConfigError(f"SAELens has no top-k transcoder ({name}): {where}")


@torch.no_grad()
def raw_unit_weights(sae: nn.Module) -> dict[str, torch.Tensor]:
    """W_enc, b_enc, W_dec, b_dec (and threshold, W_skip [d_in, d_out]) of the same SAE on raw inputs and target:
    codes divided by the target's scale."""
    s_in, s_out = sae.input_scale.double(), sae.out_scale.double()
    ratio = s_in / s_out  # exactly 1 for an SAE: its W_enc is written bit for bit as trained
    weights = {
        "W_enc": sae.W_enc.double() * ratio,
        "b_enc": sae.b_enc.double() / s_out,
        "W_dec": sae.W_dec.double(),
        "b_dec": sae.b_dec.double() / s_out,
    }
    if architecture(sae) == "jumprelu":  # JumpReLU's per latent; BatchTopK's one global threshold for every latent
        weights["threshold"] = sae.threshold.expand(sae.n_latents).double() / s_out
    if architecture(sae) == "gated":  # b_enc is the gate's bias; exp(r_mag) scales W_enc's columns: scale-free
        weights.update(b_gate=weights.pop("b_enc"), r_mag=sae.r_mag.double(), b_mag=sae.b_mag.double() / s_out)
    if sae.skip:
        weights["W_skip"] = sae.W_skip.double() * ratio
    return {name: tensor.float().contiguous().clone() for name, tensor in weights.items()}


def export(
    sae: nn.Module,
    fmt: str,
    out: Path,
    hook: str | None = None,
    model: str | None = None,
    target: str | None = None,
) -> Path:
    """Write `sae` in format `fmt` to the folder `out` (made here; refused if it holds files); returns `out`. `hook`
    names the module it reads, `target` a transcoder's target module, `model` the source model (SAELens metadata)."""
    if fmt not in FORMATS[:2]:  # a repository (hf) is SAELens folders and a card: SAE.export writes one
        raise ConfigError(f"--format {fmt}: give one of {', '.join(FORMATS)}")
    kind = architecture(sae)
    _refuse(sae, fmt, kind)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: give an empty or new folder (nothing was written)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already holds files: give an empty or new folder (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    weights = raw_unit_weights(sae)
    if "W_skip" in weights:  # both peers keep it as [d_out, d_in] and add x @ W_skip.T
        weights["W_skip"] = weights["W_skip"].t().contiguous()
    if fmt == "saelens":
        write_atomic(out / "sae_weights.safetensors", save(weights))
        _write(out / "cfg.json", _saelens_cfg(sae, kind, hook, model, target))
    else:
        names = {"W_enc": "encoder.weight", "b_enc": "encoder.bias"}  # the others keep their names
        tensors = {names.get(k, k): (v.t().contiguous() if k == "W_enc" else v) for k, v in weights.items()}
        write_atomic(out / "sae.safetensors", save(tensors))
        _write(out / "cfg.json", _sparsify_cfg(sae))
    return out


def _hook_name(hook: str | None) -> str | None:
    # the residual stream after a block is what TransformerLens names blocks.N.hook_resid_post
    return f"{hook}.hook_resid_post" if hook and hook.startswith("blocks.") and hook.count(".") == 1 else hook


def _saelens_cfg(sae: nn.Module, kind: str, hook: str | None, model: str | None, target: str | None) -> dict[str, Any]:
    hook_name = _hook_name(hook)
    cfg: dict[str, Any] = {
        "d_in": sae.d_in,
        "d_sae": sae.n_latents,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",  # runner's input scale is folded into the weights
        "reshape_activations": "none",
        # Without a version a cfg counts as older than SAELens 6, whose loader then keeps none of the metadata
        # (hook_name and model_name came back None): the layout written here is SAELens 6's
        "metadata": {"hook_name": hook_name, "model_name": model, "sae_lens_version": "6.0.0"},
        "architecture": kind,
    }
    if kind == "topk":
        cfg.update(k=sae.k, rescale_acts_by_decoder_norm=False)
    if sae.transcoder:
        # its encoder reads the input uncentred (b_dec is the target's); SAELens refuses a transcoder that says
        # otherwise. hook_name_out is where SAELens's hooked models put the prediction.
        cfg.update(apply_b_dec_to_input=False, d_out=sae.d_out, architecture=TRANSCODERS[kind, sae.skip])
        cfg["metadata"]["hook_name_out"] = _hook_name(target)
    return cfg


def _sparsify_cfg(sae: nn.Module) -> dict[str, Any]:
    return {
        "activation": "topk",
        "expansion_factor": max(1, sae.n_latents // sae.d_in),
        "normalize_decoder": True,
        "num_latents": sae.n_latents,
        "k": sae.k,
        "multi_topk": False,
        "skip_connection": sae.skip,
        "transcode": sae.transcoder,
        "d_in": sae.d_in,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    # renamed into place (as the weights): a symlink at the name is replaced, never written through
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


CARD_METRICS = {  # the run's summary metrics a card quotes, by what it calls them
    "fve": "explained variance (held out)",
    "l0": "L0",
    "dead_fraction": "dead fraction (never fired on the validation split)",
    "loss_recovered": "loss recovered (zero ablation)",
    "kl_spliced": "KL spliced (nats/token)",
}


def sae_id(hook: str | None, name: str | None = None) -> str:
    """The folder of an SAE in a repository: its hook point as SAELens names it (its `sae_id`), else its name."""
    return _hook_name(hook) or name or "sae"


def hub_card(out: Path, folders: dict[Path, str], cfg: Any, summary: dict[str, Any] | None) -> Path:
    """Write `out`/README.md, the model card of a repository holding SAELens folders (their cfg.json say what each
    is), each with the prefix of its metrics in the run's summary (a family's SAE name and "/"; one SAE: ""), trained
    by the run whose quoted config (plain data, with its `publish` names: runner.published) is `cfg` and whose
    summary.json is `summary`; returns its path. What it quotes is escaped: markdown and HTML in them stay text."""
    summary, publish = summary if isinstance(summary, dict) else {}, cfg.get("publish") or {}
    metrics, progress = ({} if not isinstance(v := summary.get(k), dict) else v for k in ("metrics", "progress"))
    data = cfg.get("data") or {}
    rows, models = [], set()
    for folder, prefix in folders.items():
        saelens = json.loads((folder / "cfg.json").read_text())
        meta = saelens.get("metadata") or {}
        models.add(meta.get("model_name"))
        quoted = [summary_metric(metrics, f"val/{prefix}{key}") for key in CARD_METRICS]
        cells = [_code(folder.relative_to(out), cell=True), _md(saelens["architecture"]),
                 _code(meta.get("hook_name"), cell=True), str(saelens["d_in"]), f"{saelens['d_sae']:,}",
                 str(saelens.get("k", "-")), *(f"{v:.4g}" if _number(v) else "-" for v in quoted)]  # fmt: skip
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
