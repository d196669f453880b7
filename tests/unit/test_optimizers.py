"""runner/optimizers.py: Signum's and Muon's updates against references written here and against torch's own Muon and
Adam; an optimizer rebuilt from its state_dict continues bit for bit; and real SAE runs (optimizer=signum, muon) lower
their loss and resume exactly."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_resume_is_exact, values

from runner import ConfigError
from runner.optimizers import Muon, Signum, orthogonalize
from runner.run import Callback, Run


def _grads(shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(steps)]


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone().requires_grad_() for t in tensors]


def _step(optimizers: list[torch.optim.Optimizer], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    for optimizer in optimizers:
        optimizer.step()


# ---- Signum --------------------------------------------------------------------------------------------------------
def test_signum_moves_every_entry_by_lr_against_the_sign_of_its_momentum() -> None:
    lr, momentum, decay = 0.01, 0.9, 0.1
    start = [torch.randn(6, 5), torch.randn(5)]
    params = _leaves(start)
    opt = Signum([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}], lr, momentum, decay)
    expected, bufs = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for grads in _grads([(6, 5), (5,)], steps=4):
        _step([opt], params, grads)
        for i, g in enumerate(grads):
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            expected[i] = expected[i] * (1 - lr * (decay if i == 0 else 0.0)) - lr * torch.sign(bufs[i])
    for p, e, b in zip(params, expected, bufs, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, rtol=1e-6, atol=1e-7)  # rounding apart


def test_signum_s_first_step_is_the_sign_of_the_gradient() -> None:
    p = _leaves([torch.zeros(3, 4)])
    g = torch.randn(3, 4)
    _step([Signum(p, lr=0.5)], p, [g])
    assert torch.equal(p[0].detach(), -0.5 * torch.sign(g))


# ---- Muon ----------------------------------------------------------------------------------------------------------
def _newton_schulz(g: torch.Tensor) -> torch.Tensor:
    # Keller Jordan's quintic iteration as his post writes it: 5 steps, (a, b, c) = (3.4445, -4.775, 2.0315), here in
    # float64 (the optimizers' bfloat16 stays within 0.008 of it; one step more or less, or the cubic, is 0.1 away)
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 0.02), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_orthogonalize_is_the_quintic_newton_schulz_iteration(
    shape: tuple[int, int], dtype: torch.dtype, atol: float
) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = orthogonalize(g, dtype=dtype)
    assert got.dtype == dtype and got.shape == g.shape
    torch.testing.assert_close(got.double(), _newton_schulz(g), rtol=0, atol=atol)
    # what the iteration is for: every singular value near 1 (the quintic lands them in about [0.7, 1.2])
    singular = torch.linalg.svdvals(got.float())
    assert 0.6 < float(singular.min()) and float(singular.max()) < 1.25, singular


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_updates_matrices_as_torch_s_muon_and_a_reference(adjust_lr_fn: str | None, nesterov: bool) -> None:
    lr, momentum, decay = 0.02, 0.95, 0.1
    shapes = [(16, 48), (48, 16)]
    start = [torch.randn(s) for s in shapes]
    ours, theirs = _leaves(start), _leaves(start)
    settings = {"lr": lr, "weight_decay": decay, "momentum": momentum, "nesterov": nesterov}
    settings["adjust_lr_fn"] = adjust_lr_fn
    opt, reference = Muon(ours, **settings, ns_dtype="bfloat16"), torch.optim.Muon(theirs, **settings)
    expected, bufs = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for grads in _grads(shapes, steps=3):
        _step([opt], ours, grads)
        _step([reference], theirs, grads)
        for i, g in enumerate(grads):
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            update = _newton_schulz((1 - momentum) * g + momentum * bufs[i] if nesterov else bufs[i])
            rows, cols = shapes[i]
            scale = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn else math.sqrt(max(1, rows / cols))
            expected[i] = expected[i] * (1 - lr * decay) - lr * scale * update.float()
    for p, q, e in zip(ours, theirs, expected, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # torch's own Muon, op for op
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0.02 * lr * 2.0)  # the recipe, bfloat16 apart


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_muon_iterates_in_bfloat16_only_where_the_cpu_multiplies_it_natively(
    monkeypatch: pytest.MonkeyPatch, native: bool, dtype: torch.dtype
) -> None:
    # emulated bfloat16 (a CPU without AVX-512 BF16 or AMX) made a Muon step ~50x slower than float32 there
    from runner import optimizers

    monkeypatch.setattr(optimizers, "cpu_multiplies_bf16", lambda: native)
    assert optimizers.newton_schulz_dtype(torch.device("cpu")) == dtype
    assert optimizers.newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
    start, grads = [torch.randn(16, 48)], _grads([(16, 48)], steps=1)[0]
    ours, pinned = _leaves(start), _leaves(start)
    _step([Muon(ours, lr=0.02)], ours, grads)  # ns_dtype null: the device's
    _step([Muon(pinned, lr=0.02, ns_dtype=str(dtype).removeprefix("torch."))], pinned, grads)
    assert torch.equal(ours[0], pinned[0])
    with pytest.raises(ConfigError, match="ns_dtype must be null .* got 'fp8'"):
        Muon(_leaves(start), lr=0.02, ns_dtype="fp8")


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_muon_gives_every_other_parameter_adam_s_update(decay: float) -> None:
    # a runner-shaped model: a matrix group and a bias group (its own weight decay), plus a 0-D and a 3-D tensor
    shapes = [(8, 12), (8,), (), (2, 3, 4)]
    start = [torch.randn(s) for s in shapes]
    ours, theirs = _leaves(start), _leaves(start)
    groups = [{"params": [ours[0], ours[3]]}, {"params": ours[1:3], "weight_decay": 0.0}]
    opt = Muon(groups, lr=0.01, weight_decay=decay, adam_betas=(0.8, 0.99), adam_eps=1e-6, ns_dtype="bfloat16")
    adam = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}
    reference = [
        torch.optim.Muon([theirs[0]], lr=0.01, weight_decay=decay),
        torch.optim.AdamW([theirs[3]], weight_decay=decay, **adam),  # decoupled, as the matrices' decay
        torch.optim.Adam(theirs[1:3], **adam),
    ]
    for grads in _grads(shapes, steps=3):
        _step([opt], ours, grads)
        _step(reference, theirs, grads)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    assert set(opt.state[ours[1]]) == {"step", "exp_avg", "exp_avg_sq"} and float(opt.state[ours[1]]["step"]) == 3
    assert set(opt.state[ours[0]]) == {"momentum_buffer"}


def test_bad_settings_are_refused_as_config_errors() -> None:
    params = [torch.zeros(2, 2, requires_grad=True)]
    with pytest.raises(ConfigError, match="adjust_lr_fn"):
        Muon(params, lr=0.1, adjust_lr_fn="rms")
    with pytest.raises(ConfigError, match="momentum=1.0"):
        Signum(params, lr=0.1, momentum=1.0)
    with pytest.raises(ConfigError, match="lr=-0.1"):
        Muon(params, lr=-0.1)


# ---- state_dict ----------------------------------------------------------------------------------------------------
def _signum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return Signum([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}], lr=0.01)


def _muon(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return Muon([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=0.01)


SHAPES = [(10, 6), (6,)]


def _stepped(make: Callable, start: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> tuple[list, Any]:
    """Parameters from `start` and their optimizer `make(params)`, stepped once for each of `grads`."""
    params = _leaves(start)
    opt = make(params)
    for g in grads:
        _step([opt], params, g)
    return params, opt


@pytest.mark.parametrize("make", [_signum, _muon], ids=["signum", "muon"])
def test_an_optimizer_rebuilt_from_its_state_dict_continues_bit_for_bit(make: Callable) -> None:
    grads = _grads(SHAPES, steps=6)
    start = [torch.randn(s) for s in SHAPES]
    whole, _ = _stepped(make, start, grads)
    first, opt = _stepped(make, start, grads[:3])
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # as a checkpoint holds it: plain data that weights_only loads back
    saved.seek(0)
    resumed = _leaves([p.detach() for p in first])
    opt = make(resumed)
    opt.load_state_dict(torch.load(saved, weights_only=True))
    for g in grads[3:]:
        _step([opt], resumed, g)
    for p, q in zip(whole, resumed, strict=True):
        assert torch.equal(p, q)


# ---- a step dropped on the device ----------------------------------------------------------------------------------
def _state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]


def _flagged(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], flag: float) -> None:
    # as runner/precision.py hands the loop's non-finite flag to an optimizer that takes it on the device
    opt.found_inf = torch.tensor(flag)
    try:
        _step([opt], params, grads)
    finally:
        del opt.found_inf


@pytest.mark.parametrize("on_device", [True, False], ids=["device-path", "cpu-read"])
@pytest.mark.parametrize("make", [_signum, _muon], ids=["signum", "muon"])
def test_a_flagged_step_changes_nothing_and_an_unflagged_one_is_the_plain_step(make: Callable, on_device: bool) -> None:
    # device-path: the copies and torch.where a GPU takes (no host read), here on the CPU; cpu-read: the flag read
    grads = _grads(SHAPES, steps=3)
    start = [torch.randn(s) for s in SHAPES]
    plain, plain_opt = _stepped(make, start, grads)
    flagged, opt = _stepped(make, start, [])
    opt.reads_cpu_flag = not on_device
    _flagged(opt, flagged, [torch.full(s, float("nan")) for s in SHAPES], 1.0)  # a first step dropped: zero state
    assert all(torch.equal(p, q) for p, q in zip(flagged, start, strict=True))
    assert all(not t.any() for p in flagged for t in opt.state[p].values())
    for g in grads:
        before = _state(opt, flagged)
        _flagged(opt, flagged, [x.clone().fill_(float("inf")) for x in g], 1.0)  # dropped: nothing moves
        assert all(torch.equal(a, b) for a, b in zip(_state(opt, flagged), before, strict=True))
        _flagged(opt, flagged, g, 0.0)
    # the kept steps are the plain ones, step counts included (on the CPU the flag and the counts share a device)
    assert all(torch.equal(a, b) for a, b in zip(_state(opt, flagged), _state(plain_opt, plain), strict=True))


# ---- real runs -----------------------------------------------------------------------------------------------------
N = 15  # stopped at step N, trained to 2N
SAE = [
    "+experiment=sae",
    *("data.splits.d=32", "data.splits.n_features=64", "data.splits.n_val=256", "data.batch_size=64"),
    *("model.n_latents=96", "model.k=4", "model.dead_window=2st"),  # dead latents: AuxK is live
    f"trainer.max_duration={2 * N}st",
    *("trainer.log_interval=1st", "trainer.val_interval=10st", "logger=jsonl", "checkpoint.interval=1000st"),
]


# learning rates for 30 steps of this small SAE (the preset's own, 3e-3, is Adam's)
@pytest.mark.parametrize(("option", "lr"), [("signum", "3e-3"), ("muon", "1e-2")], ids=["signum", "muon"])
def test_an_sae_trains_with_it_and_resumes_exactly(compose_cfg: Callable, tmp_path: Path, option: str, lr: str) -> None:
    overrides = [*SAE, f"optimizer={option}", f"optimizer.lr={lr}"]
    whole, _ = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=N)
    assert type(whole.optimizer).__name__ == option.capitalize()
    losses = [loss for _, loss in values(tmp_path / "whole", "train/loss")]
    assert len(losses) == 2 * N and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses  # Adam at 3e-3: 0.88
    fve = [v for _, v in values(tmp_path / "whole", "val/fve")]
    assert len(fve) == 3 and fve[0] < fve[1] < fve[2], fve


# ---- optimizer.lr_scale --------------------------------------------------------------------------------------------
def _trained(compose_cfg: Callable, root: Path, name: str, *overrides: str) -> Any:
    from runner.train import train

    return train(compose_cfg(*SAE, *overrides, run_dir=root / name))


def test_lr_scale_steps_the_named_parameters_at_that_multiple_of_the_lr(compose_cfg: Callable, tmp_path: Path) -> None:
    # One Adam step from the same start: the encoder of lr 1e-2 scaled by 0.5 lands where lr 5e-3 takes it, and the
    # decoder where lr 1e-2 does.
    one = ("trainer.max_duration=1st", "scheduler=constant")
    plain = _trained(compose_cfg, tmp_path, "plain", *one, "optimizer.lr=1e-2").task
    half = _trained(compose_cfg, tmp_path, "half", *one, "optimizer.lr=5e-3").task
    scaled = _trained(
        compose_cfg, tmp_path, "scaled", *one, "optimizer.lr=1e-2", "+optimizer.lr_scale={W_enc:0.5,b_enc:0.5}"
    )
    for name in ("W_enc", "b_enc"):
        assert torch.equal(getattr(scaled.task, name), getattr(half, name)), name
        assert not torch.equal(getattr(scaled.task, name), getattr(plain, name)), name
    for name in ("W_dec", "b_dec"):
        assert torch.equal(getattr(scaled.task, name), getattr(plain, name)), name
    assert [group["lr"] for group in scaled.optimizer.param_groups] == [1e-2, 1e-2, 5e-3, 5e-3]


class GroupLrs(Callback):
    """Every step's lr of every parameter group, with whether the group holds the encoder."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[bool, float]]] = []

    def on_optimizer_step(self, run: Run) -> None:
        encoder = {id(run.task.W_enc), id(run.task.b_enc)}
        self.steps.append([(id(g["params"][0]) in encoder, g["lr"]) for g in run.optimizer.param_groups])


def test_lr_scale_holds_through_the_schedule_and_resumes_exactly(compose_cfg: Callable, tmp_path: Path) -> None:
    from runner.train import train

    overrides = [*SAE, "+optimizer.lr_scale={W_enc:0.4,b_enc:0.4}"]
    assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=N)
    lrs = GroupLrs()
    train(compose_cfg(*overrides, run_dir=tmp_path / "lrs"), extra_callbacks=[lrs])
    assert [[encoder for encoder, _ in groups] for groups in lrs.steps] == [[False, False, True, True]] * 2 * N
    base = [groups[0][1] for groups in lrs.steps]
    assert base[-1] < base[0]  # wsd's decay seen
    for groups, lr in zip(lrs.steps, base, strict=True):
        assert [g for _, g in groups] == pytest.approx([lr, lr, 0.4 * lr, 0.4 * lr], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("pattern", ["W_en", "encoder.*"])
def test_an_lr_scale_that_names_no_parameter_is_refused_with_the_names(compose_cfg: Callable, pattern: str) -> None:
    from runner.build import build

    with pytest.raises(ConfigError, match=r"match none of the trained parameters \(W_dec, W_enc, b_enc, b_dec\)"):
        build(compose_cfg(*SAE, f"+optimizer.lr_scale={{{pattern}:0.5}}"))


@pytest.mark.parametrize("value", ["-0.5", "inf", "fast", "true"])
def test_an_lr_scale_that_is_not_a_finite_number_at_least_0_is_refused(compose_cfg: Callable, value: str) -> None:
    from runner.build import build

    with pytest.raises(ConfigError, match=r"optimizer.lr_scale's values must be finite numbers >= 0"):
        build(compose_cfg(*SAE, f"+optimizer.lr_scale={{W_enc:{value}}}"))


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_torch_s_optimizers_are_fused_on_the_cpu_unless_asked_not_to_be(
    optimizer: str, built: Callable[..., tuple[Any, Run]]
) -> None:
    # fused: one kernel for every tensor (3x torch's default for-loop on a tiny MLP's step, 10x on an SAE's), and the
    # non-finite flag taken on the device; false: torch's own default, for a loop that must match another's bits
    _, run = built("+experiment=digits", f"optimizer={optimizer}", "logger=none")
    assert run.device.type == "cpu" and run.optimizer.defaults["fused"] is True
    assert getattr(run.optimizer, "_step_supports_amp_scaling", False)  # the loop hands it the flag: no host read
    _, run = built("+experiment=digits", f"optimizer={optimizer}", "logger=none", "optimizer.fused=false")
    assert not run.optimizer.defaults["fused"]
