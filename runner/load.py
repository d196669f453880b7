"""One way to load a finished model: a run folder rebuilt from its own .hydra/config.yaml (only where every `_target_`
there is trusted), or a foreign folder (an SAE of SAELens or sparsify) that a task package reads and attaches to the
model it reads (`Attach`). Every tool's CLI parses into an Attach, and the Python API takes one."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from runner import ConfigError
from runner.build import build_data, decided_by_data, user_errors
from runner.ckpt.sliced import built, load_sliced
from runner.ckpt.weights import load_weights
from runner.config import trust
from runner.config.checks import check_keys, check_types
from runner.config.confine import confined
from runner.rundir import CONFIG, MODEL, read_run_config

# What another run's .hydra/config.yaml may name as `_target_`s when runner rebuilds its model and data
# (source.checkpoint): module paths of the project's own tasks. Overridden by the config key `trusted_targets`.
TRUSTED_TARGETS = ("experiments", "runner.data")
# A project's own settings for runner's tools, in the folder they are launched from (`runner init` writes it)
PROJECT = "runner.yaml"
# How load_trained shards the models it builds, inside sharded_loads (a sharded source: its callers do not pass it)
_SHARD: contextvars.ContextVar[Callable[[nn.Module], Any] | None] = contextvars.ContextVar("shard", default=None)


CPU = torch.device("cpu")  # where load_trained builds a model (a sharded one: its buffers; shard moves them)


@contextlib.contextmanager
def sharded_loads(shard: Callable[[nn.Module], Any]) -> Iterator[None]:
    """Inside it, load_trained builds each model with its parameters on the meta device, shards it with `shard`
    (FSDP2's fully_shard, then runner.ckpt.sliced.materialize: collective) and each rank reads only the slices of the
    weights its shards hold (runner.ckpt.sliced)."""
    token = _SHARD.set(shard)
    try:
        yield
    finally:
        _SHARD.reset(token)


@dataclasses.dataclass(frozen=True)
class Attach:
    """What attaches a foreign folder (an SAE of SAELens or sparsify) to the model it reads, as if runner had trained
    it there: the model (`source`: a run folder or hf:NAME), which of a family (`hook`), the module it reads and, for
    a transcoder, writes (`module`, `target`), the positions left alone (`skip_positions`), a transformers source's
    text (`inputs`). A runner run's own config names all of these: it takes none."""

    source: str | None = None
    hook: str | None = None
    module: str | None = None
    target: str | None = None
    skip_positions: int | None = None
    inputs: dict | None = None

    TEXT = ("source", "hook", "module", "target")  # a tool's key=value read as given; the others as Hydra reads values

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The option names, as every tool's command line spells them."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: dict[str, Any] | Attach | None) -> Attach:
        """An Attach from a tool's parsed options (other keys ignored), or as given."""
        if isinstance(options, Attach):
            return options
        return cls(**{key: (options or {}).get(key) for key in cls.keys()})

    def given(self) -> dict[str, Any]:
        """The options set (not None), by name."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


# A task package reads its foreign folders through the `runner.folders` entry point group (pyproject.toml): each
# names a reader with `recognizes(path) -> bool` and `load(path, trusted, attach) -> (model, cfg)`, and the
# `solo(path, hook)` of the coder alone; runner never imports the task to ask.
_readers: list[Any] = []


def readers() -> list[Any]:
    """The foreign-folder readers the installed task packages register."""
    if not _readers:
        from importlib.metadata import entry_points

        _readers.extend(point.load() for point in entry_points(group="runner.folders"))
    return _readers


def foreign_reader(path: str | Path) -> Any | None:
    """The reader of `path` if it is a foreign folder (no runner run: no .hydra/config.yaml), else None."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG).is_file():
        return None
    return next((reader for reader in readers() if reader.recognizes(path)), None)


def is_foreign(path: str | Path) -> bool:
    """Whether `path` is a foreign folder a task package reads (an SAE of SAELens or sparsify), not a runner run."""
    return foreign_reader(path) is not None


def load_model(
    path: str | Path,
    trusted: Sequence[str] = TRUSTED_TARGETS,
    attach: Attach | dict[str, Any] | None = None,
    weights: str | Path | None = None,
    callbacks: bool = False,
) -> tuple[nn.Module, DictConfig]:
    """What runner's tools read: a finished run's model and config (load_trained), or a foreign folder attached to the
    model it reads, as if runner had trained it there."""
    attach = Attach.of(attach)
    reader = foreign_reader(path)
    if reader is not None:
        if weights is not None:
            raise ConfigError(f"weights={weights}: an SAE folder of SAELens or sparsify holds its own weights")
        return reader.load(path, tuple(trusted), attach)
    if given := attach.given():
        raise ConfigError(
            f"{', '.join(f'{k}=' for k in given)}: for an SAE folder of SAELens or sparsify; {path} is a runner "
            "run, whose config names what it read"
        )
    return load_trained(path, trusted, weights=weights, callbacks=callbacks)


class _Unresolvable(ConfigError):
    """An interpolation that only Hydra resolves (${hydra:...}) or that points nowhere."""


def _resolved(cfg: DictConfig, key: str, config: Path) -> Any:
    # `cfg[key]` resolved (None where absent); load_trained has refused resolvers that do more than read
    node = OmegaConf.select(cfg, key)
    if not isinstance(node, DictConfig | ListConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)  # an interpolated `_target_: ${x}` is checked resolved
    except Exception as error:
        raise _Unresolvable(f"cannot read `{key}` of {config}: {str(error).splitlines()[0]}") from None


def _trusted_node(cfg: DictConfig, key: str, config: Path, trusted: Sequence[str], slot: str) -> Any:
    """`cfg[key]` resolved, after checking that it may be built as `slot` (runner.config.trust): a run folder from
    elsewhere may be anybody's, and instantiating its config would run whatever it names."""
    node = _resolved(cfg, key, config)
    return confined(trust.check(node, slot, trusted, key, str(config)), trusted)


def load_trained(
    checkpoint: str | Path,
    trusted: Sequence[str] = TRUSTED_TARGETS,
    weights: str | Path | None = None,
    callbacks: bool = False,
) -> tuple[nn.Module, DictConfig]:
    """A model trained by runner, frozen in eval mode: `checkpoint` is a run folder or its model.safetensors;
    `weights`, other weights for that run's model (one of its checkpoint folders, a .safetensors file).

    The model is built from that run's own config only if every `_target_` in it is a class or function defined under
    the `trusted` module paths (runner.config.trust); its `data` and `precision` (runner's own) are checked the same
    way, before anything is instantiated. `callbacks=True` adds the run's callbacks that are runner's own or trusted
    (others are left out, and said).
    """
    path = Path(checkpoint)
    run_dir = path if path.is_dir() else path.parent
    what = "source.checkpoint" if weights is None else "weights"
    weights = Path(weights) if weights is not None else run_dir / MODEL if path.is_dir() else path
    config = run_dir / CONFIG
    for needed in (weights, config):  # files (a weights folder: a checkpoint's), never a FIFO or /dev/zero
        if not (needed.is_file() or (needed is weights and needed.is_dir())):
            raise ConfigError(
                f"{needed} does not exist (or is no file): give the folder of a finished runner run (or its "
                "model.safetensors), e.g. source.checkpoint=outputs/2026-01-01/12-00-00"
            )
    cfg = read_run_config(run_dir)
    for key in ("model", "data"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"{config} has no `{key}` mapping: is {run_dir} the folder of a runner run?")
    # A resolver runs while the config is read, before any _target_ can be checked: every one in the whole file (an
    # interpolation anywhere may be pulled into the parts that are built) is checked first.
    trust.check_resolvers(
        OmegaConf.to_container(cfg, resolve=False),
        f"{config} (refused)",
        f"a run folder's config may only use {sorted(trust.SAFE_RESOLVERS)}",
    )
    # Every part that will be built is checked here, before anything is instantiated.
    source = OmegaConf.create({k: _trusted_node(cfg, k, config, trusted, k) for k in ("model", "data")})
    if cfg.get("precision") is not None:
        source.precision = _trusted_node(cfg, "precision", config, ["runner.precision"], "precision")
    if callbacks:
        source.callbacks = _callbacks(cfg, trusted, config)
    try:  # a key its class does not take, or a value of the wrong type, would be a TypeError deep in instantiate
        check_keys(source)
        check_types(source)
    except ConfigError as error:
        raise ConfigError(f"{config} cannot be rebuilt: {error}") from None
    shard = _SHARD.get()
    with torch.random.fork_rng(devices=[]):  # its data and init, overwritten, draw nothing from the caller's streams
        # A key the data decided (an SAE's d_in) is null in the saved config: the data decides it again
        decided = decided_by_data(source.model, build_data(source)) if _has_null(source.model) else {}
        with user_errors():  # sharded: its parameters on the meta device, until `shard` gives each rank its shards
            model = built(functools.partial(instantiate, source.model, **decided), CPU, empty=shard is not None)
        if shard is not None:
            shard(model)
        try:
            (load_weights if shard is None else load_sliced)(model, weights, strict=True, what=what)
        except ConfigError as error:  # a truncated file or weights of another architecture
            raise ConfigError(f"cannot load {weights} into the model of {config}: {error}") from None
    return model.eval().requires_grad_(False), source


def trusted_here(folder: str | Path | None = None) -> tuple[str, ...]:
    """What runner's tools (evaluate, features, generate) trust a run folder's config to build when given no
    trusted_targets=: TRUSTED_TARGETS and the packages that the project in the folder they are launched from names in
    its runner.yaml. Never a run folder's own word: anyone can write one; the launch folder is the user's."""
    path = Path(folder or Path.cwd()) / PROJECT
    if not path.is_file():
        return TRUSTED_TARGETS
    try:
        targets = OmegaConf.to_container(OmegaConf.load(path)).get("trusted_targets", [])
    except Exception as error:  # YAML that does not parse, or not a mapping
        raise ConfigError(f"{path}: not a mapping of runner settings ({str(error).splitlines()[0]})") from None
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{path}: trusted_targets must be a list of package names, e.g. [experiments, mypackage]")
    return tuple(dict.fromkeys([*TRUSTED_TARGETS, *targets]))


def _callbacks(cfg: DictConfig, trusted: Sequence[str], config: Path) -> dict[str, Any]:
    # The run's callbacks that runner.tools.evaluate may build: the metric callbacks (opted in as `callback`) of
    # runner's own and under `trusted`. The others of those packages (EMA, early stopping) are no metric callbacks and
    # left out; one outside them, or with an interpolation only Hydra resolves, is left out and said; a forged one
    # (spelled as a trusted path but something else, or given code where it takes data) refuses the whole folder.
    kept, trusted = {}, [*trusted, "runner.callbacks"]
    group = cfg.get("callbacks")
    for name in group if isinstance(group, DictConfig) else ():
        node = group[name]
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        key = f"callbacks.{name}"
        try:
            node = _resolved(cfg, key, config)
        except _Unresolvable as error:
            print(f"{key} not run: {error}", file=sys.stderr)
            continue
        verdict = trust.problems(node, "callback", trusted, key)
        if verdict.forged:
            trust.check(node, "callback", trusted, key, str(config))
        if verdict.untrusted:
            print(f"{key} not run: {verdict.untrusted[0]} (add its package to trusted_targets)", file=sys.stderr)
        if verdict.untrusted or verdict.unmarked:
            continue
        kept[name] = confined(verdict.node, trusted)
    return kept


def measuring_callbacks(cfg: DictConfig) -> list[Any]:
    """The callbacks of a finished run's config (load_trained's, callbacks=True, which kept only trusted ones) that
    add validation metrics, those with `provides`: perplexity, an SAE's recovered features or its spliced loss;
    runner.tools.evaluate runs them after the validation split, as the run did."""
    with user_errors():
        built = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    return [callback for callback in built if callback.provides]


def _has_null(node: DictConfig) -> bool:
    # literal nulls only (an interpolation that resolves to null is the config's own choice, not the data's)
    return any(value is None for value in OmegaConf.to_container(node, resolve=False).values())
