"""Every option of every config group composes in the experiment that uses it (else digits) and builds.

Options are discovered from the YAML files of every conf folder on Hydra's search path (runner/conf and each task
package's conf/: helpers.CONF_DIRS), so a newly added file is tested without editing this module.
"""

from __future__ import annotations

import importlib.resources
import math
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import CONF_DIR, CONF_DIRS, compose_job, config_groups, config_options, hf_text, tiny_hf_model
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import ConfigError
from runner.build import build
from runner.ckpt.weights import save_weights
from runner.config import trust
from runner.data import batch_size_of, to_device
from runner.load import TRUSTED_TARGETS
from runner.log.jsonl import JsonlLogger
from runner.log.wandb_logger import WandbLogger
from runner.loop import fit
from runner.precision import FP32
from runner.progress import Duration, parse_duration
from runner.run import Callback, Logger, Run
from runner.schedulers import OnMetric, PerStep

EXPECTED_GROUPS = {
    "model",
    "data",
    "optimizer",
    "scheduler",
    "precision",
    "distributed",
    "logger",
    "callbacks",
    "checkpoint",
    "experiment",
    "compile",
    "activation_checkpointing",
    "debug",
    "finetune",
}
METRIC_CALLBACKS = {"perplexity", "sae_ground_truth", "sae_splice"}  # what a run folder's evaluation may rebuild
APPENDED = {"experiment", "debug"}  # groups added with +group=option, after every default (runner.__main__.debug_last)
GROUPS = config_groups()
OPTIONS = [(group, option) for group in GROUPS for option in config_options(group)]
EXPERIMENTS = [option for group, option in OPTIONS if group == "experiment"]
# each preset's defaults list, read once: _host was reading every preset's file for each option, ~1,400 loads a tier
DEFAULTS = {e: OmegaConf.load(config_options("experiment")[e]).get("defaults", []) for e in EXPERIMENTS}


def _host(group: str, option: str) -> str:
    """The experiment an option is tested in: the first that selects it, else the first that selects an option
    of the same family (the name before '_': sae_relu ~ sae_topk), else digits."""
    family = None
    for experiment in EXPERIMENTS:
        for entry in DEFAULTS[experiment]:
            chosen = entry.get(f"override /{group}") if isinstance(entry, DictConfig) else None
            for name in [chosen] if isinstance(chosen, str) else list(chosen or []):  # one option or a list
                if name == option:
                    return experiment
                if family is None and name.split("_")[0] == option.split("_")[0]:
                    family = experiment
    return family or "digits"


# options no experiment selects, with the experiment they are for
HOSTS = {("data", "tokens_file"): "lm", ("finetune", "lora"): "lm", ("model", "gpt2_small"): "lm"}
HOSTS[("data", "transcoder_synthetic")] = "sae"  # the synthetic preset, with a transcoder's rows
HOSTS[("distributed", "spread")] = "sae"  # with a family to spread (model=sae_multi, below)
HOSTS[("data", "activations_cached")] = "sae_digits"  # the hooked presets' activations, written to a folder once
HOSTS[("data", "activations_lm_cached")] = "sae_lm"


def _with_digits_params() -> list:
    return [pytest.param(group, option, id=f"{group}={option}") for group, option in OPTIONS]


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What some options need from outside: an activation file, and a finished digits run to hook into."""
    root = tmp_path_factory.mktemp("inputs")
    acts = root / "acts.npy"
    np.save(acts, np.random.default_rng(0).standard_normal((4096, 256)).astype(np.float32))
    source = root / "digits_run"
    cfg = compose_job(source, "+experiment=digits", "trainer.max_duration=20st", "logger=none", "callbacks=none")
    run = build(cfg)
    fit(run)
    (source / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, source / ".hydra" / "config.yaml")
    save_weights(run.task, source / "model.safetensors")
    tokens = root / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tokens)
    lm = root / "lm_run"  # a tiny GPT on one stdlib package, for sae_lm to hook into
    json_package = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
    tiny = ["model.n_layer=3", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.val_windows=16"]
    cfg = compose_job(lm, "+experiment=lm", f"data.paths=[{json_package}]", "data.val_every=2", *tiny)
    cfg.trainer.max_duration, cfg.logger, cfg.callbacks = "2st", {}, {}
    (lm / ".hydra").mkdir(parents=True, exist_ok=True)
    save_weights(build(cfg).task, lm / "model.safetensors")
    OmegaConf.save(cfg, lm / ".hydra" / "config.yaml")
    hf = tiny_hf_model(root / "hf", "gpt2")  # a transformers model folder, for sae_hf
    text = hf_text(root / "hf_text", copies=2)
    return {"acts": str(acts), "source": str(source), "tokens": str(tokens), "lm": str(lm), "hf": str(hf), "text": text}


def _host_overrides(group: str, option: str, inputs: dict[str, str]) -> list[str]:
    host = option if group == "experiment" else HOSTS.get((group, option)) or _host(group, option)
    overrides = [f"+experiment={host}"] + ([] if group == "experiment" else [_select(group, option)])
    if (group, option) == ("data", "activations_file") or host in ("sae_file", "transcoder_file"):
        overrides.append(f"data.train_path={inputs['acts']}")
    if host == "transcoder_file":  # the file's last 64 of 256 columns as the target
        overrides.append("data.d_out=64")
    if (group, option) == ("distributed", "spread"):
        overrides.append("model=sae_multi")
    if host == "synth_sae_bench" or (group == "data" and option.startswith("synth_sae_bench")):
        # the published world's orthogonalization: an hour on 2 cores; its validation samples a dense draw of every
        # feature each (16,384 of them, 8,192 of the CPU world's 4,096: 40 and 5 s on 2 cores)
        overrides += ["data.splits.ortho_steps=0", "data.splits.n_val=1024", "data.batch_size=256"]
        overrides.append("data.val_batch_size=256")
    if (group, option) == ("data", "tokens_file"):
        overrides += [f"data.train_path={inputs['tokens']}", "data.val_fraction=0.1"]
    if host == "sae_digits":
        overrides.append(f"source.checkpoint={inputs['source']}")
    if host in ("sae_lm", "transcoder_lm", "clt_lm", "sae_lm_kl", "transcoder_lm_kl"):
        overrides.append(f"source.checkpoint={inputs['lm']}")
        if not host.endswith("_kl") and (group, option) != ("data", "activations_lm_cached"):  # (no ring there)
            overrides.append("data.buffer_size=4096")
    if group == "data" and option.endswith("_cached"):  # a folder a session: written once, read by the other runs
        overrides += [f"data.cache={Path(inputs['acts']).parent / option}", "data.cache_rows=4096"]
    if host == "clt_lm":  # the tiny GPT's 3 blocks, and small coders
        overrides += ["source.module=[" + ",".join(f"blocks.{i}.mlp_norm" for i in range(3)) + "]"]
        overrides += ["source.target=[" + ",".join(f"blocks.{i}.mlp" for i in range(3)) + "]"]
        overrides += ["model.coder.n_latents=128", "model.coder.k=8"]
    if host == "sae_hf":
        text = f"source.inputs.paths=[{','.join(inputs['text'])}]"
        overrides += [f"source.checkpoint={inputs['hf']}", "source.module=transformer.h.1", text]
        overrides += ["source.inputs.val_every=2", "source.inputs.context=16"]
        overrides += ["data.batch_size=64", "data.buffer_size=512"]
    if (group, option) == ("finetune", "lora"):  # adapters on the tiny GPT of inputs["lm"]
        overrides += [f"init_from={inputs['lm']}", *(f"model.{k}" for k in ("n_layer=3", "d_model=32", "n_head=2"))]
    return overrides + _unit_overrides(group, option)


def _select(group: str, option: str) -> str:
    return f"{'+' if group in APPENDED else ''}{group}={option}"


def _unit_overrides(group: str, option: str) -> list[str]:
    # The presets' models have no Block: these options run on their Linear layers here (tests/unit/test_compile.py
    # trains a model with Blocks), and compiling traces without generating code (inductor takes seconds per graph).
    units = [f"{group}.units=[Linear]"] if option == "blocks" else []
    if option == "gpt2_small":  # its width and heads; one block of shorter windows: the tier stays fast
        units += ["model.n_layer=1", "model.seq_len=64"]
    return units + (["compile.backend=eager"] if group == "compile" and option != "none" else [])


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")


def _components(node: DictConfig | None) -> dict[str, DictConfig]:
    # entries without _target_ are an experiment's tuning of a component the command line deselected: not built
    return {name: c for name, c in (node or {}).items() if c is not None and "_target_" in c}


def check_run(cfg: DictConfig, run: Run, tmp_path: Path) -> None:
    """Assertions that hold for any config: every component is built, of the class its _target_ names."""
    assert isinstance(run, Run)

    # model
    assert isinstance(run.task, nn.Module)
    assert type(run.task) is get_object(cfg.model._target_)
    assert callable(getattr(run.task, "training_step", None))
    params = [p for p in run.task.parameters() if p.requires_grad]
    assert params and all(p.device.type == run.device.type for p in params)

    # optimizer: every trainable parameter in exactly one group; matrices decayed, 1-D tensors not
    assert isinstance(run.optimizer, torch.optim.Optimizer)
    assert type(run.optimizer) is get_object(cfg.optimizer._target_)
    grouped = [p for g in run.optimizer.param_groups for p in g["params"]]
    stepped = getattr(run.precision, "master", None) or params  # bf16_true steps fp32 copies of the parameters
    assert len(grouped) == len(params) and {id(p) for p in grouped} == {id(p) for p in stepped}
    for group in run.optimizer.param_groups:
        if all(p.ndim < 2 for p in group["params"]):
            assert group["weight_decay"] == 0.0
        else:
            assert all(p.ndim >= 2 for p in group["params"])
            assert group["weight_decay"] == pytest.approx(cfg.optimizer.get("weight_decay", 0.0))
        assert group["lr"] > 0

    # scheduler
    assert isinstance(run.schedule, PerStep)
    if isinstance(run.schedule, OnMetric):
        assert run.schedule.monitor == cfg.scheduler.monitor
        assert run.schedule.monitor.startswith("val/")
    else:
        assert run.schedule.monitor is None

    # precision: autocast() is a context manager under which the forward pass runs in the configured dtype
    assert isinstance(run.precision, FP32)
    assert type(run.precision) is get_object(cfg.precision._target_)
    batch = to_device(next(iter(run.train_loader)), run.device)
    dataset = run.train_loader.dataset
    assert batch_size_of(batch) == min(cfg.data.batch_size, len(dataset) if hasattr(dataset, "__len__") else math.inf)
    with torch.no_grad(), run.precision.autocast():
        out = run.task.training_step(batch)
        if hasattr(run.task, "net"):  # the digits MLP: its logits come out in the autocast dtype
            expected_dtype = getattr(torch, cfg.precision.dtype) if "dtype" in cfg.precision else torch.float32
            assert run.task(batch[0]).dtype == expected_dtype
    dtype = cfg.precision.get("dtype", "float32")
    assert run.precision.name == {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype] + (
        "_true" if cfg.precision._target_.endswith("MasterWeights") else ""
    )
    assert torch.isfinite(out["loss"])

    # distributed and data
    assert run.strategy.is_main and run.world_size == 1
    assert type(run.strategy) is get_object(cfg.distributed._target_)
    if hasattr(run.train_loader, "__len__"):  # a stream has no length (data=text_stream)
        n_train = len(run.train_loader.dataset)
        if not cfg.data.get("limit_train_batches") and not cfg.data.get("overfit_batches"):  # (debug=limit, overfit)
            assert len(run.train_loader) == math.ceil(n_train / cfg.data.batch_size)
    assert run.val_loader is not None and len(run.val_loader.dataset) > 0

    # progress and durations
    p = run.progress
    assert (p.step, p.micro_batch, p.epoch, p.samples) == (0, 0, 0, 0)
    assert p.max_duration == parse_duration(cfg.trainer.max_duration)
    assert p.batches_per_epoch == (len(run.train_loader) if hasattr(run.train_loader, "__len__") else None)
    assert p.accumulate == cfg.trainer.accumulate_grad_batches
    assert isinstance(run.settings.val_interval, Duration) and isinstance(run.settings.log_interval, Duration)

    # loggers and callbacks: one object per configured entry, in order, of the class its _target_ names
    assert isinstance(run.loggers, list) and isinstance(run.callbacks, list)
    loggers = _components(cfg.get("logger"))
    assert [type(lg) for lg in run.loggers] == [get_object(c._target_) for c in loggers.values()]
    assert all(isinstance(lg, Logger) for lg in run.loggers)
    for lg in run.loggers:
        if isinstance(lg, JsonlLogger):
            assert lg.path == tmp_path / "run" / "metrics.jsonl"
        if isinstance(lg, WandbLogger):
            assert lg.run is None  # never started here
            assert lg.mode == cfg.logger.wandb.mode and lg.kwargs["project"] == cfg.logger.wandb.project
            assert lg.kwargs["dir"] == str(tmp_path / "run")
    callbacks = list(_components(cfg.get("callbacks")).values())
    callbacks += [cfg.checkpoint] if "_target_" in (cfg.get("checkpoint") or {}) else []  # on unless checkpoint=none
    assert [type(cb) for cb in run.callbacks] == [get_object(c._target_) for c in callbacks]
    assert all(isinstance(cb, Callback) for cb in run.callbacks)
    for cb in run.callbacks:
        assert cb.monitor is None or cb.monitor.startswith("val/")

    # a run folder holding this config loads (runner/config/trust.py, as load_trained checks it): no false refusal
    for slot, trusted in (("model", TRUSTED_TARGETS), ("data", TRUSTED_TARGETS), ("precision", ["runner.precision"])):
        trust.check(OmegaConf.to_container(cfg[slot], resolve=True), slot, trusted, slot, "the shipped config")
    for name, node in _components(cfg.get("callbacks")).items():
        verdict = trust.problems(
            OmegaConf.to_container(node, resolve=True), "callback", [*TRUSTED_TARGETS, "runner.callbacks"], name
        )
        assert not verdict.forged and not verdict.untrusted, (name, verdict)
        # the metric callbacks are rebuilt by an evaluation of the folder; the others are left out, unbuilt
        assert (not verdict.unmarked) == (name in METRIC_CALLBACKS), (name, verdict)


def test_expected_groups_are_discovered() -> None:
    assert EXPECTED_GROUPS <= set(GROUPS)
    counts = {g: sum(1 for group, _ in OPTIONS if group == g) for g in GROUPS}
    assert all(n >= 1 for n in counts.values()), counts
    assert "digits" in EXPERIMENTS


def _conf_folders(cfg: DictConfig) -> list[Path]:
    """The folders of Hydra's search path in a config composed with its hydra node."""
    folders = []
    for source in cfg.hydra.runtime.config_sources:
        if source.schema == "file":
            folders.append(Path(source.path).resolve())
        elif source.schema == "pkg":
            folders.append(Path(str(importlib.resources.files(source.path))).resolve())
    return folders


def test_every_conf_folder_is_on_the_search_path_and_no_option_is_in_two() -> None:
    # the task packages' folders are found (runner/conf has no task's options), and Hydra sees each of them
    assert len(CONF_DIRS) >= 4 and {"mlp", "gpt", "sae_topk"} <= set(config_options("model"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra.run.dir=unused"], return_hydra_config=True)
    folders = _conf_folders(cfg)
    assert [conf for conf in CONF_DIRS if conf not in folders] == []
    assert folders.index(CONF_DIR) == min(folders.index(conf) for conf in CONF_DIRS)  # runner's own first
    # Hydra takes the first folder's file of a name: the same option in two folders would hide one of them
    owners: dict[str, list[Path]] = {}
    for conf in CONF_DIRS:
        for path in conf.rglob("*.yaml"):
            owners.setdefault(path.relative_to(conf).as_posix(), []).append(conf)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}


def test_another_hydra_app_gets_none_of_the_task_options(tmp_path: Path) -> None:
    # the search-path plugin adds the task folders to runner's config only, not to every Hydra app of the environment
    (tmp_path / "model").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - model: mine\n")
    (tmp_path / "model" / "mine.yaml").write_text("size: 1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
        with pytest.raises(MissingConfigException):
            compose(config_name="config", overrides=["model=sae_topk"])
    assert not set(_conf_folders(cfg)) & set(CONF_DIRS)


def test_base_config_defaults_list_neither_experiment_nor_debug() -> None:
    base = OmegaConf.load(CONF_DIR / "config.yaml")
    defaults = OmegaConf.to_container(base.defaults)
    names = [entry if isinstance(entry, str) else next(iter(entry)) for entry in defaults]
    assert names, "the base config has a defaults list"
    assert "_self_" in names
    for name in names:
        # plain, optional or override entries: "experiment", "optional experiment", "override /experiment", ...
        for group in APPENDED:
            assert group not in name.replace("/", " ").split(), f"defaults list selects {group}: {name!r}"


def test_base_config_composes_without_experiment(compose_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    cfg = compose_cfg()
    assert HydraConfig.get().runtime.choices.get("experiment") is None
    assert cfg.run_dir == str(tmp_path / "run")
    assert cfg.trainer.max_duration == "10ep"


@pytest.mark.parametrize(("group", "option"), _with_digits_params())
def test_option_builds_in_its_experiment(
    group: str, option: str, built: Callable[..., tuple[DictConfig, Run]], tmp_path: Path, inputs: dict[str, str]
) -> None:
    cfg, run = built(*_host_overrides(group, option, inputs))
    assert HydraConfig.get().runtime.choices[group] == option
    assert cfg.run_dir == str(tmp_path / "run")
    check_run(cfg, run, tmp_path)


@pytest.mark.parametrize(
    ("group", "option"),
    [
        pytest.param(g, o, id=f"{g}={o}")
        for g, o in OPTIONS
        if g != "experiment" and _host(g, o) == "digits" and (g, o) not in HOSTS
    ],
)
def test_option_builds_on_base_config(
    group: str, option: str, built: Callable[..., tuple[DictConfig, Run]], tmp_path: Path
) -> None:
    cfg, run = built(_select(group, option), *_unit_overrides(group, option))
    assert HydraConfig.get().runtime.choices[group] == option
    check_run(cfg, run, tmp_path)


def test_digits_experiment_applies_its_settings(built: Callable[..., tuple[DictConfig, Run]]) -> None:
    cfg, run = built("+experiment=digits")
    assert cfg.model.hidden == [512, 512] and cfg.model.dropout == 0.3
    assert isinstance(run.schedule, OnMetric) and run.schedule.monitor == "val/loss"
    stopper, saver = run.callbacks
    assert type(stopper).__name__ == "EarlyStopping" and stopper.patience == 8 and stopper.restore_best
    assert type(saver).__name__ == "Checkpoint" and saver.dir == Path(cfg.run_dir) / "checkpoints"
    linears = [m for m in run.task.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [512, 512, 10]
    # 1797 digits; the stratified split rounds each class's 20% share: 359 held out, 1438 train (45 micro-batches of
    # 32); the held-out images are halved, again per class, into val (179) and test (180)
    assert (len(run.train_loader.dataset), len(run.val_loader.dataset)) == (1438, 179)
    assert len(instantiate(cfg.data.splits)["test"]) == 180
    assert len(run.train_loader) == 45
    assert run.progress.total_steps() == 60 * 45


# the preset's model and data, with less validation and sampling: the tier stays fast
SMALLER = {
    "lm": ["data.val_windows=16", "callbacks.text_samples.new_tokens=4"],
}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_fits_tiny_budget(
    experiment: str, built: Callable[..., tuple[DictConfig, Run]], inputs: dict[str, str]
) -> None:
    overrides = [*_host_overrides("experiment", experiment, inputs), *SMALLER.get(experiment, [])]
    cfg, run = built(*overrides, "trainer.max_duration=5st")
    before = [p.detach().clone() for p in run.task.parameters()]
    fit(run)
    assert run.stop_reason == "max_duration"
    assert run.progress.step == 5
    assert run.progress.micro_batch == 5 * cfg.trainer.accumulate_grad_batches
    assert run.state.nonfinite_steps == 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, run.task.parameters(), strict=True))
    assert math.isfinite(run.state.metrics["val/loss"])


def test_deselecting_a_callback_the_experiment_tunes_says_so_and_keeps_checkpointing(
    built: Callable[..., tuple[DictConfig, Run]], capsys: pytest.CaptureFixture
) -> None:
    # digits sets callbacks.early_stopping.patience; callbacks=[ema] leaves those settings with nothing to apply to
    _, run = built("+experiment=digits", "callbacks=[ema]")
    assert [type(cb).__name__ for cb in run.callbacks] == ["EMA", "Checkpoint"]  # checkpointing is its own group
    err = capsys.readouterr().err
    assert err.count("note: callbacks.early_stopping is tuned by the config but not selected") == 1
    assert "callbacks=[...,early_stopping]" in err
    _, run = built("+experiment=sae", "checkpoint=none")
    assert [type(cb).__name__ for cb in run.callbacks] == ["GroundTruthRecovery"]
    assert "note: checkpoint is tuned by the config but not selected" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.gradient_clip_val=-1", "gradient_clip_val must be > 0 or null"),
        ("trainer.max_nonfinite_steps=0", "max_nonfinite_steps must be >= 1"),
        ("trainer.val_interval=2epochs", "cannot read duration"),
        ("data.batch_size=0", "batch_size must be a whole number >= 1"),
        ("trainer.accumulate_grad_batches=2.5", "accumulate_grad_batches must be a whole number"),
        ("trainer.log_interval=0st", "log_interval=0st must be longer than zero"),
        ("precision=bf16 precision.dtype=int8", "precision.dtype must be bfloat16 or float16"),
        pytest.param(
            "distributed.device=cuda",
            "sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there"),
        ),
    ],
)
def test_bad_trainer_values_are_refused_before_any_file_is_written(
    override: str, message: str, compose_cfg: Callable[..., DictConfig], tmp_path: Path
) -> None:
    cfg = compose_cfg("+experiment=digits", *override.split())
    with pytest.raises(ConfigError, match=message):
        build(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- presets do not leak one option's keys into another option of the same group -----------------------------------
def _preset_groups(experiment: str) -> list[str]:
    return [next(iter(e)).removeprefix("override /") for e in DEFAULTS[experiment] if isinstance(e, DictConfig)]


def _preset_body(experiment: str) -> set[str]:
    # the groups a preset writes keys of in its own body (a group's option files write only their own group: below)
    return set(OmegaConf.load(config_options("experiment")[experiment])) - {"defaults"}


# Only a preset's own body can put its keys into another option of a group (the options write only their own group,
# test_only_presets_debug_and_searches_write_outside_their_group): the cases are the groups a preset's body writes.
LEAK_CASES = [
    (experiment, group, option)
    for experiment in EXPERIMENTS
    for group in _preset_groups(experiment)
    if group in ("model", "data", "optimizer", "scheduler", "callbacks") and group in _preset_body(experiment)
    for g, option in OPTIONS
    if g == group
]


def test_only_presets_debug_and_searches_write_outside_their_group() -> None:
    # an option file with `# @package _global_` could write another group's keys; only these may
    writers = {
        p.relative_to(conf).parts[0] for conf in CONF_DIRS for p in conf.rglob("*.yaml") if "@package" in p.read_text()
    }
    assert writers <= {"experiment", "debug", "hparams_search"}, writers
    assert len(LEAK_CASES) >= 30  # the presets that tune a group in their body (digits' callbacks, sae's optimizer...)


@pytest.fixture(scope="module")
def keys_alone() -> dict[str, set[str]]:
    """The keys of each `group=option` composed without a preset, composed once per module (a composition takes
    ~90 ms; each option is checked under several presets)."""
    return {}


@pytest.mark.parametrize(("experiment", "group", "option"), LEAK_CASES)
def test_another_option_under_a_preset_gets_only_its_own_keys(
    experiment: str, group: str, option: str, compose_cfg: Callable[..., DictConfig], keys_alone: dict
) -> None:
    choice = f"{group}={option}"
    if choice not in keys_alone:
        keys_alone[choice] = set(compose_cfg(choice).get(group) or {})
    alone = keys_alone[choice]
    under_preset = set(compose_cfg(f"+experiment={experiment}", f"{group}={option}").get(group) or {})
    if group == "callbacks":  # a preset may tune a callback it selects; choosing others leaves that tuning unused
        under_preset = {name for name in under_preset if name in alone}
    assert under_preset == alone, f"+experiment={experiment} {group}={option} gets {sorted(under_preset - alone)}"


def test_your_own_model_under_a_preset_trains(compose_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    # a model of the user's own, outside runner's configs: a one-hidden-layer MLP without dropout
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(
        "_target_: _tasks.SkewedValidation\nin_features: 64\nhidden: [16]\nnum_classes: 10\n"
    )
    cfg = compose_cfg(
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=digits", "model=mine", "trainer.max_duration=3st"
    )
    assert set(cfg.model) == {"_target_", "in_features", "hidden", "num_classes"}
    run = fit(build(cfg))
    assert run.progress.step == 3


def test_the_readme_s_config_groups_table_names_every_option() -> None:
    # the table a user reads to learn what each group offers: an option added without a word there is missed
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.*)$", (CONF_DIR.parents[1] / "README.md").read_text(), re.MULTILINE))
    for group in config_groups():
        options = list(config_options(group))
        assert group in rows, f"README has no row for the config group {group} ({options})"
        missing = [o for o in options if f"`{o}`" not in rows[group]]
        assert not missing, f"README's {group} row does not name {missing}"


def _required(node: object, prefix: str = "") -> list[str]:
    # the dotted keys a YAML file marks required (???), read as plain YAML: what its author meant, before any merge
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _required(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "???" else []


REQUIRED = [
    (group, name, key)
    for conf in CONF_DIRS
    for path in sorted(conf.glob("*/*.yaml"))
    for group, name in [(path.parent.name, path.stem)]
    for key in _required(yaml.safe_load(path.read_text()) or {})
]


@pytest.mark.parametrize(("group", "name", "key"), REQUIRED, ids=[f"{g}/{n}:{k}" for g, n, k in REQUIRED])
def test_what_an_option_marks_required_stays_required_once_composed(
    group: str, name: str, key: str, compose_cfg: Callable[..., DictConfig]
) -> None:
    # OmegaConf keeps a value a ??? is merged over: a preset's required key over a parent's value would run with that
    # value, silently, where the preset meant "the user must say"
    chosen = [f"+experiment={name}"] if group == "experiment" else ["+experiment=sae", f"{group}={name}"]
    cfg = compose_cfg(*chosen)
    parent, _, leaf = (key if group == "experiment" else f"{group}.{key}").rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    assert OmegaConf.is_missing(node, leaf), f"{group}/{name}.yaml marks {key} ???, but it composes as a value"
