"""runner.export's folders loaded by the real SAELens and sparsify, in their own virtualenvs: the same reconstructions
as runner's on the same inputs. Skipped where those virtualenvs are absent (benchmarks/peers/install.sh makes them at
the repository root; RUNNER_SAELENS_PYTHON / RUNNER_SPARSIFY_PYTHON name others)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, ok, python

from runner.trained import load_trained

pytestmark = pytest.mark.slow

PEERS = {
    "saelens": (
        "RUNNER_SAELENS_PYTHON",
        "from sae_lens import SAE\nsae = SAE.load_from_disk(folder)\nout = sae(x)",
    ),
    "sparsify": (
        "RUNNER_SPARSIFY_PYTHON",
        "from sparsify import SparseCoder\nsae = SparseCoder.load_from_disk(folder)\nout = sae(x).sae_out",
    ),
}
LOAD = """
import sys, numpy as np, torch
folder, x = sys.argv[1], torch.from_numpy(np.load(sys.argv[2]))
{load}
np.save(sys.argv[3], out.detach().float().numpy())
"""


def _interpreter(peer: str) -> str:
    variable = PEERS[peer][0]
    path = os.environ.get(variable) or str(ROOT / f".venv-{peer}" / "bin" / "python")
    if not Path(path).exists():
        pytest.skip(f"no {peer} virtualenv ({path}): benchmarks/peers/install.sh makes it, or set {variable}")
    return path


@pytest.mark.parametrize(
    ("peer", "model"),
    [("saelens", "sae_topk"), ("saelens", "sae_batchtopk"), ("saelens", "sae_jumprelu"), ("sparsify", "sae_topk")],
)
def test_the_peer_loads_the_export_and_reconstructs_as_runner_does(tmp_path: Path, peer: str, model: str) -> None:
    interpreter = _interpreter(peer)
    run = tmp_path / "run"
    small = ["trainer.max_duration=60st", "data.batch_size=256", "logger=none", "checkpoint=none", "callbacks=none"]
    ok(python("-m", "runner", "+experiment=sae", f"model={model}", *small, f"hydra.run.dir={run}", cwd=tmp_path))
    ok(python("-m", "runner.export", str(run), "--format", peer, "--out", str(tmp_path / "export"), cwd=tmp_path))
    sae, _ = load_trained(run)
    x = torch.randn(512, sae.d_in, generator=torch.Generator().manual_seed(0)) * 0.05
    np.save(tmp_path / "x.npy", x.numpy())
    script = LOAD.format(load=PEERS[peer][1])
    done = subprocess.run(
        [interpreter, "-c", script, str(tmp_path / "export"), str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        ours = sae(x)
    theirs = torch.from_numpy(np.load(tmp_path / "out.npy"))
    assert (sae.encode(x) > 0).any()  # latents fire on these inputs: the reconstructions are not just b_dec
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
