"""SAE folders written by the real SAELens and sparsify, in their own virtualenvs, read by runner
(experiments/sae/formats/): runner's forward gives what the package's own forward gives on the same inputs, to 1e-5,
and SAELens's codes are runner's. Every architecture each writes, with the options that change the forward
(SAELens's rescale_acts_by_decoder_norm and apply_b_dec_to_input false, transcoders with and without skip connections;
sparsify's transcoders). Skipped where those virtualenvs are absent (benchmarks/peers/install.sh makes them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import peer_python

from experiments.sae.formats import read_folder

pytestmark = pytest.mark.slow

# Each folder: random weights (thresholds and biases too), saved as the package saves them, then loaded back by the
# package and run on x: out.npy (its forward) and codes.npy (its encode, SAELens's)
SAELENS = """
import json, sys, warnings, numpy as np, torch
warnings.filterwarnings("ignore")
from sae_lens import SAE
from sae_lens.registry import SAE_CLASS_REGISTRY
root, x = sys.argv[1], torch.from_numpy(np.load(sys.argv[2]))
d_in, d_sae, d_out = x.shape[1], 48, 12
cases = {
    "standard": {}, "gated": {}, "jumprelu": {}, "topk": {"k": 5},
    "topk_rescaled": {"k": 5, "rescale_acts_by_decoder_norm": True},
    "standard_uncentred": {"apply_b_dec_to_input": False}, "gated_uncentred": {"apply_b_dec_to_input": False},
    "transcoder": {"d_out": d_out}, "skip_transcoder": {"d_out": d_out}, "jumprelu_transcoder": {"d_out": d_out},
    "jumprelu_skip_transcoder": {"d_out": d_out},
}
torch.manual_seed(0)
for name, options in cases.items():
    arch = name.split("_uncentred")[0].replace("_rescaled", "")
    sae_cls, cfg_cls = SAE_CLASS_REGISTRY[arch]
    if "transcoder" in arch:
        options = {**options, "apply_b_dec_to_input": False}
    cfg = cfg_cls(d_in=d_in, d_sae=d_sae, **options)
    cfg.metadata.hook_name, cfg.metadata.model_name = "blocks.1.hook_resid_post", "tiny"
    sae = sae_cls(cfg)
    with torch.no_grad():
        for pname, p in sae.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if pname in ("W_enc", "W_dec", "W_skip") else 0.2))
            if pname == "threshold":
                p.copy_(torch.rand_like(p) * 0.5)
    sae.save_model(f"{root}/{name}")
    loaded = SAE.load_from_disk(f"{root}/{name}")
    with torch.no_grad():
        np.save(f"{root}/{name}/out.npy", loaded(x).float().numpy())
        np.save(f"{root}/{name}/codes.npy", loaded.encode(x).float().numpy())
print(json.dumps(list(cases)))
"""
SPARSIFY = """
import json, os, sys, numpy as np, torch
os.environ["SPARSIFY_DISABLE_TRITON"] = "1"
from sparsify import SparseCoder, SparseCoderConfig
root, x = sys.argv[1], torch.from_numpy(np.load(sys.argv[2]))
cases = {
    "topk": SparseCoderConfig(k=5, num_latents=48),
    "topk_expansion": SparseCoderConfig(k=3, expansion_factor=2),
    "transcoder": SparseCoderConfig(k=5, num_latents=48, transcode=True),
    "skip_transcoder": SparseCoderConfig(k=5, num_latents=48, transcode=True, skip_connection=True),
}
torch.manual_seed(0)
for name, cfg in cases.items():
    sae = SparseCoder(x.shape[1], cfg)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    sae.save_to_disk(f"{root}/{name}")
    with torch.no_grad():
        np.save(f"{root}/{name}/out.npy", SparseCoder.load_from_disk(f"{root}/{name}")(x).sae_out.float().numpy())
print(json.dumps(list(cases)))
"""


def _written(peer: str, script: str, tmp_path: Path) -> tuple[list[str], torch.Tensor]:
    interpreter = peer_python(peer)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run(
        [interpreter, "-c", script, str(tmp_path), str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), x


def test_saelens_folders_reconstruct_as_saelens_does(tmp_path: Path) -> None:
    cases, x = _written("saelens", SAELENS, tmp_path)
    for name in cases:
        sae, facts = read_folder(tmp_path / name)
        theirs = torch.from_numpy(np.load(tmp_path / name / "out.npy"))
        with torch.no_grad():
            ours = sae(x)
            codes = sae.encode(x)
        assert facts["format"] == "saelens" and facts["hook"] == "blocks.1.hook_resid_post", facts
        assert facts["model"] == "tiny"
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(
            codes, torch.from_numpy(np.load(tmp_path / name / "codes.npy")), atol=1e-5, rtol=1e-5
        )
        assert (codes > 0).any(), f"{name}: no latent fired: the comparison says nothing"
        assert sae.transcoder == ("transcoder" in name) and sae.skip == ("skip" in name)


def test_sparsify_folders_reconstruct_as_sparsify_does(tmp_path: Path) -> None:
    cases, x = _written("sparsify", SPARSIFY, tmp_path)
    for name in cases:
        sae, facts = read_folder(tmp_path / name)
        theirs = torch.from_numpy(np.load(tmp_path / name / "out.npy"))
        with torch.no_grad():
            torch.testing.assert_close(sae(x), theirs, atol=1e-5, rtol=1e-5, msg=name)
        assert facts["format"] == "sparsify" and facts["transcoder"] == ("transcoder" in name)
        assert sae.n_latents == (32 if name == "topk_expansion" else 48)
    # a sparsify training run keeps one folder per hook point: one is picked by name
    sae, facts = read_folder(tmp_path, hook="topk")
    assert facts["hook"] == "topk" and sae.k == 5
