"""runner.tools.export's folders loaded by the real SAELens and sparsify, in their own virtualenvs: the same
reconstructions (a transcoder's: the same predicted targets) as runner's on the same inputs. Skipped where those
virtualenvs are absent (benchmarks/peers/install.sh makes them at the repository root; RUNNER_SAELENS_PYTHON /
RUNNER_SPARSIFY_PYTHON name others)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ok, peer_forward, peer_python, python
from hydra.utils import instantiate

from experiments.sae.coders.activations import TopKSAE
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.formats import export
from runner.load import load_trained

pytestmark = pytest.mark.slow

PEERS = {
    "saelens": "from sae_lens import SAE\nsae = SAE.load_from_disk(folder)\nout = sae(x)\n"
    "meta = sae.cfg.metadata.to_dict()",
    "sparsify": "from sparsify import SparseCoder\nsae = SparseCoder.load_from_disk(folder)\nout = sae(x).sae_out\n"
    "meta = {}",
}
# the peer's output on the inputs, and which class it loaded and with what metadata (printed as JSON)
LOAD = """
import json, sys, numpy as np, torch
folder, x = sys.argv[1], torch.from_numpy(np.load(sys.argv[2]))
{load}
np.save(sys.argv[3], out.detach().float().numpy())
print(json.dumps({{"class": type(sae).__name__, "metadata": meta}}, default=str))
"""
SMALL = ["trainer.max_duration=60st", "data.batch_size=256", "logger=none", "checkpoint=none", "callbacks=none"]


def _peer_output(peer: str, folder: Path, x: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, dict]:
    # the peer's forward on x, and what it printed about the coder it loaded
    out, stdout = peer_forward(peer, LOAD.format(load=PEERS[peer]), folder, x, tmp_path, timeout=300)
    return out, json.loads(stdout.strip().splitlines()[-1])


def _trained_and_exported(tmp_path: Path, peer: str, *overrides: str) -> tuple[torch.nn.Module, Any, Path]:
    # a short run of the real CLI, exported by the real CLI: the trained model, its config, the export
    peer_python(peer)  # skipped before training where the peer is absent
    run, folder = tmp_path / "run", tmp_path / "export"
    ok(python("-m", "runner", "+experiment=sae", *overrides, *SMALL, f"hydra.run.dir={run}", cwd=tmp_path))
    ok(python("-m", "runner.export", str(run), "--format", peer, "--out", str(folder), cwd=tmp_path))
    return *load_trained(run), folder


@pytest.mark.parametrize(
    ("peer", "model"),
    [("saelens", "sae_topk"), ("saelens", "sae_batchtopk"), ("saelens", "sae_jumprelu"), ("sparsify", "sae_topk")],
)
def test_the_peer_loads_the_export_and_reconstructs_as_runner_does(tmp_path: Path, peer: str, model: str) -> None:
    sae, _, folder = _trained_and_exported(tmp_path, peer, f"model={model}")
    x = torch.randn(512, sae.d_in, generator=torch.Generator().manual_seed(0)) * 0.05
    theirs, _ = _peer_output(peer, folder, x, tmp_path)
    with torch.no_grad():
        ours = sae(x)
    assert (sae.encode(x) > 0).any()  # latents fire on these inputs: the reconstructions are not just b_dec
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


# (peer, model, skip, the class the peer must load); sparsify's coders write their input's width, SAELens's take any
TRANSCODERS = [
    ("saelens", "sae_relu", False, "Transcoder"),
    ("saelens", "sae_relu", True, "SkipTranscoder"),
    ("saelens", "sae_jumprelu", False, "JumpReLUTranscoder"),
    ("saelens", "sae_jumprelu", True, "JumpReLUSkipTranscoder"),
    ("saelens", "sae_batchtopk", True, "JumpReLUSkipTranscoder"),
    ("sparsify", "sae_topk", False, "SparseCoder"),
    ("sparsify", "sae_topk", True, "SparseCoder"),
]


@pytest.mark.parametrize(("peer", "model", "skip", "loaded"), TRANSCODERS)
def test_the_peer_loads_an_exported_transcoder_and_predicts_as_runner_does(
    tmp_path: Path, peer: str, model: str, skip: bool, loaded: str
) -> None:
    d_out = 64 if peer == "sparsify" else 48
    data = ["data=transcoder_synthetic", "data.splits.d=64", f"data.splits.d_out={d_out}", "data.splits.linear=0.5"]
    sae, cfg, folder = _trained_and_exported(tmp_path, peer, f"model={model}", f"model.skip={skip}", *data)
    assert (sae.d_in, sae.d_out, sae.skip) == (64, d_out, skip) and sae.target_scale != sae.input_scale
    # inputs like the training data's (its validation rows' input columns): random ones seldom reach a threshold
    x, _ = sae.split(instantiate(cfg.data.splits, n_val=512)["val"].tensors[0])
    theirs, about = _peer_output(peer, folder, x, tmp_path)
    assert about["class"] == loaded
    with torch.no_grad():
        ours = sae(x)
    assert (sae.encode(x) > 0).any() and ours.shape == (512, d_out)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_saelens_keeps_a_transcoders_hook_points(tmp_path: Path) -> None:
    # export's metadata as SAELens reads it back (the CLI's synthetic runs have no hook points to name)
    sae = JumpReLUSAE(d_in=16, n_latents=32, d_out=24, skip=True).eval()
    export(sae, "saelens", tmp_path / "export", "blocks.2.mlp_norm", "outputs/lm", target="blocks.2.mlp")
    theirs, about = _peer_output("saelens", tmp_path / "export", torch.randn(8, 16), tmp_path)
    assert about["class"] == "JumpReLUSkipTranscoder" and theirs.shape == (8, 24)
    meta = about["metadata"]
    assert (meta["hook_name"], meta["hook_name_out"], meta["model_name"]) == (
        "blocks.2.mlp_norm",
        "blocks.2.mlp",
        "outputs/lm",
    )


def test_saelens_keeps_an_saes_hook_point(tmp_path: Path) -> None:
    # an SAE's export says its layout is SAELens 6's: an older-looking cfg.json lost hook_name and model_name on load
    sae = TopKSAE(d_in=16, n_latents=32, k=4).eval()
    export(sae, "saelens", tmp_path / "export", "blocks.2", "outputs/lm")
    _, about = _peer_output("saelens", tmp_path / "export", torch.randn(8, 16), tmp_path)
    assert (about["metadata"]["hook_name"], about["metadata"]["model_name"]) == (
        "blocks.2.hook_resid_post",
        "outputs/lm",
    )
