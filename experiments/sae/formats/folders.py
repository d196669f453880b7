"""A folder of either format, written (`export`) and read (`read_folder`), and whether a folder is one
(`recognizes`). runner's SAE scales its inputs by `input_scale` s_in inside (E||x|| = sqrt(d)) and its target by s_out
(a transcoder's `target_scale`; an SAE's target is its input, s_out = s_in); a folder takes raw inputs and returns the
raw target instead. Its codes are runner's divided by s_out, so the decoder rows stay as trained (unit norm): W_enc and
W_skip are multiplied by s_in / s_out (1 for an SAE), and b_enc, b_dec and any threshold divided by s_out. The top-k
picks the same latents, and the output is runner's to float rounding (tests/unit/test_sae_export.py; with the real
packages, tests/e2e/test_sae_peers_load.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

import experiments.sae.formats.circuit_tracer as circuit_tracer
import experiments.sae.formats.circuit_tracer_clt as circuit_tracer_clt
import experiments.sae.formats.gemma_scope_clt as gemma_scope_clt
import experiments.sae.formats.saelens as saelens
import experiments.sae.formats.sparsify as sparsify
from experiments.sae.formats.common import CFG, architecture, empty_folder, read_cfg, read_tensors, refuse
from runner import ConfigError

# hf: a Hugging Face repository folder of SAELens folders and a model card; circuit_tracer: a transcoder set's or
# a cross-layer transcoder's folder (circuit_tracer.py; a CLT is written by CrossLayerTranscoder.export)
FORMATS = ("saelens", "sparsify", "hf", "circuit_tracer")
LAYOUTS = {"saelens": saelens, "sparsify": sparsify}  # each: its WEIGHTS file, write and read


def export(
    sae: nn.Module,
    fmt: str,
    out: Path,
    hook: str | None = None,
    model: str | None = None,
    target: str | None = None,
    rows: Any = None,
    skip_positions: int = 0,
) -> Path:
    """Write `sae` in format `fmt` to the folder `out` (made here; refused if it holds files); returns `out`. `hook`
    names the module it reads, `target` a transcoder's target module, `model` the source model (SAELens metadata);
    `rows`, held-out raw rows a TopK transcoder's circuit-tracer threshold is calibrated on; `skip_positions`, the
    first positions it was not trained on (circuit-tracer's folder keeps them for runner's attribution graphs)."""
    if fmt == "circuit_tracer":
        circuit_tracer.write_transcoder(sae, empty_folder(out), hook, model, target, rows, skip_positions)
        return out
    if fmt not in LAYOUTS:  # a repository (hf) is SAELens folders and a card: SAE.export writes one
        raise ConfigError(f"--format {fmt}: give one of {', '.join(FORMATS)}")
    kind = architecture(sae)
    refuse(sae, fmt, kind)
    LAYOUTS[fmt].write(sae, kind, empty_folder(out), hook, model, target)
    return out


def _hook_folders(path: Path) -> list[str]:
    # a sparsify training run: one folder per hook point, each with its cfg.json and sae.safetensors
    return sorted(
        p.name for p in path.iterdir() if p.is_dir() and (p / CFG).is_file() and (p / sparsify.WEIGHTS).is_file()
    )


def read_folder(path: str | Path, hook: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The SAE in `path` as a runner SAE in eval mode, and what its folder says: {"format", "architecture",
    "hook" (the hook point it names, or None), "hook_out" (a transcoder's target), "model" (the model's name)}.
    A sparsify run of several hook points takes `hook`, the name of one of its folders."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is no folder: give an SAE folder of SAELens or sparsify (cfg.json and its weights)")
    if gemma_scope_clt.holds(path):  # Gemma Scope 2's CLT: params_layer_N files, circuit-tracer's config.yaml or none
        coder, facts = gemma_scope_clt.read(path)
        return coder.eval().requires_grad_(False), facts
    if (path / circuit_tracer.CONFIG).exists() and not (path / CFG).is_file():  # circuit-tracer's: config.yaml
        coder, facts = circuit_tracer_clt.read(path, hook)
        return coder.eval().requires_grad_(False), facts
    single = (path / CFG).is_file()
    if not single:
        hooks = _hook_folders(path)
        if not hooks:
            raise ConfigError(f"{path} has no cfg.json: give an SAE folder of SAELens or sparsify, or a runner run")
        if hook not in hooks:
            raise ConfigError(f"{path} holds the SAEs of several hook points {hooks}: pick one, e.g. hook={hooks[0]}")
        path = path / hook
    cfg = read_cfg(path / CFG)
    layout = next((layout for layout in LAYOUTS.values() if (path / layout.WEIGHTS).is_file()), None)
    if layout is None:
        raise ConfigError(
            f"{path} has a cfg.json but neither {saelens.WEIGHTS} (SAELens) nor {sparsify.WEIGHTS} (sparsify)"
        )
    sae, facts = layout.read(cfg, read_tensors(path / layout.WEIGHTS), path)
    if layout is sparsify:
        facts["hook"] = path.name  # sparsify names each SAE's folder by its hook point
    facts["weights"] = str(path / layout.WEIGHTS)
    if single and hook is not None and hook != facts["hook"]:
        # the folder's SAE was trained at its own hook point: reading it at another is module=, checked on the model
        own = f"of the hook point {facts['hook']!r}" if facts["hook"] else "whose folder names no hook point"
        raise ConfigError(
            f"hook={hook}: {path} holds one SAE, {own}, and hook= picks one SAE of a sparsify run of several: leave "
            "hook= out (module=MODULE reads the SAE at a module of the source model you name)"
        )
    return sae.eval().requires_grad_(False), facts


def recognizes(path: Path) -> bool:
    """Whether `path` (no runner run: runner.load has asked) is an SAE folder of either format (cfg.json), a
    sparsify run's folders of them, circuit-tracer's folder (config.yaml) or Gemma Scope 2's CLT files."""
    return (
        (path / CFG).is_file()
        or (path / circuit_tracer.CONFIG).exists()
        or (path / gemma_scope_clt.FILE.format(i=0)).exists()
        or any((p / CFG).is_file() for p in path.iterdir() if p.is_dir())
    )


def solo(path: str | Path, hook: str | None = None) -> nn.Module:
    """The SAE of the folder `path` alone, without the model it reads."""
    return read_folder(path, hook)[0]
