"""circuit-tracer's folder (safety-research/circuit-tracer 0.5.0), out and in: `config.yaml` and, for a transcoder
set (`model_kind: transcoder_set`), one `layer_{i}.safetensors` per layer, or for a cross-layer transcoder
(`model_kind: cross_layer_transcoder`) `W_enc_{i}.safetensors` and `W_dec_{i}.safetensors` per layer. The names and
shapes are its loaders' (LAYER, CLT below; circuit_tracer/transcoder/single_layer_transcoder.py load_relu_transcoder,
cross_layer_transcoder.py _load_state_dict, utils/caching.py load_transcoders_from_cache); a folder is read as YAML
and safetensors data only, never with circuit-tracer's code.

circuit-tracer reads raw activations: runner's input and target scales are folded into the weights (formats/common.py
raw_unit_weights; a CLT's per-layer scales by `fold`). Its codes are ReLU or JumpReLU (`activation_function.threshold`,
`threshold_{i}`): runner's ReLU, JumpReLU and BatchTopK (at inference: JumpReLU at its global threshold) coders are
written exactly; a TopK coder's inference (the k largest) is no threshold, so circuit-tracer gets a JumpReLU whose
per-layer threshold is calibrated on held-out rows to the TopK's mean L0 (calibration.py), its FVE and L0 cost written
into config.yaml. A per-layer TopK transcoder keeps its `k` in config.yaml's `runner` mapping, which circuit-tracer
ignores and runner reads back as the exact TopK; a TopK CLT is read back as the JumpReLU written. Gated coders, SAEs
(circuit-tracer replaces MLPs: transcoders only) and transcoders whose target is not as wide as their input
(circuit-tracer sizes W_enc by b_dec) are refused."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import save
from torch import nn

from experiments.sae.formats.calibration import calibrate_layer
from experiments.sae.formats.common import MAX_CFG, build, raw_unit_weights, read_tensors
from runner import ConfigError
from runner.rundir import write_atomic

CONFIG = "config.yaml"
KINDS = ("transcoder_set", "cross_layer_transcoder")  # config.yaml's model_kind (utils/hf_utils.py load_transcoders)
# config.yaml: what circuit-tracer reads (model_kind, the hooks; model_name: circuit_tracer/__main__.py), and runner's
KEYS = ("model_kind", "feature_input_hook", "feature_output_hook", "model_name", "runner")
LAYER_FILE, ENC_FILE, DEC_FILE = "layer_{i}.safetensors", "W_enc_{i}.safetensors", "W_dec_{i}.safetensors"
THRESHOLD = "activation_function.threshold"  # a JumpReLU's, nested in its activation module (load_relu_transcoder)
# a per-layer transcoder's file: tensor -> (runner's parameter, shape in runner's widths, stored transposed)
LAYER = {
    "W_enc": ("W_enc", ("n_latents", "d_model"), True),  # F.linear(x, W_enc, b_enc)
    "W_dec": ("W_dec", ("n_latents", "d_model"), False),  # acts @ W_dec + b_dec
    "b_enc": ("b_enc", ("n_latents",), False),
    "b_dec": ("b_dec", ("d_model",), False),
    THRESHOLD: ("threshold", ("n_latents",), False),  # JumpReLU only
    "W_skip": ("W_skip", ("d_model", "d_model"), True),  # input_acts @ W_skip.T; skip transcoders only
}
# a CLT's layer i: W_enc_{i}, b_enc_{i}, b_dec_{i} (the bias of layer i's output), threshold_{i} (JumpReLU) in
# ENC_FILE; W_dec_{i} [n, L - i, d] in DEC_FILE, its row j what the latent writes to layer i + j
CLT = {
    "W_enc_{i}": ("W_enc", ("n_latents", "d_model"), True),
    "b_enc_{i}": ("b_enc", ("n_latents",), False),
    "b_dec_{i}": ("b_dec", ("d_model",), False),
    "threshold_{i}": ("threshold", ("n_latents",), False),
    "W_dec_{i}": ("W_dec", ("n_latents", "later", "d_model"), False),
}
CODES = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}  # runner's inference -> config's runner.code
# runner's modules -> circuit-tracer's hook in a block (TransformerLens names): the MLP's input and output
# mlp.hook_in: the MLP's input as circuit-tracer hooks it (its ReplacementMLP's), the norm's output; not
# ln2.hook_normalized, TransformerLens's stream before ln2's gain and bias
INPUT_HOOK, OUTPUT_HOOK = "mlp.hook_in", "hook_mlp_out"
HOOKS = {INPUT_HOOK: ("mlp_norm", "ln_2", "ln2", "post_attention_layernorm"), OUTPUT_HOOK: ("mlp", "feed_forward")}
MAX_LAYERS = 1024


def block_hook(module: str | None, default: str) -> tuple[int | None, str]:
    """(block index, circuit-tracer's hook in the block) of a runner module name, e.g. blocks.2.mlp_norm -> (2,
    mlp.hook_in); a TransformerLens name keeps its own; else (None, `default`)."""
    found = re.search(r"\.(\d+)\.(.+)$", module or "")
    if not found:
        return None, default
    part = found.group(2)
    return int(found.group(1)), next((hook for hook, parts in HOOKS.items() if part in parts), part)


def checked_coder(coder: nn.Module, what: str, d_out: int | None = None) -> str:
    """The code type circuit-tracer gets of `coder` (relu, jumprelu or topk; `d_out`: its target's width, a CLT's
    layer's), or refused in one line why not."""
    d_out = d_out or coder.d_out
    kind = getattr(coder, "inference", None)
    if kind not in CODES:
        raise ConfigError(f"format=circuit_tracer: {what} is {type(coder).__name__}, whose codes circuit-tracer has "
                          "no way to express (its coders are ReLU or JumpReLU; runner converts TopK)")  # fmt: skip
    if not coder.transcoder or d_out != coder.d_in:
        why = (
            "an SAE (circuit-tracer replaces MLPs with transcoders)"
            if not coder.transcoder
            else (f"a transcoder from width {coder.d_in} to {d_out} (circuit-tracer sizes W_enc by b_dec's width)")
        )
        raise ConfigError(f"format=circuit_tracer: {what} is {why}: circuit-tracer cannot load it")  # fmt: skip
    return CODES[kind]


def write_config(out: Path, kind: str, hooks: tuple[str, str], model: str | None, ours: dict[str, Any]) -> None:
    """config.yaml: what circuit-tracer reads, and runner's mapping (the code type, k, modules, conversion cost)."""
    cfg = {"model_kind": kind, "feature_input_hook": hooks[0], "feature_output_hook": hooks[1], "runner": ours}
    if model:
        cfg["model_name"] = model
    write_atomic(out / CONFIG, yaml.safe_dump(cfg, sort_keys=False).encode())


# ---- out ---------------------------------------------------------------------------------------------------------
def write_transcoder(
    sae: nn.Module,
    out: Path,
    hook: str | None,
    model: str | None,
    target: str | None,
    rows: Any = None,
    skip_positions: int = 0,
) -> None:
    """`sae`, a per-layer transcoder reading `hook` and predicting `target`, as layer_{i}.safetensors (i: its block)
    and config.yaml on raw activations; a TopK's JumpReLU threshold calibrated on held-out raw `rows` (input | target
    columns), its cost written into config.yaml; `skip_positions` (the first positions it was not trained on) there
    too."""
    code = checked_coder(sae, type(sae).__name__)
    weights = raw_unit_weights(sae)
    if "threshold" in weights:  # BatchTopK's global one may be unset (-1): at inference ReLU codes, threshold 0
        weights["threshold"] = weights["threshold"].clamp_min(0.0)
    tensors = {name: (weights[row[0]].t() if row[2] else weights[row[0]]).contiguous()
               for name, row in LAYER.items() if row[0] in weights}  # fmt: skip
    layer, in_hook = block_hook(hook, INPUT_HOOK)
    ours: dict[str, Any] = {"code": code, "module": hook, "target": target, "skip_positions": skip_positions}
    if code == "topk":
        ours["k"] = sae.k
        tensors[THRESHOLD], ours["conversion"] = calibrate_layer(sae, tensors, rows)
    write_atomic(out / LAYER_FILE.format(i=layer or 0), save(tensors))
    write_config(out, KINDS[0], (in_hook, block_hook(target, OUTPUT_HOOK)[1]), model, ours)


# ---- in -----------------------------------------------------------------------------------------------------------
def regular(path: Path) -> Path:
    """`path` if it is a regular file (a symlink to one, as in a hub snapshot, too); refused otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise ConfigError(f"{path}: not readable ({error}); is the folder whole?") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path} is no regular file (a device, pipe or folder): a folder of weights holds files")
    return path


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml's settings as data: bounded, no YAML aliases (an alias bomb is refused), a mapping of known types."""
    file = regular(path / CONFIG)
    if file.stat().st_size > MAX_CFG:
        raise ConfigError(f"{file}: {file.stat().st_size:,} bytes, no circuit-tracer config (those are a few lines)")
    try:
        text = file.read_text()
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise ConfigError(f"{file}: YAML aliases (*name), which no circuit-tracer config holds; refused")
        cfg = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as error:
        raise ConfigError(f"{file}: not readable YAML ({type(error).__name__}); is the folder whole?") from None
    if not isinstance(cfg, dict) or cfg.get("model_kind") not in KINDS:
        raise ConfigError(f"{file}: no circuit-tracer config (model_kind: one of {', '.join(KINDS)})")
    for key in ("feature_input_hook", "feature_output_hook", "model_name"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise ConfigError(f"{file}: {key} is no text; the folder is not one circuit-tracer reads")
    if not isinstance(cfg.get("runner") or {}, dict):
        raise ConfigError(f"{file}: runner is no mapping; the folder is not one runner wrote")
    return cfg


def numbered(path: Path, pattern: str) -> list[int]:
    """The layer numbers of the files `pattern` ({i} a number) in `path`, refused unless 0..L-1 each once."""
    form = re.compile(re.escape(pattern).replace(r"\{i\}", r"(0|[1-9]\d{0,3})"))
    found = sorted(int(m.group(1)) for p in path.iterdir() if (m := form.fullmatch(p.name)))
    if not found or found[-1] >= MAX_LAYERS:
        raise ConfigError(f"{path}: no {pattern.format(i='N')} files (or a layer number over {MAX_LAYERS})")
    return found


def tensors_of(file: Path, names: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The tensors `names` (each of its shape; those in `optional` may be absent) of a safetensors file, and no
    others, as float64; a missing, extra or misshapen tensor refused by name."""
    tensors = read_tensors(regular(file))
    if extra := sorted(set(tensors) - set(names)):
        raise ConfigError(f"{file}: tensors {extra} are not circuit-tracer's (it reads {sorted(names)})")
    for name, shape in names.items():
        if name not in tensors and name not in optional:
            raise ConfigError(f"{file}: no tensor {name!r} (it has {sorted(tensors)}); the folder is incomplete")
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ConfigError(f"{file}: {name} is {list(tensors[name].shape)}, where the folder makes it {list(shape)}")
    return tensors


def width(file: Path, name: str, ndim: int) -> tuple[int, ...]:
    """The shape of tensor `name` of `file`, read from its header only, refused unless of `ndim` dimensions >= 1."""
    from safetensors import safe_open

    regular(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            shape = tuple(f.get_slice(name).get_shape()) if name in f.keys() else None  # noqa: SIM118
    except Exception as error:  # noqa: BLE001 - safetensors raises its own and Rust's errors on a forged header
        raise ConfigError(f"{file}: not a readable safetensors file ({type(error).__name__})") from None
    if shape is None or len(shape) != ndim or min(shape) < 1:
        raise ConfigError(f"{file}: no tensor {name!r} of {ndim} dimensions; the folder is not circuit-tracer's")
    return shape


def coder_class(code: str, k: int | None, n: int) -> tuple[str, dict[str, Any]]:
    """runner's inference and its class's settings for config's runner.code (relu, jumprelu; topk with k)."""
    if code != "topk":
        return code if code == "jumprelu" else "standard", {}
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ConfigError(f"runner.k={k!r} in config.yaml: a TopK transcoder's k is a whole number in [1, {n}]")
    return "topk", {"k": k}


def read_set(path: Path, cfg: dict[str, Any], hook: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The runner transcoder of circuit-tracer's transcoder-set folder `path` of config `cfg` (several layers:
    `hook` = layer_N picks one), and what the folder says."""
    facts = {"format": "circuit_tracer", "model": cfg.get("model_name"), "architecture": cfg["model_kind"]}
    layers = numbered(path, LAYER_FILE)
    names = [LAYER_FILE.format(i=i).removesuffix(".safetensors") for i in layers]
    if len(layers) > 1 and hook not in names:
        raise ConfigError(f"{path} holds the transcoders of layers {layers}: pick one, e.g. hook={names[0]}")
    layer = layers[0] if len(layers) == 1 else int(hook.removeprefix("layer_"))  # type: ignore[union-attr]
    sae = read_layer(path / LAYER_FILE.format(i=layer), cfg.get("runner") or {})
    ours = cfg.get("runner") or {}
    hooks = {
        key: f"blocks.{layer}.{cfg.get(f'feature_{put}_hook')}"
        for key, put in (("module", "input"), ("target", "output"))
    }
    module, target = (ours[key] if isinstance(ours.get(key), str) else hooks[key] for key in hooks)
    return sae, facts | {"hook": module, "hook_out": target, "weights": str(path / LAYER_FILE.format(i=layer))}


def read_layer(file: Path, ours: dict[str, Any]) -> nn.Module:
    """The runner transcoder of one layer_{i}.safetensors (and runner's config mapping: a TopK's k)."""
    n, d = width(file, "W_enc", 2)
    shapes = {name: tuple({"n_latents": n, "d_model": d}[w] for w in row[1]) for name, row in LAYER.items()}
    tensors = tensors_of(file, shapes, optional=(THRESHOLD, "W_skip"))
    code = ours.get("code") if ours.get("code") == "topk" else ("jumprelu" if THRESHOLD in tensors else "relu")
    inference, kwargs = coder_class(code, ours.get("k"), n)
    if THRESHOLD in tensors and (tensors[THRESHOLD] < 0).any():
        raise ConfigError(f"{file}: {THRESHOLD} has negative entries; a JumpReLU's thresholds are >= 0")
    weights = {row[0]: tensors[name].t() if row[2] else tensors[name] for name, row in LAYER.items() if name in tensors}
    if inference != "jumprelu":
        weights.pop("threshold", None)  # a TopK's calibrated threshold is circuit-tracer's view, not runner's
    sizes = {"d_in": d, "n_latents": n, "d_out": d}
    return build(inference, sizes, True, "W_skip" in tensors, kwargs, weights)
