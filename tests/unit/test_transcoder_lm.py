"""+experiment=transcoder_lm: a transcoder on a trained GPT's MLP, its rows [MLP input | MLP output] hooked from one
forward, and the GPT's loss with the MLP's output replaced by a function of its input (source.Splice)."""

from __future__ import annotations

import copy
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import finished_run, hf_text, tiny_hf_model

from experiments.sae.coders.base import SAE
from experiments.sae.metrics import loss_recovered
from experiments.sae.sources.hooked import CachedActivations, LiveActivations
from experiments.sae.sources.source import SourceModel, Splice
from runner import ConfigError
from runner.build import build

NORM, MLP = "blocks.1.mlp_norm", "blocks.1.mlp"
SMALL = [
    "model.n_latents=128",
    "model.k=8",
    "data.batch_size=128",
    "data.buffer_size=1024",
    "data.samples_per_epoch=4096",
    "trainer.max_duration=24st",
    "trainer.val_interval=24st",
    "trainer.log_interval=8st",
    "optimizer.lr=5e-3",  # a fit worth testing (FVE 0.84) in a few steps
    "logger=none",
    "checkpoint=none",
]


def hand_captured(model: torch.nn.Module, batch: dict, names: list[str]) -> list[torch.Tensor]:
    """The named modules' outputs of one validation forward, positions from the second on, as [rows, d]."""
    got: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda _m, _i, out, name=name: got.setdefault(name, out))
        for name in names
    ]
    with torch.no_grad():
        model.validation_step(batch)
    for handle in handles:
        handle.remove()
    return [got[name][:, 1:].flatten(0, 1) for name in names]


def test_hooked_rows_are_the_mlp_input_then_its_output(lm_run: Path) -> None:
    loader = {"batch_size": 64, "seed": 0}
    data = LiveActivations(
        str(lm_run), NORM, buffer_size=256, samples_per_epoch=1024, target=MLP, skip_positions=1, **loader
    )
    assert data.model_args == {"d_in": 32, "d_out": 32}
    source = SourceModel(str(lm_run), "blocks.0", skip_positions=1)  # the same frozen GPT and validation inputs
    hand = [torch.cat(hand_captured(source.model, batch, [NORM, MLP]), 1) for batch in source.data.val_loader()]
    assert torch.equal(data.splits["val"].tensors[0], torch.cat(hand))
    # the training stream (shuffled) pairs each position's input with its output: the MLP maps one to the other
    (rows,) = data.splits["train"].__getitems__(list(range(64)))
    with torch.no_grad():
        assert torch.allclose(source.model.blocks[1].mlp(rows[:, :32]), rows[:, 32:], atol=1e-6)
    assert not torch.allclose(rows[:, :32], rows[:, 32:], atol=1e-3)


def test_the_activation_cache_of_a_transcoder_is_not_an_sae_s(lm_run: Path, tmp_path: Path) -> None:
    cache = {"cache": str(tmp_path / "cache"), "cache_rows": 128, "cache_shard_rows": 64, "batch_size": 64}
    sae = CachedActivations(str(lm_run), NORM, skip_positions=1, **cache)
    assert sae.splits["train"].__getitems__([0, 1])[0].shape == (2, 32)
    with pytest.raises(ConfigError, match=r"activation cache .* written from blocks.1.mlp_norm .*another data.cache"):
        CachedActivations(str(lm_run), NORM, target=MLP, skip_positions=1, **cache)
    again = dict(cache, cache=str(tmp_path / "transcoder"))
    rows = CachedActivations(str(lm_run), NORM, target=MLP, skip_positions=1, **again).splits["train"]
    assert rows.__getitems__([0, 1])[0].shape == (2, 64)


def test_a_splice_writing_the_mlp_s_own_function_of_its_input_is_the_clean_model(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), NORM, skip_positions=1, target=MLP)
    # copies: the hooked modules themselves, called inside their own hooks, would run those hooks again
    mlps = [copy.deepcopy(source.model.blocks[i].mlp) for i in (0, 1)]
    zeros = Splice([NORM], {MLP: lambda captured: torch.zeros_like(captured[NORM])})
    # every layer's MLP input read and output written, as a cross-layer transcoder's replacement model would be
    every = Splice(
        [f"blocks.{i}.mlp_norm" for i in (0, 1)],
        {f"blocks.{i}.mlp": lambda got, i=i: mlps[i](got[f"blocks.{i}.mlp_norm"]) for i in (0, 1)},
    )
    # layer 0's output zeroed: layer 1's input, read when it runs, is the spliced stream's, so layer 1 is the model's
    first_zeroed = Splice(
        every.reads, {**every.writes, "blocks.0.mlp": lambda got: torch.zeros_like(got["blocks.0.mlp_norm"])}
    )
    got = source.compare(
        {
            "clean": None,
            "mlp": Splice([NORM], {MLP: lambda captured: mlps[1](captured[NORM])}),
            "zeros": zeros,
            "zero_ablated": (MLP, torch.zeros_like),
            "every": every,
            "first_zeroed": first_zeroed,
            "first_ablated": ("blocks.0.mlp", torch.zeros_like),
        }
    )
    for name in ("mlp", "every"):
        assert got[name]["ce"] == pytest.approx(got["clean"]["ce"], rel=1e-6) and got[name]["kl"] < 1e-9, name
    assert got["zeros"] == got["zero_ablated"] and got["zeros"]["kl"] > 1e-5
    assert got["first_zeroed"]["ce"] == pytest.approx(got["first_ablated"]["ce"], rel=1e-6)
    assert got["first_zeroed"]["kl"] == pytest.approx(got["first_ablated"]["kl"], rel=1e-4)
    assert got["first_zeroed"]["kl"] > 1e-5 and got["first_zeroed"]["ce"] != got["zeros"]["ce"]
    # by hand: the MLP's output zero from the second position on, the first kept
    losses, sizes = [], []
    handle = source.model.blocks[1].mlp.register_forward_hook(
        lambda _m, _i, out: torch.cat([out[:, :1], torch.zeros_like(out[:, 1:])], 1)
    )
    with torch.no_grad():
        for batch in source.data.val_loader():
            losses.append(float(source.model.validation_step(batch)["loss"]))
            sizes.append(len(batch["tokens"]))
    handle.remove()
    hand = sum(loss * size for loss, size in zip(losses, sizes, strict=True)) / sum(sizes)
    assert got["zeros"]["ce"] == pytest.approx(hand, rel=1e-6)


def test_a_splice_that_reads_and_writes_one_module_is_the_function_form(lm_run: Path) -> None:
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    half = Splice(["blocks.1"], {"blocks.1": lambda captured: captured["blocks.1"] / 2})
    got = source.compare({"fn": lambda acts: acts / 2, "splice": half, "tuple": ("blocks.1", lambda acts: acts / 2)})
    assert got["fn"] == got["splice"] == got["tuple"] and got["fn"]["kl"] > 0


@pytest.mark.parametrize(
    ("module", "target", "message"),
    [
        (NORM, "blocks.1.nope", r"source.target='blocks.1.nope' is not a module of GPT: .*blocks.1.mlp_norm"),
        (MLP, MLP, r"source.target=blocks.1.mlp is source.module itself: .*source.target=null"),
        ([NORM, "blocks.0.mlp_norm"], MLP, r"a transcoder reads one module for now; give one source.module"),
    ],
)
def test_a_target_that_cannot_be_one_is_refused(lm_run: Path, module: str | list, target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SourceModel(str(lm_run), module, skip_positions=1, target=target)


def test_a_target_of_other_positions_is_refused(compose_cfg: Callable, lm_run: Path) -> None:
    source = SourceModel(str(lm_run), NORM, skip_positions=1, target=MLP)
    batch = next(iter(source.data.val_loader()))
    flat = source.model.blocks[1].mlp.register_forward_hook(lambda _m, _i, out: out.flatten(0, 1))  # [B * T, d]
    with pytest.raises(
        ConfigError,
        match=r"source.target=blocks.1.mlp outputs \[\d+, 32\] but source.module="
        r"blocks.1.mlp_norm outputs \[\d+, 32, 32\]: not the same positions",
    ):
        source.activations(batch)
    flat.remove()
    assert source.activations(batch).shape[1] == 64
    with pytest.raises(ConfigError, match=r"source.target='blocks.9.mlp' is not a module of GPT"):
        build(
            compose_cfg(
                "+experiment=transcoder_lm",
                f"source.checkpoint={lm_run}",
                "source.layer=1",
                "source.target=blocks.9.mlp",
            )
        )


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf)")
def test_a_transformers_mlp_is_read_and_replaced_at_its_unmasked_positions(tmp_path: Path) -> None:
    # GPT-2's MLP input (ln_2) and output; its special tokens (BOS, EOS) masked: they keep the model's own output
    inputs = {"paths": hf_text(tmp_path / "text"), "val_every": 2, "context": 16, "batch_size": 4}
    norm, mlp = "transformer.h.1.ln_2", "transformer.h.1.mlp"
    source = SourceModel(str(tiny_hf_model(tmp_path / "gpt2", "gpt2")), norm, inputs=inputs, target=mlp)
    own = copy.deepcopy(source.model.get_submodule(mlp))
    batch = next(iter(source.data.val_loader()))
    rows = source.activations(batch)
    assert source.widths == {norm: 32, mlp: 32} and len(rows) == int(source.mask(batch).sum())
    with torch.no_grad():
        assert torch.allclose(own(rows[:, :32]), rows[:, 32:], atol=1e-6)
    seen: list[int] = []

    def zeros(captured: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(len(captured[norm]))
        return torch.zeros_like(captured[norm])

    got = source.compare(
        {
            "clean": None,
            "own": Splice([norm], {mlp: lambda captured: own(captured[norm])}),
            "zeros": Splice([norm], {mlp: zeros}),
            "zero_ablated": (mlp, torch.zeros_like),
        }
    )
    assert got["own"]["ce"] == pytest.approx(got["clean"]["ce"], rel=1e-6) and got["own"]["kl"] < 1e-9
    assert got["zeros"] == got["zero_ablated"] and got["zeros"]["kl"] > 1e-6
    assert sum(seen) == sum(int(source.mask(b).sum()) for b in source.data.val_loader())


@pytest.mark.skipif("d_out" not in inspect.signature(SAE.__init__).parameters, reason="the SAE has no d_out yet")
def test_transcoder_lm_trains_and_reports_the_spliced_mlp(lm_run: Path, tmp_path: Path) -> None:
    run = finished_run(tmp_path, "+experiment=transcoder_lm", f"source.checkpoint={lm_run}", "source.layer=1", *SMALL)
    assert (run.task.d_in, run.task.d_out) == (32, 32)
    m = run.state.metrics
    assert 0.5 < m["val/fve"] <= 1 and 0 < m["val/l0"] <= 8
    assert m["val/ce_clean"] < m["val/ce_zero_ablated"] and m["val/ce_clean"] < m["val/ce_mean_ablated"], m
    # (ablated - spliced) / (ablated - clean); NaN where zeroing this tiny GPT's MLP moves its loss by under 0.1%
    expected, _ = loss_recovered(m["val/ce_zero_ablated"], m["val/ce_spliced"], m["val/ce_clean"])
    assert m["val/loss_recovered"] == pytest.approx(expected, nan_ok=True)
    # what was spliced is the transcoder of the MLP's input in place of its output, and the ablations are the MLP's
    source = SourceModel(str(lm_run), NORM, skip_positions=1, target=MLP)
    sae = run.task.eval()
    spliced = Splice([NORM], {MLP: lambda captured: sae(captured[NORM])})
    got = source.compare({"spliced": spliced, "zero": (MLP, torch.zeros_like)})
    assert got["spliced"]["ce"] == pytest.approx(m["val/ce_spliced"], rel=1e-6)
    assert got["zero"]["ce"] == pytest.approx(m["val/ce_zero_ablated"], rel=1e-9)


def test_a_module_not_in_the_model_is_refused_with_the_nearest_names_only() -> None:
    from experiments.sae.sources.hook_points import nearest_modules

    modules = ["", "embed", *[f"blocks.{i}.{part}" for i in range(12) for part in ("attn", "mlp", "mlp_norm")]]
    said = nearest_modules("blocks.9.mlpp", modules)
    assert said.startswith("the nearest of its 37 are blocks.9.mlp, ") and said.count(",") == 5
    assert nearest_modules("x", ["", "a", "b"]) == "it has a, b"
    assert nearest_modules("x", [""]) == "it has none but itself"
