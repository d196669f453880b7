"""model=spliced (+experiment=sae_lm_kl, transcoder_lm_kl): a coder trained through the frozen model it is spliced
into, by KL from the clean model's next-token distribution, by the spliced CE, and with reconstruction and downstream
terms beside them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_resume_is_exact

from experiments.sae.end_to_end import Spliced
from runner.build import build
from runner.loop import fit

SMALL = [
    "model.coder.n_latents=64",
    "model.coder.k=4",
    "data.batch_size=4",
    "trainer.max_duration=10st",
    "trainer.val_interval=10st",
    "trainer.log_interval=5st",
    "logger=none",
    "checkpoint=none",
]


def _first_batch(run) -> dict[str, torch.Tensor]:
    return next(iter(run.train_loader))


def _sae_lm_kl(compose_cfg: Callable, lm_run: Path, *overrides: str):
    return compose_cfg("+experiment=sae_lm_kl", f"source.checkpoint={lm_run}", "source.layer=1", *SMALL, *overrides)


def test_a_coder_that_returns_its_input_gives_kl_zero_and_gradients_reach_the_coder_only(
    compose_cfg: Callable, lm_run: Path
) -> None:
    run = build(_sae_lm_kl(compose_cfg, lm_run, "model.coder.skip=false"))
    task = run.task
    assert isinstance(task, Spliced) and task.coder.d_in == 32
    batch = _first_batch(run)
    coder = task.coder
    out = task.training_step(batch)  # first step: the data-dependent init runs on this batch's rows
    out["loss"].backward()
    assert out["kl"] > 0 and out["ce"] > 0
    assert all(p.grad is None for p in task.source.model.parameters())  # frozen: no gradient ever
    assert not any(p.requires_grad for p in task.source.model.parameters()) and not task.source.model.training
    assert coder.W_enc.grad is not None and coder.W_enc.grad.abs().sum() > 0
    assert not any(name.startswith("source") for name in task.state_dict())  # checkpoints hold the coder alone
    assert {id(p) for group in run.optimizer.param_groups for p in group["params"]} == {
        id(p) for p in coder.parameters()
    }
    # the clean activation spliced back: the spliced model is the clean one
    coder.step = lambda rows, train=True: ({"loss": rows.sum() * 0, "recon_loss": rows.sum() * 0}, rows)
    same = task.training_step(batch)
    assert same["kl"].item() == pytest.approx(0.0, abs=1e-7)
    clean_loss, _ = task.source.loss(batch)
    assert same["ce"].item() == pytest.approx(clean_loss.item(), rel=1e-6)


def test_the_kl_gradient_matches_finite_differences(compose_cfg: Callable, lm_run: Path) -> None:
    # a transcoder's decoder bias moves every row's prediction and no latent's selection (TopK is not smooth)
    source = [f"source.checkpoint={lm_run}", "source.layer=1"]
    cfg = compose_cfg("+experiment=transcoder_lm_kl", *source, *SMALL, "model.coder.auxk_coeff=0")
    run = build(cfg)
    task, batch = run.task, _first_batch(run)
    task.training_step(batch)  # initialise from the first batch
    coder = task.coder
    coder.zero_grad()
    task.training_step(batch)["loss"].backward()
    grad = coder.b_dec.grad.clone()
    # central differences along the 3 coordinates of b_dec with the largest gradients (a dense path: every row's
    # reconstruction moves). The smallest are ~1e-7 a unit, below what a float32 KL of ~3e-5 resolves: whether the
    # estimate there lands within 2% changed with the last bits of the source's weights. Here, with this step, it is
    # within 0.7% for two sources whose training differed in the optimizer's rounding alone.
    h = 0.1
    for i in grad.abs().topk(3).indices.tolist():
        with torch.no_grad():
            coder.b_dec[i] += h
            up = task.training_step(batch)["kl"].item()
            coder.b_dec[i] -= 2 * h
            down = task.training_step(batch)["kl"].item()
            coder.b_dec[i] += h
        assert grad[i].item() == pytest.approx((up - down) / (2 * h), rel=0.02, abs=1e-6), i


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_descent_on_one_batch_lowers_the_objective(compose_cfg: Callable, lm_run: Path, loss: str) -> None:
    # a coder whose codes start too large (encoder columns of norm 3) costs the model; the objective's own descent
    # must remove that cost on the batch it descends on
    run = build(_sae_lm_kl(compose_cfg, lm_run, f"model.loss={loss}", "model.coder.encoder_init=3"))
    batch = _first_batch(run)
    for group in run.optimizer.param_groups:
        group["lr"] = 1e-2
    seen = []
    for _ in range(20):
        run.optimizer.zero_grad()
        out = run.task.training_step(batch)
        out["loss"].backward()
        run.optimizer.step()
        run.task.after_optimizer_step()
        seen.append(out[loss].item())
    assert seen[-1] < (seen[0] / 10 if loss == "kl" else seen[0] - 0.003), seen


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.loss=ce"],
        ["source.layer=0", "model.recon_coeff=1.0", "model.downstream=[blocks.1]", "model.downstream_coeff=0.5"],
    ],
)
def test_ce_and_e2e_downstream_train(compose_cfg: Callable, lm_run: Path, overrides: list[str]) -> None:
    run = build(_sae_lm_kl(compose_cfg, lm_run, *overrides))
    out = run.task.training_step(_first_batch(run))
    if "model.loss=ce" in overrides:
        assert out["loss"].item() == pytest.approx((out["ce"] + out["loss"] - out["ce"]).item())
        assert out["loss"].item() >= out["ce"].item()  # ce plus the code type's AuxK term
    else:
        assert out["downstream_loss"] > 0
        expected = out["kl"] + out["recon_loss"] + 0.5 * out["downstream_loss"]
        assert out["loss"].item() >= expected.item() - 1e-6
    fit(run)
    assert run.state.metrics["val/ce_spliced"] > 0


def test_a_transcoder_trains_through_the_model(compose_cfg: Callable, lm_run: Path) -> None:
    cfg = compose_cfg("+experiment=transcoder_lm_kl", f"source.checkpoint={lm_run}", "source.layer=1", *SMALL)
    run = build(cfg)
    assert run.task.coder.transcoder and run.task.written == "blocks.1.mlp"
    fit(run)
    assert 0 < run.state.metrics["val/kl_spliced"]


def test_resume_is_exact(compose_cfg: Callable, lm_run: Path, tmp_path: Path) -> None:
    overrides = ["+experiment=sae_lm_kl", f"source.checkpoint={lm_run}", "source.layer=1", *SMALL]
    overrides = [o for o in overrides if not o.startswith(("checkpoint=", "logger="))] + ["logger=jsonl"]
    assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=4)


def test_the_spliced_pass_replays_the_clean_prefix_and_computes_the_same(
    compose_cfg: Callable, lm_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    from experiments.sae import end_to_end

    # modules inside the replayed ones (a replayed module's own hooks still fire, around the replay)
    for experiment, inside in (("sae_lm_kl", "blocks.1.mlp.down"), ("transcoder_lm_kl", "blocks.1.attn.qkv")):
        cfg = compose_cfg(f"+experiment={experiment}", f"source.checkpoint={lm_run}", "source.layer=1", *SMALL)
        results = []
        for replay in (True, False):
            if not replay:
                monkeypatch.setattr(end_to_end, "replaying", lambda _prefix: contextlib.nullcontext())
            run = build(cfg)
            model = run.task.source.model
            calls = {"blocks.0.attn": 0, inside: 0}
            for name in calls:  # they fire only when computed
                hook = lambda *_, name=name, calls=calls: calls.__setitem__(name, calls[name] + 1)  # noqa: E731
                model.get_submodule(name).register_forward_hook(hook)
            batch = _first_batch(run)
            out = run.task.training_step(batch)
            out["loss"].backward()
            grads = [p.grad.clone() for p in run.task.coder.parameters() if p.grad is not None]
            results.append((out["loss"].detach(), out["kl"], grads))
            # with the replay each runs once a step (the clean pass), without it twice
            assert calls == {"blocks.0.attn": 1 if replay else 2, inside: 1 if replay else 2}, (experiment, replay)
        (loss, kl, grads), (loss_, kl_, grads_) = results
        assert torch.equal(loss, loss_) and torch.equal(kl, kl_), experiment
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_, strict=True)), experiment
        monkeypatch.undo()


@pytest.mark.parametrize("experiment", ["sae_lm_kl", "transcoder_lm_kl"])
def test_compile_blocks_compiles_the_blocks_the_splice_leaves_whole_and_trains_as_eager(
    compose_cfg: Callable, lm_run: Path, experiment: str
) -> None:
    # spliced at (or, for the transcoder, inside) blocks.0 of the 2-block GPT: blocks.1 alone is compiled, at the
    # first step (aot_eager: torch.compile's tracing without code generation, fast on the CPU)
    base = [f"+experiment={experiment}", f"source.checkpoint={lm_run}", "source.layer=0", *SMALL]
    coders = []
    for compiled in (False, True):
        run = build(compose_cfg(*base, *(("compile=blocks", "compile.backend=aot_eager") if compiled else ())))
        blocks = run.task.source.model.blocks
        assert all(block._compiled_call_impl is None for block in blocks)
        fit(run)
        assert [block._compiled_call_impl is not None for block in blocks] == [False, compiled]
        coders.append(run.task.coder.state_dict())
    eager, compiled = coders
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)


def test_compile_model_is_refused_for_a_coder_trained_end_to_end(compose_cfg: Callable, lm_run: Path) -> None:
    from runner import ConfigError

    with pytest.raises(ConfigError, match="an end-to-end coder has none"):
        build(_sae_lm_kl(compose_cfg, lm_run, "compile=model"))
