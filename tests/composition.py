"""Hydra's composition, shared between the tests' compositions that choose the same options (helpers.compose_job).

Hydra composes in two stages: the overrides that choose config groups' options (`model=sae_relu`, `+experiment=sae`,
`~logger`) make the defaults list and the merged config, then the overrides of values (`trainer.max_duration=3st`,
`+model.nope=1`) are applied to it one by one (ConfigLoaderImpl._apply_overrides_to_config), and the hydra node's
bookkeeping (the overrides lists, cwd, override_dirname) is written last. The first stage is most of a composition's
~100 ms and the unit tier composes about a thousand times, mostly the same few dozen choices with other values: it is
done once a process for each choice of options, and each composition takes a copy and runs the second stage with
Hydra's own functions, in Hydra's order. tests/unit/test_composition.py checks the result equals Hydra's whole
composition, errors included. Overrides of the hydra node's own values (other than the run folder) and sweeps take
Hydra's whole path. Within the first stage each option file is loaded (read, wrapped, its defaults list made) once
a process and copied after (_loads_shared): Hydra loads every file again at each composition, and a copy costs a
fraction of a load. A file on disk is keyed by its size and modification time too, and ConfigStore's structured
configs, which a test may register anew, are always loaded.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hydra import compose
from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra._internal.config_repository import ConfigRepository
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobRuntime
from hydra.errors import ConfigCompositionException
from hydra.plugins.config_source import ConfigResult
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

_CHOSEN: dict[tuple, DictConfig] = {}  # (options chosen, search path, job name) -> the config Hydra composed
_LOADED: dict[tuple, ConfigResult | None] = {}  # (search path, config path, file's state) -> what a load gave
_OWN = ("hydra.run.dir",)  # hydra-node values the second stage may set: written before the bookkeeping, as Hydra does


def composed(config_name: str, overrides: list[str]) -> DictConfig:
    """Hydra's `compose(config_name, overrides, return_hydra_config=True)` in the initialized GlobalHydra, its
    option-choosing stage shared with earlier compositions that chose the same options."""
    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    if any(_hydra_value(o) for o in parsed) or any(o.is_sweep_override() for o in parsed):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    repo = loader.repository  # type: ignore[attr-defined]
    values: list[Override] = []  # Hydra's config overrides; the others choose options (defaults_list.Overrides)
    choices: list[str] = []
    for o in parsed:
        if isinstance(o.value(), dict) or not repo.group_exists(o.key_or_group):
            values.append(o)
        else:
            choices.append(o.input_line)
    key = (config_name, tuple(choices), tuple(s.path for s in loader.get_sources()), JobRuntime.instance().get("name"))
    if key not in _CHOSEN:
        with _loads_shared():
            _CHOSEN[key] = compose(config_name=config_name, overrides=choices, return_hydra_config=True)
    cfg = copy.deepcopy(_CHOSEN[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as error:  # as ConfigLoaderImpl.load_configuration wraps them
        raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from error
    app = [o for o in parsed if not o.is_hydra_override()]
    cfg.hydra.overrides.hydra = [o.input_line for o in parsed if o.is_hydra_override()]
    cfg.hydra.overrides.task = [o.input_line for o in app]
    cfg.hydra.runtime.cwd = os.getcwd()
    dirname = cfg.hydra.job.config.override_dirname
    cfg.hydra.job.override_dirname = get_overrides_dirname(
        overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys
    )
    return cfg


def _hydra_value(override: Override) -> bool:
    # a value of the hydra node that Hydra reads while composing (searchpath, env_copy) or overwrites after
    key = override.key_or_group
    return key.startswith("hydra.") and key not in _OWN


@contextmanager
def _loads_shared() -> Iterator[None]:
    """ConfigRepository.load_config answered from _LOADED (a copy each time: Hydra merges a loaded config's nodes into
    the composition without copying them)."""
    load = ConfigRepository.load_config

    def shared(self: ConfigRepository, config_path: str) -> ConfigResult | None:
        source = self._find_object_source(config_path, ObjectType.CONFIG)
        if source is None or source.scheme() == "structured":
            return load(self, config_path)
        state = None
        if source.scheme() == "file":
            stat = os.stat(os.path.join(source.path, source._normalize_file_name(config_path)))
            state = (stat.st_size, stat.st_mtime_ns)
        key = (tuple(s.path for s in self.sources), config_path, state)
        if key not in _LOADED:
            _LOADED[key] = load(self, config_path)
        return copy.deepcopy(_LOADED[key])

    ConfigRepository.load_config = shared  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigRepository.load_config = load  # type: ignore[method-assign]
