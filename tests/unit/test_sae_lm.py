"""+experiment=sae_lm: an SAE on a trained GPT's residual stream, activations from the second position on, its width
from the source, and the GPT's loss with the SAE spliced in against zero and mean ablation."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_LM, StopAt, assert_resume_is_exact, finished_run
from omegaconf import OmegaConf

from experiments.sae import metrics as metrics_module
from experiments.sae.sources.buffer import ActivationBuffer, HookedActivations
from experiments.sae.sources.source import SourceModel
from runner import ConfigError
from runner.build import build
from runner.ckpt import state as ckpt_state
from runner.loop import fit
from runner.tools.evaluate import evaluate_run
from runner.train import train

SAE_LM_SMALL = [
    "model.n_latents=128",
    "model.k=8",
    "data.batch_size=128",
    "data.buffer_size=1024",
    "data.samples_per_epoch=4096",
    "trainer.max_duration=12st",
    "trainer.val_interval=12st",
    "trainer.log_interval=6st",
    "logger=none",
    "checkpoint=none",
]


def test_sae_lm_trains_on_the_residual_stream_and_reports_loss_recovered(compose_cfg: Callable, lm_run: Path) -> None:
    cfg = compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SAE_LM_SMALL)
    run = build(cfg)
    assert run.task.d_in == 32  # the GPT's d_model, with no model.d_in
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    windows = sum(len(batch["tokens"]) for batch in source.data.val_loader())
    assert len(run.val_loader.dataset) == windows * 31  # 32 positions a window, the first left out
    fit(run)
    m = run.state.metrics
    assert m["val/ce_clean"] < m["val/ce_mean_ablated"] < m["val/ce_zero_ablated"], m
    assert m["val/loss_recovered"] == pytest.approx(
        (m["val/ce_zero_ablated"] - m["val/ce_spliced"]) / (m["val/ce_zero_ablated"] - m["val/ce_clean"])
    )
    assert 0 < m["val/fve"] <= 1 and 0 < m["val/l0"] <= 8
    # KL(clean || spliced) in nats per token: positive, and below what either ablation costs
    assert 0 < m["val/kl_spliced"] < m["val/kl_mean_ablated"] < m["val/kl_zero_ablated"], m


def test_a_recovered_fraction_whose_ablation_barely_moves_the_loss_is_nan_and_said_so(
    compose_cfg: Callable, lm_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # a zero ablation costing 0.03% of the loss, which the plain ratio reads as "1.584 recovered"
    value, why = metrics_module.loss_recovered(ablated=6.908, spliced=6.905, clean=6.906)
    assert math.isnan(value) and "moves the loss by 0.002 of 6.906: too little to divide by" in why
    assert metrics_module.loss_recovered(ablated=5.0, spliced=4.5, clean=4.0) == (0.5, None)
    # here the mean ablation moves this tiny GPT's loss by about 1%: with the bar at 5%, its fraction is undefined
    monkeypatch.setattr(metrics_module, "MIN_ABLATION_GAP", 0.05)
    cfg = compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SAE_LM_SMALL)
    m = fit(build(cfg)).state.metrics
    assert math.isnan(m["val/loss_recovered_mean"]) and 0 < m["val/loss_recovered"] <= 1.05, m
    notes = [line for line in capsys.readouterr().err.splitlines() if "loss_recovered" in line]
    assert len(notes) == 1, notes  # once a run, though it validates more than once
    assert notes[0].startswith("note: val/loss_recovered_mean is NaN: mean ablation of blocks.1: the ablation moves")
    assert notes[0].endswith("Read val/kl_spliced and ce_spliced instead")


def test_evaluate_reports_the_spliced_loss_the_run_validated_with(lm_run: Path, tmp_path: Path) -> None:
    run = finished_run(tmp_path, "+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SAE_LM_SMALL)
    metrics = evaluate_run(tmp_path)["metrics"]  # the final weights, again, from the run folder
    for key in ("val/fve", "val/ce_spliced", "val/kl_spliced", "val/loss_recovered", "val/loss_recovered_mean"):
        assert metrics[key] == pytest.approx(run.state.metrics[key], rel=1e-6), key
    # A rebuilt run writes no activation cache where its config says (a run folder may be anybody's)
    config = tmp_path / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(config)
    cfg.data._target_, cfg.data.cache = "experiments.sae.sources.hooked.CachedActivations", str(tmp_path / "elsewhere")
    for ring in ("buffer_size", "samples_per_epoch", "shard"):
        cfg.data.pop(ring)
    OmegaConf.save(cfg, config)
    assert evaluate_run(tmp_path)["metrics"]["val/fve"] == pytest.approx(metrics["val/fve"], rel=1e-12)
    assert not (tmp_path / "elsewhere").exists()


def test_kl_is_zero_for_the_identity_and_matches_a_hand_computation(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    halved = source.compare({"same": lambda acts: acts, "half": lambda acts: acts / 2})
    assert halved["same"]["kl"] == pytest.approx(0, abs=1e-12)
    assert halved["same"]["ce"] == pytest.approx(source.compare({"clean": None})["clean"]["ce"], rel=1e-6)
    batch = next(iter(source.data.val_loader()))
    tokens = batch["tokens"][:, :-1]
    clean = source.model(tokens).double().log_softmax(-1)
    with source._hook(source.name, lambda out: torch.cat([out[:, :1], out[:, 1:] / 2], dim=1)):
        half = source.model(tokens).double().log_softmax(-1)
    kl = (clean.exp() * (clean - half)).sum(-1).mean()
    assert kl > 0
    one_batch = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    one_batch.data.val_loader = lambda: [batch]
    assert one_batch.compare({"half": lambda acts: acts / 2})["half"]["kl"] == pytest.approx(float(kl), rel=1e-9)


def test_a_family_of_saes_on_the_residual_stream_reports_each_splice(compose_cfg: Callable, lm_run: Path) -> None:
    family = ["model=sae_multi", "model.ks=[4,8]", "model.base.n_latents=128"]
    small = [o for o in SAE_LM_SMALL if not o.startswith(("model.n_latents", "model.k="))]
    cfg = compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *family, *small)
    run = fit(build(cfg))
    m = run.state.metrics
    for name in ("ce_spliced", "kl_spliced", "loss_recovered", "fve", "l0"):
        assert m[f"val/{name}"] == pytest.approx((m[f"val/k4/{name}"] + m[f"val/k8/{name}"]) / 2), name
    assert m["val/k4/l0"] <= 4 < m["val/k8/l0"] <= 8
    assert m["val/k4/ce_spliced"] != m["val/k8/ce_spliced"]


def test_splicing_keeps_the_skipped_positions_and_replaces_the_others(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    out = torch.randn(2, 5, 32)
    spliced = source._spliced(out, torch.zeros_like)
    assert torch.equal(spliced[:, :1], out[:, :1]) and not spliced[:, 1:].any()
    assert source.activations(next(iter(source.data.val_loader()))).shape[1] == 32


def test_skipping_positions_of_a_module_without_positions_is_refused(compose_cfg: Callable, lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0.mlp.down", skip_positions=0)
    assert source._kept(torch.ones(4, 32)).shape == (4, 32)
    source.skip = 1
    with pytest.raises(ConfigError, match=r"source.skip_positions=1, but blocks.0.mlp.down outputs \[4, 32\]"):
        source._kept(torch.ones(4, 32))


@pytest.mark.parametrize("skip", [-1, 1.5, 32, 40])
def test_skipping_none_or_every_position_is_refused(compose_cfg: Callable, lm_run: Path, skip: float) -> None:
    # The tiny GPT's windows are 32 positions: skipping them all left an empty validation split (a StopIteration
    # deep in the loop), and a negative count trained silently on the last position only.
    cfg = compose_cfg(
        "+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", f"source.skip_positions={skip}"
    )
    match = "leaves none of the 32 positions" if skip >= 32 else "how many first positions to leave out, >= 0"
    match = rf"source.skip_positions={skip}.*{match}" if skip != 1.5 else "source.skip_positions must be a whole number"
    with pytest.raises(ConfigError, match=match):
        build(cfg)


def test_activations_stop_the_source_forward_at_the_hooked_block(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)
    batch = next(iter(source.data.val_loader()))
    calls = []
    handles = [source.model.blocks[1].register_forward_hook(lambda *_: calls.append("blocks.1"))]
    handles.append(source.model.head.register_forward_hook(lambda *_: calls.append("head")))
    acts = source.activations(batch)
    assert calls == []  # nothing after blocks.0 ran
    full = []
    with source._hook(source.name, lambda out: full.append(out[:, 1:].flatten(0, 1))):
        source.model.validation_step(batch)
    assert calls == ["blocks.1", "head"] and torch.equal(acts, full[0])
    for handle in handles:
        handle.remove()


# ---- exact resume: the activation buffer's state is checkpointed -------------------------------------------------
# 8 steps of 128 positions from a ring of 512: half the ring (2 batches) is refilled every 2 steps, so the checkpoint
# at step 3 is taken when the batch fetched ahead (step 4's) has already triggered a refill.
RESUMED = [
    "model.n_latents=64",
    "model.k=4",
    "data.batch_size=128",
    "data.buffer_size=512",
    "data.samples_per_epoch=640",  # 5 batches an epoch: the resumed half crosses an epoch too
    "trainer.max_duration=8st",
    "trainer.val_interval=4st",
    "trainer.log_interval=2st",
    "logger=jsonl",
    "callbacks=none",
    "checkpoint.interval=1000st",
]


def test_a_hooked_sae_run_stopped_and_resumed_equals_the_uninterrupted_run(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path
) -> None:
    overrides = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *RESUMED]
    assert assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=3)[1].progress.step == 8


def test_a_checkpoint_without_the_buffer_s_state_still_resumes(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *RESUMED]
    with monkeypatch.context() as old:  # a checkpoint as runner wrote them before the buffer had state
        old.setattr(ckpt_state, "stateful_data", lambda run: None)
        train(compose_cfg(*overrides, run_dir=tmp_path / "old"), extra_callbacks=[StopAt(3)])
    assert "data" not in torch.load(tmp_path / "old/checkpoints/last/state.pt", weights_only=True)
    with pytest.warns(RuntimeWarning, match="holds no activation buffer state"):
        second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "old"))
    assert second.progress.step == 8 and second.stop_reason == "max_duration"
    assert second.train_loader.dataset.taken == 8 + 1  # counted on from the checkpoint's 3 (one fetched ahead)


@pytest.fixture(scope="module")
def stream_lm_run(trained_once: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT trained on data=text_stream: its training inputs, which the buffer reads, are a stream (the worker's
    one training of it, copied: test_sae_cache trains the same)."""
    return trained_once(tmp_path_factory.mktemp("stream_lm"), *TINY_LM, "data=text_stream", "data.block=4")


@pytest.mark.parametrize("source_data", ["windows", "stream"])
def test_the_buffer_state_saved_for_a_batch_replays_what_followed_it(
    source_data: str, request: pytest.FixtureRequest
) -> None:
    # On CUDA the loop is two batches ahead of the step it trains; with a ring of two batches every take refills.
    run = request.getfixturevalue("lm_run" if source_data == "windows" else "stream_lm_run")
    source = SourceModel(str(run), "blocks.0", skip_positions=1)
    served = HookedActivations(ActivationBuffer(source, capacity=64, seed=3), size=10**6)
    first = [served.__getitems__(list(range(32)))[0] for _ in range(6)]
    state = served.state_dict(4)  # the loop trained on 4 batches and fetched 2 more
    again = HookedActivations(ActivationBuffer(source, capacity=64, seed=3), size=10**6)
    again.load_state_dict(state, 4)
    assert all(torch.equal(again.__getitems__(list(range(32)))[0], rows) for rows in first[4:])
    with pytest.warns(RuntimeWarning, match="keeps no state for batch 1"):
        served.state_dict(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_source_runs_there_and_the_ring_lives_there(compose_cfg: Callable, lm_run: Path) -> None:
    cfg = compose_cfg(
        "+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SAE_LM_SMALL, "distributed.device=cuda"
    )
    run = fit(build(cfg))
    buffer = run.train_loader.dataset.buffer
    assert buffer.ring.is_cuda and buffer.order.is_cuda
    assert all(p.is_cuda for p in buffer.source.model.parameters())
    assert run.state.metrics["val/fve"] > 0


def test_resampling_dead_latents_of_a_hooked_sae_keeps_the_resume_exact(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path
) -> None:
    # sae_resample draws from the live buffer and puts it back (HookedActivations.peek): the run trains on the
    # batches it would have, and the resumed run draws the same inputs at the same step
    resample = ["callbacks=[sae_resample]", "callbacks.sae_resample.every=2st", "callbacks.sae_resample.until=1.0dur"]
    resample += ["callbacks.sae_resample.samples=256", "model.n_latents=512", "model.dead_window=1st"]
    overrides = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", *RESUMED, *resample]
    whole, _ = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=3)
    assert whole.callbacks[0].resampled > 0


def test_several_hook_points_train_a_family_for_each_module_from_one_forward(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path
) -> None:
    family = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "model=sae_multi", "model.ks=[4]"]
    family += ["model.base.n_latents=64", *(o for o in SAE_LM_SMALL if not o.startswith("model."))]
    both = train(compose_cfg(*family, "source.module=[blocks.0,blocks.1]", run_dir=tmp_path / "both"))
    assert {name: sae.d_in for name, sae in both.task.saes.items()} == {"blocks_0_k4": 32, "blocks_1_k4": 32}
    metrics = both.state.metrics
    for module in ("blocks_0", "blocks_1"):
        assert metrics[f"val/{module}_k4/fve"] > 0.1 and 0 < metrics[f"val/{module}_k4/loss_recovered"] <= 1.01
        assert metrics[f"val/{module}/ce_zero_ablated"] > metrics["val/ce_clean"]
        assert (tmp_path / "both" / f"model.{module}_k4.safetensors").is_file()
    # the first module's SAE trains exactly as it does alone: the same rows (its columns), the same initialisation
    alone = train(compose_cfg(*family, "source.module=blocks.0", run_dir=tmp_path / "alone"))
    for key, value in alone.task.saes["k4"].state_dict().items():
        assert torch.equal(value, both.task.saes["blocks_0_k4"].state_dict()[key]), key
    with pytest.raises(ConfigError, match=r"model.d_in=None.*need model=sae_multi"):
        build(compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.module=[blocks.0,blocks.1]"))


def test_every_rank_trains_on_its_own_share_of_what_one_process_takes(lm_run: Path) -> None:
    # Each rank's ring is alike (one seed, the source's same inputs): had each served its own micro-batches, both
    # ranks would have trained on the very same rows. Two ranks of 32 take what one process takes in two of 32.
    from experiments.sae.sources.hooked import LiveActivations

    def loader(rank: int, world_size: int, accumulate: int) -> list[torch.Tensor]:
        data = LiveActivations(
            str(lm_run), "blocks.1", skip_positions=1, buffer_size=512, samples_per_epoch=256, batch_size=32, seed=0
        )
        batches = iter(data.train_loader(rank=rank, world_size=world_size, accumulate=accumulate))
        return [next(batches)[0] for _ in range(4)]

    one = loader(0, 1, 2)
    ranks = [loader(rank, 2, 1) for rank in (0, 1)]
    assert not torch.equal(ranks[0][0], ranks[1][0])
    for step in range(2):  # one process's micro-batches 2s and 2s+1 are rank 0's and rank 1's step s
        assert torch.equal(ranks[0][step], one[2 * step]) and torch.equal(ranks[1][step], one[2 * step + 1])


def test_a_ring_too_small_for_every_rank_s_take_or_a_ragged_epoch_is_refused(lm_run: Path) -> None:
    # every rank takes all ranks' rows at once: a ring of 512 holds two takes of 2 x 128 but not of 4 x 128, and an
    # epoch of 1000 rows would end in a short step whose takes differ between ranks (their rings would drift apart)
    from experiments.sae.sources.hooked import LiveActivations

    def data(samples: int) -> LiveActivations:
        return LiveActivations(
            str(lm_run),
            "blocks.1",
            skip_positions=1,
            buffer_size=512,
            samples_per_epoch=samples,
            batch_size=128,
            seed=0,
        )

    data(1024).train_loader(rank=1, world_size=2)
    with pytest.raises(ConfigError, match=r"two such takes.*data.buffer_size=16384 data.samples_per_epoch=1024"):
        data(1024).train_loader(rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"whole global batches of 256"):
        data(1000).train_loader(rank=0, world_size=2)


def test_a_source_without_its_module_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    # a folder that is no model at all: the refusal comes first, so nothing is read (a hub model takes minutes)
    with pytest.raises(ConfigError, match=r"source.module is not set: name the module .*=transformer.h.8 \(GPT-2\)"):
        SourceModel(str(tmp_path / "no-model-here"), None)
