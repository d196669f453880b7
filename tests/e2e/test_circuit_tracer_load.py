"""runner's circuit-tracer folders (experiments/sae/formats/circuit_tracer.py) loaded by circuit-tracer 0.5.0's own
loaders in its virtualenv (utils/caching.py load_transcoders_from_cache's calls: load_transcoder_set on the
layer_{i}.safetensors files, load_clt on the folder, with config.yaml's hooks): its forward on the same raw rows is
runner's; and Gemma Scope 2's CLT files, which circuit-tracer reads through utils/hf_utils.py load_transcoders
(load_gemma_scope_2_clt) and runner through experiments/sae/formats/gemma_scope_clt.py, reconstruct the same.
Skipped where .venv-circuit-tracer is absent (benchmarks/peers/install.sh makes it; RUNNER_CIRCUIT_TRACER_PYTHON names
another)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers import gemma_scope_clt, gemma_scope_forward, peer_forward, random_transcoder

from experiments.sae.coders.activations import ReLUSAE, TopKSAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.formats import export, read_folder
from experiments.sae.formats.circuit_tracer_clt import write_clt

pytestmark = pytest.mark.slow
D = 8
LOAD = """
import sys, yaml, numpy as np, torch
from pathlib import Path
from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
folder, x = Path(sys.argv[1]), torch.from_numpy(np.load(sys.argv[2]))
cfg = yaml.safe_load((folder / "config.yaml").read_text())
hooks = dict(feature_input_hook=cfg["feature_input_hook"], feature_output_hook=cfg["feature_output_hook"])
cpu = torch.device("cpu")
if cfg["model_kind"] == "transcoder_set":
    paths = {int(f.stem.split("_")[1]): str(f) for f in sorted(folder.glob("layer_*.safetensors"))}
    tc = load_transcoder_set(paths, scan="runner", device=cpu, dtype=torch.float32, **hooks)
    out = tc[0](x)
else:
    tc = load_clt(str(folder), device=cpu, dtype=torch.float32, lazy_decoder=False, **hooks)
    out = tc.decode(tc.encode(x).to_sparse())
np.save(sys.argv[3], out.detach().float().numpy())
"""


def _theirs(folder: Path, x: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    return peer_forward("circuit-tracer", LOAD, folder, x, tmp_path, timeout=600)[0]


@pytest.mark.parametrize(("cls", "skip"), [(ReLUSAE, True), (JumpReLUSAE, False), (TopKSAE, False)])
def test_circuit_tracer_reads_our_transcoder_and_predicts_what_ours_does(tmp_path: Path, cls, skip) -> None:
    sae, rows = random_transcoder(cls, D, 32, skip, **({"k": 3} if cls is TopKSAE else {}))
    export(sae, "circuit_tracer", tmp_path / "ct", "blocks.0.mlp_norm", None, "blocks.0.mlp", rows=rows)
    x = rows[:, :D]
    theirs = _theirs(tmp_path / "ct", x, tmp_path)
    # a TopK's folder: circuit-tracer reads the calibrated JumpReLU; runner's reader reads the TopK back
    want = sae(x) if cls is not TopKSAE else _jumprelu_view(tmp_path / "ct", x)
    assert (theirs - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1)
    assert (read_folder(tmp_path / "ct")[0](x) - sae(x)).abs().max() <= 1e-5 * sae(x).abs().max()


def _jumprelu_view(folder: Path, x: torch.Tensor) -> torch.Tensor:
    from safetensors.torch import load_file

    t = load_file(folder / "layer_0.safetensors")
    pre = x @ t["W_enc"].t() + t["b_enc"]
    return (pre * (pre > t["activation_function.threshold"])) @ t["W_dec"] + t["b_dec"]


@pytest.mark.parametrize("cls", [ReLUSAE, TopKSAE])
def test_circuit_tracer_reads_our_clt_and_reconstructs_what_ours_does(tmp_path: Path, cls) -> None:
    torch.manual_seed(0)
    clt = CrossLayerTranscoder(functools.partial(cls, n_latents=16, **({"k": 2} if cls is TopKSAE else {})), 3, D, D)
    rows = torch.cat([torch.randn(256, 3 * D) * 2 + 0.5, torch.randn(256, 3 * D) * 0.3], dim=1)
    clt.initialize_from(rows)
    with torch.no_grad():
        for coder in clt.coders:
            coder.W_dec.normal_(std=0.3)
    clt.eval()
    write_clt(clt, tmp_path / "ct", [], None, [], rows)
    inputs, _ = clt.split(rows)
    ours = torch.stack(read_folder(tmp_path / "ct")[0](inputs))  # a TopK CLT: the JumpReLU written
    theirs = _theirs(tmp_path / "ct", torch.stack(inputs), tmp_path)
    assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max().clamp_min(1)


GEMMA = """
import sys, yaml, numpy as np, torch
from pathlib import Path
from circuit_tracer.utils.hf_utils import load_transcoders
folder, x = Path(sys.argv[1]), torch.from_numpy(np.load(sys.argv[2]))
cfg = yaml.safe_load((folder / "config.yaml").read_text())
# the hub's files as downloaded into the folder; repo_id as circuit-tracer's hub reader sets it, which picks the loader
cfg["transcoders"] = [str(folder / Path(t).name) for t in cfg["transcoders"]]
cfg.update(repo_id="google/gemma-scope-2-1b-pt", scan="runner")
tc = load_transcoders(cfg, torch.device("cpu"), torch.float32, lazy_decoder=False)
assert type(tc).__name__ == "CrossLayerTranscoder" and tc.W_skip is None and tc.n_layers == x.shape[0]
np.save(sys.argv[3], tc.decode(tc.encode(x).to_sparse()).detach().float().numpy())
"""


def test_circuit_tracer_and_runner_read_gemma_scope_2_s_clt_alike(tmp_path: Path) -> None:
    # pad: circuit-tracer 0.5.0's load_gemma_scope_2_clt reads one file fewer than listed (range(max(paths)))
    tensors = gemma_scope_clt(tmp_path / "gs", layers=3, n=16, d=D, pad=True)
    torch.manual_seed(1)
    inputs = [torch.randn(32, D) * 1.5 for _ in range(3)]
    ours = torch.stack(read_folder(tmp_path / "gs")[0](inputs))
    theirs = peer_forward("circuit-tracer", GEMMA, tmp_path / "gs", torch.stack(inputs), tmp_path, timeout=600)[0]
    want = torch.stack(gemma_scope_forward(tensors, inputs)[1]).float()
    assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max().clamp_min(1)
    assert (ours - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1)
