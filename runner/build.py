"""The only place that turns config into objects (hydra.utils.instantiate lives here and nowhere else)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import ConfigError
from runner.callbacks.time_limit import TimeLimit
from runner.ckpt.sliced import built
from runner.ckpt.weights import load_weights
from runner.config.checks import check_config
from runner.config.monitors import check_monitored_metrics, check_monitors, validation_metrics
from runner.durations import Duration
from runner.meter import Meter, peak_flops
from runner.optimizers import FUSED_DEVICES
from runner.param_groups import param_groups
from runner.progress import TrainingProgress
from runner.run import Best, Run, Settings, State
from runner.timeline import phase
from runner.validation import share


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _not_selected(name: str, how: str, quiet: bool) -> None:
    # An experiment tuned a component (say callbacks.early_stopping.patience) whose option the command line then left
    # out (callbacks=[ema]): the tuning has nothing to apply to. Said once, by rank 0, as one line.
    if not quiet:
        print(f"note: {name} is tuned by the config but not selected, so it is off; select it: {how}", file=sys.stderr)


def _named(group: DictConfig | None, what: str, quiet: bool = False) -> list[Any]:
    """Instantiate a group whose options merge into one mapping of name -> component config (callbacks, logger)."""
    components = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            _not_selected(f"{what}.{name}", f"{what}=[...,{name}]", quiet)
            continue
        components.append(instantiate(node))
    return components


def _plain(cfg: DictConfig) -> dict[str, Any]:
    # Resolved where it can be (a resume compares values, not the interpolations that produced them).
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that only resolves inside Hydra, in a run built from Python
        return OmegaConf.to_container(cfg, resolve=False)


def _checkpoint(node: DictConfig | None, quiet: bool) -> list[Any]:
    """The checkpoint callback (after the others: it saves what they leave at the end of a step), unless off."""
    if not node:
        return []
    if "_target_" not in node:
        _not_selected("checkpoint", "checkpoint=default", quiet)
        return []
    return [instantiate(node)]


def _on(cfg: DictConfig, group: str) -> bool:
    # an option of the group selected (none: no node at all)
    return "_target_" in (cfg.get(group) or {})


def _interval(progress: TrainingProgress, text: str, name: str) -> Duration:
    interval = progress.resolve(text, name)
    if interval.value <= 0:
        raise ConfigError(f"{name}={text} must be longer than zero")
    return interval


def _fusable(make: Any, groups: list[dict[str, Any]], device: torch.device) -> bool:
    # FSDP's shards (DTensors) have sharding rules for fused Adam and AdamW only: a fused SGD of them fails at its
    # first step ("aten._fused_sgd_.default does not have a sharding strategy registered"), on the CPU as on CUDA.
    if device.type not in FUSED_DEVICES:
        return False
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for group in groups for p in group["params"])
    optimizer = getattr(make, "func", None)
    return not sharded or (isinstance(optimizer, type) and issubclass(optimizer, (torch.optim.Adam, torch.optim.AdamW)))


def _optimizer(cfg: DictConfig, groups: list[dict[str, Any]], device: torch.device) -> torch.optim.Optimizer:
    # `fused: null` is fused on CUDA and on the CPU: fused Adam, AdamW and SGD skip a non-finite step on the device
    # (no host read, runner/precision.py), and on the CPU one kernel for every tensor is 3x torch's default for-loop
    # on a tiny MLP and 10x on an SAE's matrices (benchmarks/README.md). The numbers differ from that loop's in the
    # last bits.
    make = instantiate({key: value for key, value in cfg.items() if key != "lr_scale"})
    fused = {"fused": True} if cfg.get("fused", False) is None and _fusable(make, groups, device) else {}
    optimizer = make(groups, **fused)
    # Scaled after construction, so that an optimizer of any signature fills in its own lr first; schedulers then
    # take each group's scaled lr as its base.
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)
    return optimizer


def decided_by_data(model: DictConfig, data: Any, strategy: Any = None) -> dict[str, Any]:
    """The model keys the data decides (data.model_args: an SAE's d_in is its activations' width) and the strategy
    (its model_args: whether a family's SAEs are spread over ranks), where the config leaves them null; a value the
    user set must agree, or the model would not fit its data or its ranks."""
    given = {}
    for who, source in (("the data", data), ("distributed", strategy)):
        for key, value in getattr(source, "model_args", {}).items():
            if key not in model:
                continue
            if model[key] is None:
                given[key] = value
            elif model[key] != value:
                hint = " (distributed=spread spreads a family's SAEs over the ranks)" if who == "distributed" else ""
                raise ConfigError(
                    f"model.{key}={model[key]}, but {who} gives {value} ({type(source).__name__}); leave model.{key} "
                    f"out: it follows {who}{hint}"
                )
    return given


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A ConfigError that a constructor raised under hydra's instantiate, re-raised bare."""
    try:
        yield
    except InstantiationException as error:
        # Hydra wraps what a constructor raises, once per level of nesting; a ConfigError is a message for the user,
        # not a bug to trace.
        cause = error.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


def build(cfg: DictConfig) -> Run:
    """Instantiate every component of the run described by `cfg`; a ConfigError from a component is re-raised bare."""
    with user_errors():
        return _build(cfg)


def _build(cfg: DictConfig) -> Run:
    # The order is the seeded run's: what draws random numbers (the data, the model's init) draws them in this order.
    check_config(cfg)
    with phase("distributed"):
        dist = instantiate(cfg.distributed)
    seed_everything(cfg.seed)
    with phase("data"):
        data = instantiate(cfg.data)
        train_loader, val_loader, epoch = _loaders(cfg, data, dist)
    if (trainer := cfg.trainer).max_nonfinite_steps < 1:
        raise ConfigError(f"trainer.max_nonfinite_steps must be >= 1, got {trainer.max_nonfinite_steps}")
    with phase("model"):
        task = _task(cfg, data, dist)
    val_loader = val_loader if hasattr(task, "validation_step") else None  # a task without one is never validated
    precision = instantiate(cfg.precision, device=dist.device)
    precision.cast(task)  # before anything runs or wraps the model: bf16_true stores its parameters in bf16
    empty = any(p.is_meta for p in task.parameters())  # built empty, FSDP's wrap reads them: checked after it
    with phase("validation check"):  # one validation batch: which metrics validation gives, for the monitors
        metric_names = set() if empty else validation_metrics(task, val_loader, precision, dist.device)
    # Activation checkpointing before DDP/FSDP wrap the units, compile after (runner/compile.py says why); both in
    # place, so the state-dict keys stay the eager model's.
    recomputed = instantiate(cfg.activation_checkpointing).apply(task) if _on(cfg, "activation_checkpointing") else None
    flops_per_token = task.flops_per_token() if hasattr(task, "flops_per_token") else None  # before FSDP shards it
    peak = trainer.get("peak_flops") or peak_flops(dist.device, precision.name)  # one device's, for train/mfu
    # After init_from: DDP and FSDP start every rank from rank 0's weights. Before the optimizer: FSDP replaces the
    # parameters with shards, which the optimizer must hold.
    forward = dist.wrap(task)
    if empty:  # without gradients: an FSDP forward that no backward follows would leave them unreduced
        metric_names = torch.no_grad()(validation_metrics)(task, val_loader, precision, dist.device)
    compiled = instantiate(cfg.compile).apply(task) if _on(cfg, "compile") else None
    with phase("optimizer"):
        optimizer = _optimizer(
            cfg.optimizer, precision.optimizer_groups(param_groups(task, cfg.optimizer.get("lr_scale"))), dist.device
        )
    progress = _progress(trainer, data, train_loader, epoch, dist.world_size)
    settings = _settings(cfg, progress, data, compiled, recomputed)
    with phase("callbacks"):
        callbacks = _callbacks(cfg, quiet=not dist.is_main)
    run = Run(
        task=task,
        optimizer=optimizer,
        schedule=instantiate(cfg.scheduler)(optimizer=optimizer, progress=progress),
        precision=precision,
        strategy=dist,
        train_loader=train_loader,
        val_loader=val_loader,
        settings=settings,
        state=State(progress=progress, best=Best(cfg.get("mode", "min")), meter=Meter(progress, flops_per_token, peak)),
        forward=forward,
        data=data,
        callbacks=callbacks,
    )
    check_monitors(run, getattr(data, "no_val_split", None))  # a data module of your own need not say
    check_monitored_metrics(run, metric_names)
    # Loggers last: they create files in the run folder, and a run that cannot start should leave none behind.
    run.loggers = _named(cfg.get("logger"), "logger") if dist.is_main else []
    return run


def _loaders(cfg: DictConfig, data: Any, dist: Any) -> tuple[Any, Any, int | None]:
    """This rank's train and validation loaders, and the micro-batches of a train epoch (None: a stream has none)."""
    train_loader = data.train_loader(dist.rank, dist.world_size, dist.device, cfg.trainer.accumulate_grad_batches)
    val_loader = data.val_loader(dist.rank, dist.world_size, dist.device)
    epoch = len(train_loader) if hasattr(train_loader, "__len__") else None
    if epoch == 0:
        raise ConfigError(
            f"the train loader is empty: {len(train_loader.dataset)} samples make no optimizer step of "
            f"data.batch_size={data.batch_size} x {dist.world_size} rank(s) x trainer.accumulate_grad_batches="
            f"{cfg.trainer.accumulate_grad_batches} with data.drop_last={data.drop_last}"
        )
    return train_loader, val_loader, epoch


def _task(cfg: DictConfig, data: Any, dist: Any) -> nn.Module:
    """The model on this rank's device: shaped by its data, started from init_from's weights, adapted to fine-tune."""
    make = functools.partial(instantiate, cfg.model, **decided_by_data(cfg.model, data, dist))
    path, strict, finetune = cfg.get("init_from"), cfg.get("init_strict", True), _on(cfg, "finetune")
    # an init that the file overwrites draws nothing from the run's random streams; FSDP's gets no storage (sliced)
    empty = not finetune and getattr(dist, "empty_init", lambda strict: False)(strict)
    task = built(make, dist.device, empty) if path and strict else make().to(dist.device)
    if path:  # FSDP reads each rank's slices once it has sharded; an adapter wraps weights read now
        load = load_weights if finetune else getattr(dist, "init_from", load_weights)  # one's own: whole
        load(task, path, strict=strict, say=dist.is_main)
    return instantiate(cfg.finetune).apply(task) if finetune else task  # adapts init_from's weights


def _progress(trainer: DictConfig, data: Any, train_loader: Any, epoch: int | None, world: int) -> TrainingProgress:
    """The run's clock, from the data's batches and the trainer's max_duration and accumulation."""
    return TrainingProgress(
        trainer.max_duration,
        batch_size=data.batch_size,
        batches_per_epoch=epoch,
        samples_per_epoch=getattr(getattr(train_loader, "batch_sampler", None), "samples_per_epoch", None),
        accumulate=trainer.accumulate_grad_batches,
        world_size=world,
        tokens_per_sample=data.tokens_per_sample,
    )


def _settings(
    cfg: DictConfig, progress: TrainingProgress, data: Any, compiled: str | None, recomputed: str | None
) -> Settings:
    """What the config fixes for the loop, once every duration in it reads in this run's units."""
    config = _plain(cfg)
    progress.check_durations(config)
    trainer = cfg.trainer
    tolerance = trainer.get("short_run_tolerance")
    if tolerance is not None and tolerance < 0:
        raise ConfigError(f"trainer.short_run_tolerance must be >= 0 (null: never said), got {tolerance}")
    return Settings(
        val_interval=_interval(progress, trainer.val_interval, "trainer.val_interval"),
        log_interval=_interval(progress, trainer.log_interval, "trainer.log_interval"),
        gradient_clip_val=trainer.gradient_clip_val,
        max_nonfinite_steps=trainer.max_nonfinite_steps,
        stop_check_interval=_interval(progress, trainer.stop_check_interval, "trainer.stop_check_interval"),
        monitor=cfg.get("monitor"),
        config_hash=hashlib.sha256(OmegaConf.to_yaml(cfg).encode()).hexdigest(),
        config=config,
        data_info=getattr(data, "info", {}),  # a data module of your own need not have one
        compiled=compiled,
        recomputed=recomputed,
        short_run_tolerance=tolerance,
        val_during_training=share(trainer.get("val_during_training"), "trainer.val_during_training"),
    )


def _callbacks(cfg: DictConfig, quiet: bool) -> list[Any]:
    """The callbacks in the config's order, then the checkpoint (it saves what they leave), then max_time's limit."""
    return (
        _named(cfg.get("callbacks"), "callbacks", quiet=quiet)
        + _checkpoint(cfg.get("checkpoint"), quiet=quiet)
        + ([TimeLimit(cfg.trainer.max_time)] if cfg.trainer.get("max_time") else [])
    )


def build_data(cfg: DictConfig) -> Any:
    """The data component of a config that runner.load.load_trained returned (its targets already checked)."""
    with user_errors():
        return instantiate(cfg.data)
