"""The gated SAE: its forward and loss terms against the paper's equations written out here, the gate's gradients (none
through the Heaviside, some through the L1 and the auxiliary reconstruction), resampling and init of the magnitude
path, the SAELens export, and real runs: an SAE that recovers synthetic features, a transcoder that recovers its map,
bf16 autocast, and a resumed run equal to an uninterrupted one.

Tiny sizes on one CPU thread (tests/conftest.py); the runs take a few seconds each.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_resume_is_exact
from omegaconf import DictConfig
from safetensors.torch import load_file

from experiments.sae.coders.gated import GatedSAE
from experiments.sae.formats import export
from runner import ConfigError
from runner.build import build
from runner.loop import fit
from runner.train import train

D, N = 8, 16


def _tiny(**kwargs) -> GatedSAE:
    # every parameter away from its start, and an input (and target) scale away from 1
    torch.manual_seed(kwargs.pop("seed", 0))
    sae = GatedSAE(**{"d_in": D, "n_latents": N, "geometric_median_init": False, "l1_warmup": "0st", **kwargs})
    with torch.no_grad():
        for p in (sae.b_enc, sae.r_mag, sae.b_mag, sae.b_dec):
            p.copy_(torch.randn_like(p) * 0.5)
        sae.input_scale.fill_(0.7)
        sae.initialized.fill_(True)  # a training step keeps these (no data-dependent init)
        if sae.transcoder:
            sae.target_scale.fill_(1.9)
        if sae.skip:
            sae.W_skip.copy_(torch.randn_like(sae.W_skip) * 0.3)
    return sae


@torch.no_grad()
def _paper(sae: GatedSAE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pi_gate, codes, reconstruction in raw units) from the paper's equations, in float64."""
    W_enc, W_dec, b_dec = sae.W_enc.double(), sae.W_dec.double(), sae.b_dec.double()
    xn = x.double() * sae.input_scale.double()
    centred = xn if sae.transcoder else xn - b_dec  # a transcoder's encoder reads its input uncentred
    pi_gate = centred @ W_enc + sae.b_enc.double()
    pi_mag = centred @ (W_enc * sae.r_mag.double().exp()) + sae.b_mag.double()
    codes = (pi_gate > 0).double() * pi_mag.relu()
    skip = xn @ sae.W_skip.double() if sae.skip else 0.0
    return pi_gate, codes, (codes @ W_dec + b_dec + skip) / sae.out_scale.double()


@pytest.mark.parametrize("shape", [{}, {"d_out": 5}, {"d_out": 5, "skip": True}], ids=["sae", "transcoder", "skip"])
def test_the_forward_is_the_paper_s_gated_encoder(shape: dict) -> None:
    sae = _tiny(**shape)
    x = torch.randn(64, D) * 2 + 0.5
    pi_gate, codes, recon = _paper(sae, x)
    with torch.no_grad():
        ours = sae.encode(x)
        torch.testing.assert_close(sae(x).double(), recon, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.double(), codes, rtol=1e-5, atol=1e-5)
    # both ways of being off happen: a closed gate over a positive magnitude, an open one over a negative magnitude
    assert ((pi_gate > 0) & (codes == 0)).any() and ((pi_gate <= 0) & (ours == 0)).any() and (ours > 0).any()


def _terms(sae: GatedSAE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A training step's losses before they are summed, as SAE._step makes them (an SAE: the target is the input)."""
    xn = x * sae.input_scale
    pre = sae.pre_activations(xn)
    values, _ = sae.activate(pre)
    recon = sae.decode(values, None)
    sst = (xn - xn.mean(0)).pow(2).sum(1).mean()
    return {"recon_loss": (recon - xn).pow(2).sum(1).mean() / sst, **sae.aux_loss(xn, pre, values, None, recon)}


def test_the_loss_terms_are_the_paper_s_in_runner_s_normalisation() -> None:
    sae = _tiny(l1_coeff=0.3)
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(N, 1) + 0.5)  # row norms away from 1: the L1 weighs by them
    x = torch.randn(64, D)
    pi_gate, _, _ = _paper(sae, x)
    xn = x.double() * sae.input_scale.double()
    W_dec, b_dec = sae.W_dec.detach().double(), sae.b_dec.detach().double()
    l1 = (pi_gate.relu() * W_dec.norm(dim=1)).sum(1).mean() / D**0.5
    aux = (pi_gate.relu() @ W_dec + b_dec - xn).pow(2).sum(1).mean() / (xn - xn.mean(0)).pow(2).sum(1).mean()
    with torch.no_grad():
        out = sae.training_step(x)
    assert float(out["l1_loss"]) == pytest.approx(float(l1), rel=1e-5)
    assert float(out["aux_recon_loss"]) == pytest.approx(float(aux), rel=1e-5)
    # the loss: the reconstruction, 0.3 x the L1 and the auxiliary reconstruction at weight 1 (the paper's)
    assert float(out["loss"]) == pytest.approx(float(out["recon_loss"] + 0.3 * l1 + aux), rel=1e-5)


def _grads(loss: torch.Tensor, sae: GatedSAE) -> dict[str, torch.Tensor]:
    names = ("b_enc", "W_enc", "r_mag", "b_mag", "W_dec", "b_dec")
    grads = torch.autograd.grad(
        loss, [getattr(sae, n) for n in names], retain_graph=True, allow_unused=True, materialize_grads=True
    )
    return dict(zip(names, grads, strict=True))


def test_the_gate_learns_through_the_l1_and_auxiliary_terms_only() -> None:
    sae = _tiny()
    out = _terms(sae, torch.randn(64, D))
    recon = _grads(out["recon_loss"], sae)
    # the Heaviside passes nothing to b_gate; the magnitude path (sharing W_enc) learns from the reconstruction
    assert torch.equal(recon["b_enc"], torch.zeros(N))
    assert all((recon[n] != 0).any() for n in ("W_enc", "r_mag", "b_mag", "W_dec"))
    for term in ("l1_term", "aux_recon_term"):
        grads = _grads(out[term], sae)
        assert (grads["b_enc"] != 0).sum() > N // 2 and (grads["W_enc"] != 0).any(), term
        assert torch.equal(grads["r_mag"], torch.zeros(N)) and torch.equal(grads["b_mag"], torch.zeros(N)), term
    # the auxiliary decoder is frozen: the decoder learns from the reconstruction alone
    assert torch.equal(_grads(out["aux_recon_term"], sae)["W_dec"], torch.zeros(N, D))


def test_the_l1_coefficient_ramps_up_and_bad_settings_are_refused() -> None:
    sae, x = _tiny(l1_coeff=2.0, l1_warmup="10st"), torch.randn(32, D)
    seen = {}
    for step in range(21):
        if step in (0, 5, 20):
            with torch.no_grad():
                out = sae.training_step(x)
            seen[step] = float(out["loss"] - out["recon_loss"] - out["aux_recon_loss"]) / float(out["l1_loss"])
        sae.after_optimizer_step()
    assert seen == pytest.approx({0: 0.0, 5: 1.0, 20: 2.0}, rel=1e-4, abs=1e-5)
    for bad in ({"l1_warmup": "1ep"}, {"l1_coeff": -1.0}, {"l1_coeff": float("nan")}):
        with pytest.raises(ConfigError):
            _tiny(**bad)


def test_resampling_restarts_the_magnitude_path_and_a_transcoder_s_b_mag_starts_centred() -> None:
    sae = _tiny()
    dead, live = torch.tensor([2, 9]), torch.tensor([i for i in range(N) if i not in (2, 9)])
    slices = sae.latent_slices(dead)
    assert slices[sae.r_mag] == (dead,) and slices[sae.b_mag] == (dead,) and slices[sae.b_enc] == (dead,)
    before = {n: getattr(sae, n).detach().clone() for n in ("b_enc", "r_mag", "b_mag")}
    sae.restart_latents(dead)
    for name, value in before.items():
        assert torch.all(getattr(sae, name)[dead] == 0) and torch.equal(getattr(sae, name)[live], value[live]), name
    # a transcoder's encoder reads its input uncentred: both paths start centred on its median (the init shifts
    # b_gate and b_mag alike), so the magnitudes start as the gate's pre-activations less b_gate's own start
    torch.manual_seed(0)
    tc = GatedSAE(d_in=D, n_latents=N, d_out=5, b_enc_init=-1.0)
    x = torch.randn(256, D) + 3.0
    tc.initialize_from(torch.cat([x, torch.randn(256, 5)], 1))
    torch.testing.assert_close(tc.b_mag.detach(), tc.b_enc.detach() + 1.0)
    pre = tc.pre_activations(x * tc.input_scale).detach() + 1.0
    assert float(pre.median(0).values.abs().max()) < 0.2  # centred (unshifted: the mean's projection, up to 1.6)


def _saelens_gated(folder: Path, x: torch.Tensor) -> torch.Tensor:
    """SAELens's GatedSAE (sae_lens/saes/gated_sae.py, encode and decode) on an exported folder, written out here."""
    cfg, w = json.loads((folder / "cfg.json").read_text()), load_file(str(folder / "sae_weights.safetensors"))
    assert cfg["architecture"] == "gated" and cfg["apply_b_dec_to_input"] and "b_enc" not in w
    sae_in = x - w["b_dec"]
    active = (sae_in @ w["W_enc"] + w["b_gate"] > 0).float()
    magnitudes = (sae_in @ (w["W_enc"] * w["r_mag"].exp()) + w["b_mag"]).relu()
    return (active * magnitudes) @ w["W_dec"] + w["b_dec"]


def test_the_saelens_export_reconstructs_raw_activations_as_runner_does(tmp_path: Path) -> None:
    sae = _tiny().eval()
    x = torch.randn(256, D) * 3 + 1
    export(sae, "saelens", tmp_path / "sae", "blocks.1", "outputs/lm")
    with torch.no_grad():
        assert (sae.encode(x) > 0).sum() > 0  # codes fire: the comparison is not between zeros
        torch.testing.assert_close(_saelens_gated(tmp_path / "sae", x), sae(x), rtol=1e-4, atol=1e-4)
    # SAELens has no gated transcoder, sparsify no gated anything: refused, nothing written
    for fmt in ("saelens", "sparsify"):
        with pytest.raises(ConfigError, match="neither format takes GatedSAE, a gated transcoder"):
            export(_tiny(d_out=5), fmt, tmp_path / "tc")
    with pytest.raises(ConfigError, match="sparsify has top-k SAEs only"):
        export(sae, "sparsify", tmp_path / "sp")
    assert not (tmp_path / "tc").exists() and not (tmp_path / "sp").exists()


# ---- real runs ----------------------------------------------------------------------------------------------------

QUALITY = (
    "+experiment=sae",
    "model=sae_gated",
    "logger=none",
    "checkpoint=none",
    "data.splits.d=32",
    "data.splits.n_features=64",
    "data.splits.mean_active=2",
    "model.n_latents=128",
    "data.batch_size=512",
    "data.val_batch_size=2048",
    "data.splits.n_val=2048",
    "optimizer.lr=3e-3",
    "trainer.max_duration=600st",
)


class Losses:
    """A logger that keeps the training loss of every log step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log(self, metrics: dict, step: int) -> None:
        """Keep train/loss."""
        if "train/loss" in metrics:
            self.losses.append(float(metrics["train/loss"]))

    def close(self) -> None:
        """Nothing to close."""


def test_a_gated_sae_lowers_its_loss_and_recovers_synthetic_features(compose_cfg: Callable[..., DictConfig]) -> None:
    # l1 1.0: L0 near the 2 features active per row (0.5: L0 3.3, MMCS 0.89; the preset's 0.3 is for its 5 of 512)
    run = build(compose_cfg(*QUALITY, "model.l1_coeff=1.0", "trainer.log_interval=20st"))
    assert isinstance(run.task, GatedSAE) and run.task.d_in == 32
    logged = Losses()
    run.loggers.append(logged)
    fit(run)
    assert run.stop_reason == "max_duration" and run.state.nonfinite_steps == 0
    # (the L1 ramps up over the first 100 steps: the total is measured from the first log row, at step 20)
    assert sum(logged.losses[-3:]) / 3 < 0.7 * logged.losses[0], logged.losses
    m = run.state.metrics
    # measured (seeds 0, 1, 2): MMCS 0.978-0.990, FVE 0.872-0.903, L0 1.46-1.60 (a random decoder: MMCS < 0.6)
    assert m["val/mmcs"] >= 0.95 and m["val/fve"] > 0.83 and m["val/l0"] < 2.5, m


def test_a_gated_transcoder_recovers_its_decoder(compose_cfg: Callable[..., DictConfig]) -> None:
    # inputs with noise 0.1, as test_transcoder_truth.py's TopK transcoder's; l1 0.5 (1.0: 26-30% dead, MMCS 0.90-0.96)
    data = ("data=transcoder_synthetic", "data.splits.d_out=48", "data.splits.noise=0.1")
    run = build(compose_cfg(*QUALITY, *data, "model.l1_coeff=0.5"))
    assert run.task.transcoder and (run.task.d_in, run.task.d_out) == (32, 48)
    fit(run)
    m = run.state.metrics
    # measured (seeds 0, 1, 2): decoder MMCS 0.959-0.965, encoder MMCS 0.870-0.888, FVE 0.756-0.772
    assert m["val/mmcs"] >= 0.93 and m["val/encoder_mmcs"] >= 0.83 and m["val/fve"] > 0.7, m


def test_a_gated_sae_trains_under_bf16_autocast_close_to_fp32(compose_cfg: Callable[..., DictConfig]) -> None:
    def trained(precision: str):
        overrides = ["+experiment=sae", "model=sae_gated", "model.n_latents=256", "data.batch_size=256"]
        overrides += ["data.splits.n_val=512", "trainer.max_duration=20st", "checkpoint=none", "logger=none"]
        return train(compose_cfg(*overrides, f"precision={precision}", "callbacks=none"))

    bf16, fp32 = trained("bf16"), trained("fp32")
    assert all(p.dtype == torch.float32 for p in bf16.task.parameters())
    assert bf16.state.nonfinite_steps == 0 and bf16.state.metrics["train/fve"] > 0.1
    assert bf16.state.metrics["train/fve"] == pytest.approx(fp32.state.metrics["train/fve"], abs=0.03)


RESUME = [
    *("+experiment=sae", "model=sae_gated", "model.n_latents=64", "model.dead_window=2st", "model.l1_warmup=8st"),
    *("data.splits.d=16", "data.splits.n_features=32", "data.splits.n_val=256", "data.batch_size=64"),
    *("trainer.max_duration=12st", "trainer.log_interval=2st", "trainer.val_interval=4st", "logger=jsonl"),
    "checkpoint.interval=1000st",
]
CASES = {
    # gates that start nearly shut: dead latents resampled every 3 steps (r_mag and b_mag restarted, their Adam state
    # forgotten), which the resumed run must repeat
    "resampled": [
        *("model.b_enc_init=-3.0", "callbacks=[sae_resample]", "callbacks.sae_resample.every=3st"),
        *("callbacks.sae_resample.until=1.0dur", "callbacks.sae_resample.samples=256"),
    ],
    "skip_transcoder": [
        *("data=transcoder_synthetic", "data.splits.d_out=12", "data.splits.linear=0.5", "data.splits.noise=0.05"),
        "model.skip=true",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(
    compose_cfg: Callable, tmp_path: Path, case: str
) -> None:
    whole, _ = assert_resume_is_exact(compose_cfg, [*RESUME, *CASES[case]], tmp_path, stop=6)
    sae = whole.task
    assert int(sae.steps) == 12 and (sae.r_mag != 0).any() and (sae.b_mag != 0).any()
    if case == "resampled":
        assert whole.callbacks[0].resampled > 0
    else:
        assert sae.transcoder and sae.skip and torch.count_nonzero(sae.W_skip) > 0
