"""The data options that read a source model (experiments.sae.sources.hooked: LiveActivations, CachedActivations,
SourceWindows), and the run folders written when they were one class, HookedData, whose flags chose the pipeline: an
older folder's config is read as the option its flags meant (experiments.sae.compat.hooked_data, through the
`runner.upgraded` entry point group), with the same rows; the folder loads and evaluates as the same model (with
SpliceEval under its older names), and its checkpoints resume with no config change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SAE_LM, finished_run
from hydra.utils import instantiate
from omegaconf import OmegaConf

from experiments.sae.compat import hooked_data
from experiments.sae.sources.hooked import CachedActivations, LiveActivations, SourceWindows
from runner import ConfigError
from runner.build import build_data
from runner.ckpt.state import config_changes
from runner.load import load_trained
from runner.tools.evaluate import evaluate_run

SOURCE = {"module": "blocks.1", "skip_positions": 1, "batch_size": 64, "seed": 0}
# what an older activations_hooked wrote of the pipelines' flags (activations_spliced set tokens: true)
FLAGS = {"cache": None, "cache_rows": None, "cache_dtype": "float32", "cache_shard_rows": 65536, "tokens": False}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _same(old: Any, new: Any) -> None:
    assert type(old) is type(new)
    assert torch.equal(old.splits["val"].tensors[0], new.splits["val"].tensors[0])
    assert {k: v for k, v in old.model_args.items() if k != "source"} == {
        k: v for k, v in new.model_args.items() if k != "source"
    }
    assert (old.batch_size, old.shuffle, old.num_workers, old.tokens_per_sample) == (
        new.batch_size,
        new.shuffle,
        new.num_workers,
        new.tokens_per_sample,
    )
    batches = [iter(data.train_loader()) for data in (old, new)]
    for _ in range(3):
        assert _equal(*(next(b) for b in batches))


def _old(**options: Any) -> Any:
    """What an older run folder's HookedData node builds, read as it is now."""
    node = {"_target_": "experiments.sae.sources.hooked.HookedData", **options}
    return instantiate(hooked_data(node))


def test_an_older_folder_s_flags_build_the_option_they_meant(lm_run: Path, tmp_path: Path) -> None:
    ring = {"buffer_size": 512, "samples_per_epoch": 1024}
    old = _old(checkpoint=str(lm_run), **SOURCE, **ring, **FLAGS, shard=None)
    _same(old, LiveActivations(str(lm_run), **SOURCE, **ring))
    # a cache folder: its rows, by default samples_per_epoch of them (each written afresh here, the same rows)
    flags = {**FLAGS, "cache": str(tmp_path / "old"), "cache_shard_rows": 256}
    old = _old(checkpoint=str(lm_run), **SOURCE, **{**ring, "samples_per_epoch": 512}, **flags)
    new = CachedActivations(str(lm_run), cache=str(tmp_path / "new"), cache_rows=512, cache_shard_rows=256, **SOURCE)
    _same(old, new)
    assert len(old.splits["train"]) == 512 and old.info["cached_rows"] == 512
    # tokens: the source's own windows, and the source handed to the model
    windows = {**SOURCE, "batch_size": 2, "shuffle": True}
    old = _old(checkpoint=str(lm_run), **ring, **windows, **{**FLAGS, "tokens": True})
    new = SourceWindows(str(lm_run), **windows)
    _same(old, new)
    assert isinstance(old.model_args["source"], type(new.model_args["source"]))


@pytest.mark.parametrize("module", ["experiments.sae.hooked", "experiments.sae.sources.hooked"])
@pytest.mark.parametrize(
    ("flags", "built"),
    [({}, LiveActivations), ({"cache": "acts"}, CachedActivations), ({"tokens": True}, SourceWindows)],
)
def test_an_older_run_folder_loads_and_evaluates_as_the_same_model(
    module: str, flags: dict, built: type, sae_lm_run: Path, tmp_path: Path
) -> None:
    # A rebuilt folder writes no cache (runner.config.confine): an older cached run's data is the live one's.
    now = evaluate_run(sae_lm_run)["metrics"]
    old = tmp_path / "old"
    shutil.copytree(sae_lm_run, old)
    cfg = OmegaConf.load(old / ".hydra" / "config.yaml")
    assert cfg.data._target_ == "experiments.sae.sources.hooked.LiveActivations"
    cfg.data._target_, cfg.callbacks.sae_splice._target_ = f"{module}.HookedData", f"{module}.SpliceEval"
    cfg.data.update({**FLAGS, **flags, "cache": str(tmp_path / flags["cache"]) if "cache" in flags else None})
    OmegaConf.save(cfg, old / ".hydra" / "config.yaml")
    model, rebuilt = load_trained(old, callbacks=True)
    assert rebuilt.data._target_ == f"experiments.sae.sources.hooked.{built.__name__}"
    assert rebuilt.data.get("cache") is None and "tokens" not in rebuilt.data
    assert rebuilt.callbacks.sae_splice._target_ == "experiments.sae.evals.splice.SpliceEval"
    assert type(build_data(rebuilt)) is built
    assert json.dumps(evaluate_run(old)["metrics"], sort_keys=True) == json.dumps(now, sort_keys=True)
    assert not (tmp_path / "acts").exists()
    # a checkpoint of the older folder resumes under today's config of the same run with no change to allow
    saved = OmegaConf.to_container(cfg, resolve=False)
    now_cfg = OmegaConf.to_container(OmegaConf.load(sae_lm_run / ".hydra" / "config.yaml"), resolve=False)
    if flags == {}:
        assert config_changes(saved, now_cfg) == {}
    else:  # another pipeline than the run's: a real change, said
        assert set(config_changes(saved, now_cfg)) >= {"data._target_"}


def test_a_cached_run_folder_evaluates_without_its_cache(lm_run: Path, tmp_path: Path) -> None:
    acts, run = tmp_path / "acts", tmp_path / "run"
    run.mkdir()
    cached = ["data=activations_lm_cached", f"data.cache={acts}", "data.cache_rows=1024", "data.cache_shard_rows=512"]
    live = ("data.buffer_size", "data.samples_per_epoch")
    finished_run(
        run,
        "+experiment=sae_lm",
        f"source.checkpoint={lm_run}",
        *(o for o in SAE_LM if not o.startswith(live)),
        *cached,
    )
    assert (acts / "manifest.json").exists()
    shutil.rmtree(acts)
    metrics = evaluate_run(run)["metrics"]
    assert 0 < metrics["val/fve"] <= 1 and "val/ce_spliced" in metrics and not acts.exists()
    with pytest.raises(ConfigError, match=r"data.cache=null: .*give one, data.cache=DIR"):
        evaluate_run(run, split="train")
    assert not acts.exists()


@pytest.mark.parametrize("experiment", ["sae_lm", "sae_digits"])
def test_the_older_source_cache_option_is_refused_with_its_new_spelling(experiment: str, run_cli, tmp_path) -> None:
    # it chose the cached pipeline; now a data option does, and a key that picks nothing would train live unasked
    code, err = run_cli(f"+experiment={experiment}", f"source.checkpoint={tmp_path}", "source.cache=acts/")
    assert code == 2 and "source.cache= is no longer an option" in err, err
    assert "data=activations_lm_cached data.cache=DIR" in err and "data=activations_cached data.cache=DIR" in err
    assert not (tmp_path / "acts").exists()


def test_the_splice_reads_as_many_validation_batches_as_validation_does(lm_run: Path, compose_cfg) -> None:
    # debug=fast's data.limit_val_batches reaches the splice and its ablations (callbacks/sae_splice.yaml)
    from types import SimpleNamespace

    from experiments.sae.evals.splice import SpliceEval

    cfg = compose_cfg("+experiment=sae_lm", f"source.checkpoint={lm_run}", "+debug=fast")
    assert cfg.callbacks.sae_splice.limit_batches == cfg.data.limit_val_batches == 2
    from experiments.sae.coders.activations import TopKSAE

    totals: list[int] = []
    working = lambda what, done, total: totals.append(total)  # noqa: E731
    run = SimpleNamespace(device=torch.device("cpu"), working=working, task=TopKSAE(d_in=32, n_latents=64, k=4))
    splice = SpliceEval(str(lm_run), "blocks.1", skip_positions=1, limit_batches=1)
    metrics: dict[str, float] = {}
    splice.on_validation_end(run, metrics)
    assert splice.source.data.limit_val_batches == 1 and set(totals) == {1} and "val/kl_spliced" in metrics
