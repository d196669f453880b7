"""The loop's promises, in-process on a tiny regression task: learning, accumulation, non-finite steps, callbacks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import Regression, make_run, regression_data
from torch import nn

from runner import ConfigError
from runner.callbacks.early_stopping import EarlyStopping
from runner.callbacks.ema import EMA
from runner.config.monitors import check_monitors
from runner.data import DataModule, TensorData
from runner.distributed.strategies import Single
from runner.loop import fit
from runner.run import Callback, Run
from runner.schedulers import plateau


class Recorder(Callback):
    """Remembers the loss logged at each step and the weights after each optimizer step."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_optimizer_step(self, run: Run) -> None:
        self.weights.append(run.task.linear.weight.detach().clone())


class ListLogger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def _losses(run: Run) -> list[float]:
    logger = ListLogger()
    run.loggers.append(logger)
    fit(run)
    return [m["train/loss"] for _, m in logger.rows if "train/loss" in m]


def test_twenty_steps_lower_the_loss():
    losses = _losses(make_run(max_duration="20st"))
    assert len(losses) == 20
    assert losses[-1] < 0.2 * losses[0]


def test_seeded_runs_reproduce_their_losses():
    assert _losses(make_run(max_duration="10st")) == _losses(make_run(max_duration="10st"))


def test_accumulation_matches_one_big_batch():
    # 4 micro-batches of 8 with accumulation 4 == one batch of 32: the loss is divided by the window size.
    small = make_run(max_duration="1st", batch_size=8, accumulate=4, shuffle=False)
    big = make_run(max_duration="1st", batch_size=32, accumulate=1, shuffle=False)
    fit(small)
    fit(big)
    assert small.progress.micro_batch == 4 and big.progress.micro_batch == 1
    torch.testing.assert_close(small.task.linear.weight, big.task.linear.weight, rtol=1e-5, atol=1e-6)


def test_short_epoch_end_window_is_a_mean_over_its_own_micro_batches():
    # 64 samples / batch 8 = 8 micro-batches; accumulation 3 -> windows of 3, 3, 2. The last step's gradient must
    # equal that of one batch of 16 made of the last two micro-batches (divided by 2, not by 3).
    acc = make_run(max_duration="1ep", batch_size=8, accumulate=3, shuffle=False, lr=0.0)
    rec = Recorder()
    grads = []
    acc.callbacks.append(rec)
    acc.optimizer.register_step_pre_hook(lambda *_: grads.append(acc.task.linear.weight.grad.detach().clone()))
    fit(acc)
    assert acc.progress.step == 3 and acc.progress.micro_batch == 8
    x, y = regression_data()["train"].tensors
    ref = Regression()
    ref.load_state_dict(acc.task.state_dict())
    loss = ((ref.linear(x[48:]) - y[48:]) ** 2).mean()
    loss.backward()
    torch.testing.assert_close(grads[-1], ref.linear.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch_size, accumulate", [(16, 2), (8, 4), (4, 8)])
def test_the_short_last_step_of_an_epoch_is_the_mean_over_its_samples_however_it_is_split(batch_size, accumulate):
    # 50 samples in global batches of 32: the epoch's second step has 18 samples, cut into micro-batches of unequal
    # sizes (16 x 2: 9 + 9; 8 x 4: 6 + 6 + 6; 4 x 8: 4 + 4 + 4 + 3 + 3). Each micro-batch's loss is weighted by its
    # share of the 18, so both steps equal those of one batch of 32 and one of 18, over two epochs.
    splits = regression_data(50)
    one = make_run(max_duration="2ep", batch_size=32, splits=splits, lr=0.1)
    split = make_run(max_duration="2ep", batch_size=batch_size, accumulate=accumulate, splits=splits, lr=0.1)
    fit(one)
    fit(split)
    assert one.progress.step == split.progress.step == 4
    assert one.progress.samples == split.progress.samples == 100
    torch.testing.assert_close(split.task.linear.weight, one.task.linear.weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["host-flag", "device-flag"])
def test_nonfinite_loss_skips_the_step_and_stops_after_the_limit(fused: bool):
    # Micro-batches 1-5 are fine, every later loss is NaN: weights must freeze at step 5 and the run must stop
    # after exactly 3 skipped steps in a row (logged every step). Fused SGD drops the update on the device.
    run = make_run(Regression(poison_from=5), max_duration="50st", max_nonfinite_steps=3, fused=fused)
    rec = Recorder()
    run.callbacks.append(rec)
    fit(run)
    assert run.stop_reason == "nonfinite"
    assert run.state.nonfinite_steps == 3
    assert run.progress.step == 8  # skipped steps still advance time
    for w in rec.weights[5:]:
        torch.testing.assert_close(w, rec.weights[4], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in run.task.parameters())


def test_the_nonfinite_limit_is_enforced_at_the_first_log_step_that_sees_the_streak():
    # Skipped steps are counted on the device and read at log steps (every 5th): the streak reaches 3 at step 8,
    # the run stops at step 10 with 5 skipped steps, its weights still those of step 5.
    run = make_run(
        Regression(poison_from=5), max_duration="50st", max_nonfinite_steps=3, fused=True, log_interval="5st"
    )
    rec = Recorder()
    run.callbacks.append(rec)
    fit(run)
    assert (run.stop_reason, run.progress.step, run.state.nonfinite_steps) == ("nonfinite", 10, 5)
    assert run.state.metrics["train/nonfinite_steps"] == 5
    torch.testing.assert_close(rec.weights[-1], rec.weights[4], rtol=0, atol=0)


def test_a_streak_broken_between_two_log_steps_does_not_stop_the_run():
    class TwoBad(Regression):
        def training_step(self, batch):
            out = super().training_step(batch)
            return {"loss": out["loss"] * float("nan")} if self.calls in (3, 4, 7, 8) else out

    run = make_run(TwoBad(), max_duration="12st", max_nonfinite_steps=3, fused=True, log_interval="6st")
    fit(run)
    assert (run.stop_reason, run.state.nonfinite_steps, run.state.nonfinite_in_a_row) == ("max_duration", 4, 0)


def test_fp16_loss_scaling_also_skips_a_nonfinite_loss_and_backs_the_scale_off():
    from runner.precision import ScaledAutocast

    # Its first steps overflow while the scaler finds its scale: skipped by the scaler, not counted as non-finite.
    clean = make_run(Regression(), max_duration="6st", fused=True, precision=ScaledAutocast("fp16"))
    fit(clean)
    run = make_run(Regression(poison_from=5), max_duration="6st", fused=True, precision=ScaledAutocast("fp16"))
    rec = Recorder()
    run.callbacks.append(rec)
    fit(run)
    assert (clean.state.nonfinite_steps, run.state.nonfinite_steps) == (0, 1)
    torch.testing.assert_close(rec.weights[-1], rec.weights[4], rtol=0, atol=0)
    assert run.precision.scaler.get_scale() == clean.precision.scaler.get_scale() / 2  # one more back-off


def test_a_batch_whose_tokens_differ_from_data_tokens_per_sample_is_refused():
    class Counted(TensorData):
        def __getitems__(self, indices):
            x, y = super().__getitems__(indices)
            return {"x": x, "y": y, "num_tokens": 3 * len(indices) + 1}

    class Task(Regression):
        def training_step(self, batch):
            return super().training_step((batch["x"], batch["y"]))

    data = regression_data()
    run = make_run(Task(), splits={"train": Counted(*data["train"].tensors)})
    run.val_loader = None
    run.progress.tokens_per_sample = 3
    with pytest.raises(ConfigError, match=r"data.tokens_per_sample=3, but 8 samples came with num_tokens=25"):
        fit(run)


def test_nonfinite_gradient_norm_is_also_skipped():
    class InfGrad(Regression):
        def training_step(self, batch):
            out = super().training_step(batch)
            if self.calls > 2:
                out["loss"] = out["loss"] + self.linear.weight.sum() * 0 + torch.sqrt(self.linear.bias * 0).sum()
            return out

    run = make_run(InfGrad(), max_duration="10st", max_nonfinite_steps=2)
    fit(run)
    assert run.stop_reason == "nonfinite" and run.state.nonfinite_steps == 2


def test_early_stopping_after_exactly_patience_bad_validations_and_restores_best():
    # Validate every step with a learning rate so high the loss explodes after the first steps.
    class Diverging(Regression):
        pass

    stopper = EarlyStopping(monitor="val/loss", patience=3, restore_best=True)
    rec = Recorder()
    logger = ListLogger()
    run = make_run(Diverging(), max_duration="100st", lr=0.5, val_interval="1st", callbacks=[rec, stopper])
    run.loggers.append(logger)
    fit(run)
    vals = [(s, m["val/loss"]) for s, m in logger.rows if "val/loss" in m]
    assert run.stop_reason == "early_stopping"
    best_step, best = min(vals, key=lambda sv: sv[1])
    # stopped exactly `patience` validations after the best one
    assert run.progress.step == best_step + 3
    assert stopper.best.value == best and stopper.best.step == best_step
    # restore_best put the weights of the best validation back
    torch.testing.assert_close(run.task.linear.weight, rec.weights[best_step - 1])
    assert math.isclose(run.state.metrics["val/loss"], best, rel_tol=1e-6)


def test_plateau_steps_once_per_validation_and_needs_a_validation_metric():
    class Flat(Regression):
        def validation_step(self, batch):
            return {"loss": torch.tensor(1.0)}

    run = make_run(Flat(), max_duration="4ep", schedule=lambda **kw: plateau(patience=0, factor=0.5, **kw), lr=0.01)
    fit(run)
    # the validation loss never improves after the first of 4 validations (+1 final, unhooked): 3 halvings, not 3 x 8
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)
    no_val = make_run(schedule=plateau, splits={"train": regression_data()["train"]})
    with pytest.raises(ConfigError, match="never validates"):
        check_monitors(no_val)


def test_ema_tracks_the_average_and_validates_with_it():
    ema = EMA(decay=0.9, every="1st", validate_with_ema=True, apply_at_end=False)
    rec = Recorder()
    run = make_run(max_duration="5st", callbacks=[rec, ema], val_interval="100st")
    start = run.task.linear.weight.detach().clone()
    fit(run)
    expected = start
    for w in rec.weights:
        expected = expected + 0.1 * (w - expected)
    shadow = ema.state_dict()["shadow"]["linear.weight"]
    torch.testing.assert_close(shadow, expected)
    # apply_at_end=False keeps the live weights; the final validation ran on the EMA weights and swapped back
    torch.testing.assert_close(run.task.linear.weight, rec.weights[-1])


def test_several_ema_decays_are_each_tracked_validated_saved_and_resumed(tmp_path):
    from safetensors.torch import load_file

    from runner.validation import evaluate_loader

    ema = EMA(decay=[0.9, 0.5], every="1st", validate_with_ema=True, apply_at_end=False, run_dir=str(tmp_path))
    rec, logger = Recorder(), ListLogger()
    run = make_run(max_duration="5st", callbacks=[rec, ema], val_interval="5st")
    run.loggers.append(logger)
    start = run.task.linear.weight.detach().clone()
    fit(run)
    for decay, key in ((0.9, "0.9"), (0.5, "0.5")):
        expected = start
        for w in rec.weights:
            expected = expected + (1 - decay) * (w - expected)
        torch.testing.assert_close(ema.state_dict()["shadows"][key]["linear.weight"], expected)
    saved = ema.state_dict()
    assert saved["shadow"]["linear.weight"] is saved["shadows"]["0.9"]["linear.weight"]  # the first is the run's
    # the second average, validated on its own after the run's validation, and written at the end
    val = [m for _, m in logger.rows if "val/ema_0.5/loss" in m][0]
    live = {k: v.clone() for k, v in run.task.state_dict().items()}
    run.task.load_state_dict(saved["shadows"]["0.5"])
    again = evaluate_loader(run.task, run.val_loader, run.precision, run.device)
    assert val["val/ema_0.5/loss"] == pytest.approx(again["val/loss"], rel=1e-12)
    assert val["val/loss"] != val["val/ema_0.5/loss"]
    file = load_file(tmp_path / "model.ema_0.5.safetensors")
    torch.testing.assert_close(file["linear.weight"], saved["shadows"]["0.5"]["linear.weight"])
    run.task.load_state_dict(live)
    # resume: both averages come back; a checkpoint of one decay resumes a one-decay EMA, and refuses a new decay
    back = EMA(decay=[0.9, 0.5])
    back.load_state_dict(saved)
    assert torch.equal(back.shadows[1][0], ema.shadows[1][0])
    old = {"shadow": saved["shadow"]}
    EMA(decay=0.9).load_state_dict(old)
    with pytest.raises(ConfigError, match=r"no average for \['0.5'\]"):
        EMA(decay=[0.9, 0.5]).load_state_dict(old)
    with pytest.raises(ConfigError, match="distinct"):
        EMA(decay=[0.9, 0.9])


def test_gradient_clipping_bounds_the_update():
    run = make_run(max_duration="1st", lr=1.0, clip=1e-3, shuffle=False)
    before = [p.detach().clone() for p in run.task.parameters()]
    fit(run)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(run.task.parameters(), before, strict=True)])
    assert delta.norm().item() == pytest.approx(1e-3, rel=1e-4)


def test_early_stopping_keeps_the_ema_weights_it_validated():
    # [ema, early_stopping]: validation runs on the EMA weights, restore_best keeps those, and the final evaluation
    # (summary metrics) is of exactly the weights that were best.
    ema = EMA(decay=0.5, every="1st", validate_with_ema=True, apply_at_end=True)
    stopper = EarlyStopping(monitor="val/loss", patience=2, restore_best=True)
    logger = ListLogger()
    run = make_run(max_duration="12st", lr=0.5, val_interval="1st", callbacks=[ema, stopper])
    run.loggers.append(logger)
    fit(run)
    vals = {s: m["val/loss"] for s, m in logger.rows if "val/loss" in m}
    best_step = min(vals, key=vals.get)
    assert stopper.best.step == best_step
    torch.testing.assert_close(run.task.state_dict()["linear.weight"], stopper.best_weights["linear.weight"])
    assert math.isclose(run.state.metrics["val/loss"], vals[best_step], rel_tol=1e-6)


def test_logged_lr_is_the_lr_each_step_used_and_the_last_partial_window_is_logged():
    from runner.schedulers import constant as warm

    logger = ListLogger()
    run = make_run(max_duration="7st", schedule=lambda **kw: warm(warmup="4st", **kw), lr=1.0, val_interval="100st")
    used = []
    run.optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    run.settings = dataclasses.replace(run.settings, log_interval=run.progress.resolve("3st"))
    run.loggers.append(logger)
    fit(run)
    rows = {s: m for s, m in logger.rows}
    assert sorted(rows) == [3, 6, 7]  # the 7th step closes a partial window and still gets a row
    assert [rows[s]["train/lr"] for s in (3, 6, 7)] == pytest.approx([used[2], used[5], used[6]])
    assert used[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


class _Tokens(TensorData):
    """Rows of 1 to 4 tokens: a batch reports how many it holds."""

    def __getitems__(self, indices):
        x, y = super().__getitems__(indices)
        return {"x": x, "y": y, "num_tokens": int(x[:, 0].abs().ceil().clamp(1, 4).sum())}


class _TwoIdenticalRanks(Single):
    """What the loop sees of a second rank that holds the same data: every sum over ranks doubles."""

    world_size = 2

    def all_sum(self, tensor):
        return tensor * 2


def test_tokens_are_summed_over_ranks_once_per_step():
    x, y = regression_data(48)["train"].tensors
    task = Regression()
    task.training_step = lambda batch: {"loss": ((task.linear(batch["x"]) - batch["y"]) ** 2).mean()}
    run = make_run(task, max_duration="3st", batch_size=8, accumulate=2, splits={"train": _Tokens(x, y)})
    run.strategy = _TwoIdenticalRanks("cpu")
    local = []
    for step, batch in enumerate(run.train_loader):
        local.append(batch["num_tokens"])
        if step == 5:
            break
    fit(run)
    assert run.progress.tokens == 2 * sum(local) and run.progress.step == 3


def test_token_duration_without_tokens_stops_at_once():
    run = make_run(max_duration="1e4tok")
    with pytest.raises(ConfigError, match="carry none"):
        fit(run)
    assert run.progress.step == 1


def test_task_without_validation_step_is_never_validated():
    class TrainOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def training_step(self, batch):
            return Regression.training_step(self, batch)

    task = TrainOnly()
    task.poison_from, task.calls = None, 0
    run = make_run(task, max_duration="3st")
    run.val_loader = None  # what build does for a task without validation_step
    fit(run)
    assert run.stop_reason == "max_duration" and not any(k.startswith("val/") for k in run.state.metrics)


def test_ema_listed_after_early_stopping_with_restore_best_is_refused():
    run = make_run(callbacks=[EarlyStopping(restore_best=True), EMA()])
    with pytest.raises(ConfigError, match="list ema before early_stopping"):
        fit(run)


def _hand_loop(steps: int, clip: float, accumulate: int = 1) -> tuple[torch.Tensor, list[float], list[float]]:
    """The same training as make_run(), written by hand with clip_grad_norm_: weights, losses and grad norms."""
    torch.manual_seed(0)
    task = Regression()
    train = DataModule(regression_data(), batch_size=8, seed=0).train_loader()
    opt = torch.optim.SGD(task.parameters(), lr=0.05)
    losses, norms, step, epoch, window = [], [], 0, 0, []
    while step < steps:
        train.batch_sampler.set_epoch(epoch)
        for batch in train:
            loss = task.training_step(batch)["loss"]
            (loss / accumulate).backward()
            window.append(loss.item())
            if len(window) < accumulate:
                continue
            norms.append(torch.nn.utils.clip_grad_norm_(task.parameters(), clip, foreach=True).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(sum(window) / accumulate)
            window, step = [], step + 1
            if step == steps:
                break
        epoch += 1
    return torch.cat([p.detach().flatten() for p in task.parameters()]), losses, norms


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_and_logged_norms_match_clip_grad_norm_exactly(accumulate):
    # clip=6.0 is crossed by the early steps only: both the clipped and the unclipped path must equal torch's
    # clip_grad_norm_ bit for bit, and the logged loss and grad norm are the per-step values (log every step).
    weights, losses, norms = _hand_loop(24, clip=6.0, accumulate=accumulate)
    assert min(norms) < 6.0 < max(norms)
    logger = ListLogger()
    run = make_run(max_duration="24st", clip=6.0, accumulate=accumulate, val_interval="100st")
    run.loggers.append(logger)
    fit(run)
    assert torch.equal(torch.cat([p.detach().flatten() for p in run.task.parameters()]), weights)
    rows = [m for _, m in logger.rows if "train/loss" in m]
    assert [r["train/loss"] for r in rows] == pytest.approx(losses, rel=1e-6)
    assert [r["train/grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-6)


def test_profiler_writes_a_trace_and_the_top_ops(tmp_path, capsys):
    import json

    from runner.callbacks.profiler import Profiler

    fit(make_run(max_duration="10st", callbacks=[Profiler(dir=str(tmp_path), start="2st", length="3st")]))
    trace = json.loads((tmp_path / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3
    table = (tmp_path / "top_ops.txt").read_text()
    assert table.startswith(
        "steps 4-6\n"
    )  # step 3 is the profiler's warm-up and "Self CPU" in table and "aten::" in table
    assert len([line for line in table.splitlines() if "aten::" in line or "#" in line]) <= 10
    assert "steps 4-6" in capsys.readouterr().err


def test_profiler_window_cut_short_by_the_end_is_still_written(tmp_path):
    from runner.callbacks.profiler import Profiler

    fit(make_run(max_duration="6st", callbacks=[Profiler(dir=str(tmp_path), start="4st", length="10st")]))
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "top_ops.txt").read_text().startswith("steps 6-6\n")


def test_profiler_window_shorter_than_a_step_is_refused(tmp_path):
    from runner.callbacks.profiler import Profiler

    with pytest.raises(ConfigError, match="at least one optimizer step"):
        fit(make_run(callbacks=[Profiler(dir=str(tmp_path), length="0st")]))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("23h50m", 85800), ("90m", 5400), ("1d", 86400), ("45s", 45), ("1h30m15s", 5415), (12.5, 12.5)],
)
def test_parse_time(text, seconds):
    from runner.durations import parse_time

    assert parse_time(text) == seconds


def test_parse_time_rejects_nonsense():
    from runner.durations import parse_time

    with pytest.raises(ConfigError, match="23h50m"):
        parse_time("soon")


def test_max_time_stops_after_the_step_without_an_extra_validation_or_log():
    from runner.callbacks.time_limit import TimeLimit

    logger = ListLogger()
    run = make_run(max_duration="20st", val_interval="1st", callbacks=[TimeLimit(1e-9)])
    run.settings = dataclasses.replace(run.settings, log_interval=run.progress.resolve("2st"))
    run.loggers.append(logger)
    fit(run)
    assert run.stop_reason == "max_time" and run.progress.step == 1
    assert logger.rows == [(1, logger.rows[0][1])] and "train/loss" not in logger.rows[0][1]  # validation only


SAE_MMCS = [
    "+experiment=sae",
    *("data.splits.d=32", "data.splits.n_features=64", "data.splits.n_val=256", "data.batch_size=64"),
    *("model.n_latents=96", "model.k=4", "trainer.max_duration=40st", "trainer.val_interval=10st"),
    *("logger=jsonl", "checkpoint.interval=1000st", "monitor=val/mmcs", "mode=max"),
]


def test_the_best_value_and_a_plateau_schedule_follow_a_metric_a_callback_adds(compose_cfg, tmp_path):
    # val/mmcs comes from the sae_ground_truth callback, not from validation_step
    from helpers import values

    from runner.train import train

    cfg = compose_cfg(*SAE_MMCS, "scheduler=plateau", "scheduler.patience=0", "scheduler.threshold=0.5")
    run = train(cfg)
    mmcs = values(tmp_path / "run", "val/mmcs")
    assert len(mmcs) == 4
    best = max(mmcs, key=lambda row: row[1])
    assert (run.state.best.value, run.state.best.step) == (best[1], best[0])
    # no validation after the first betters the best by half: each halves the lr (patience 0)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr / 2**3)


def test_a_callback_reading_a_metric_a_later_listed_callback_adds_is_refused(compose_cfg):
    from runner.build import build

    build(compose_cfg(*SAE_MMCS, "callbacks=[early_stopping,sae_ground_truth]"))  # reads it after it is added
    with pytest.raises(ConfigError, match=r"EarlyStopping monitors 'val/mmcs', which GroundTruthRecovery adds after"):
        build(compose_cfg(*SAE_MMCS, "callbacks=[sae_ground_truth,early_stopping]"))
