"""The config's own resolvers (runner_now, runner_fresh, runner_hydra_subdir, runner_direction), registered
explicitly by the entry points that compose a config: the CLI, the SLURM launcher's tasks, tests; and the check that
every interpolation of a composed config resolves (runner.config.checks asks it first)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, UnsupportedInterpolationType

from runner import ConfigError
from runner.rundir import CLASH
from runner.rundir.refused import missing, note_made

_launch = {"time": None}  # rank 0's clock under torchrun (set_launch_time), so that every rank dates the same folder


def set_launch_time(seconds: float | None) -> None:
    """The time that ${runner_now:...} formats (None: the current time at each resolution)."""
    _launch["time"] = seconds


def _now(pattern: str) -> str:
    return time.strftime(pattern, time.localtime(_launch["time"] or time.time()))


def _hydra_subdir(output_dir: str, resume: Any) -> str:
    # A launch that resumes into an existing run folder keeps that folder's .hydra/ and stores its own beside it. A
    # new run pointed at a folder that holds a run must not overwrite its config either: it writes aside, and the
    # CLI then refuses it (runner.rundir.claim).
    # Decided once per folder: Hydra resolves it again after writing .hydra/config.yaml.
    key = f"{output_dir}\0{resume}"
    if key not in _subdirs:
        kind = "resume" if resume is not None else CLASH
        existing = (Path(output_dir) / ".hydra" / "config.yaml").is_file()
        _subdirs[key] = f".hydra/{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" if existing else ".hydra"
    return _subdirs[key]


_claimed: dict[str, str] = {}
_subdirs: dict[str, str] = {}


def _fresh(directory: str, resume: Any = None) -> str:
    # A dated run folder of its own: `directory` if this process can create it, else `directory`-1, -2... (mkdir is
    # atomic: two launches in the same second get two folders). A resume (or an elastic restart, which resumes) goes
    # back to `directory` itself. Under a process group, rank 0 chooses and every rank gets its choice. Cached: Hydra
    # resolves the run folder several times.
    if resume is not None:
        return directory
    if directory not in _claimed:
        import torch.distributed as dist

        choice = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            choice[0] = _claim(directory)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        _claimed[directory] = choice[0]
    return _claimed[directory]


def _claim(directory: str) -> str:
    parents = missing(Path(directory).parent)
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        candidate = directory if n == 0 else f"{directory}-{n}"
        try:
            os.mkdir(candidate)
            # a refused run removes them (runner.rundir.refused)
            note_made([Path(os.path.abspath(candidate)), *parents])
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder beside {directory}")


def _direction(mode: str) -> str:
    # Optuna's direction from the config's `mode` of `monitor` (experiments/conf/hparams_search/): one setting, not two
    return {"min": "minimize", "max": "maximize"}[str(mode)]


def register() -> None:
    """Register runner's resolvers with OmegaConf (idempotent)."""
    OmegaConf.register_new_resolver("runner_now", _now, replace=True)
    OmegaConf.register_new_resolver("runner_hydra_subdir", _hydra_subdir, replace=True)
    OmegaConf.register_new_resolver("runner_fresh", _fresh, replace=True)
    OmegaConf.register_new_resolver("runner_direction", _direction, replace=True)


def _unresolved(node: Any, path: str) -> Iterator[tuple[str, str, InterpolationResolutionError]]:
    # (key, its interpolation, the error) of each interpolation that cannot be resolved: an unset ${oc.env:NAME}
    # was a traceback from deep inside OmegaConf wherever the key was first read.
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node)) if isinstance(node, ListConfig) else ()
    for key in keys:
        child, at = node._get_node(key), f"{path}.{key}" if path else str(key)
        if path == "" and key == "hydra":
            continue  # Hydra's own, resolved by Hydra before the job started
        if not child._is_interpolation():
            yield from _unresolved(child, at)
            continue
        try:
            node[key]
        except InterpolationResolutionError as error:
            yield at, child._value(), error


def check_interpolations(cfg: DictConfig) -> None:
    """A ConfigError naming the first key of the job config whose interpolation cannot be resolved for a reason of
    the config's own (an unset environment variable, a key or resolver that does not exist), and the fix."""
    for key, raw, error in _unresolved(cfg, ""):
        said = str(error).splitlines()[0]
        if variable := re.search(r"Environment variable '(.*)' not found", said):
            name = variable.group(1)
            raise ConfigError(
                f"{key}={raw}: the environment variable {name} is not set: set it (export {name}=...) before the "
                f"command, or give a default after a comma: ${{oc.env:{name},default}}. oc.env gives text: a number "
                f"or a list is {key}='${{oc.decode:${{oc.env:{name},default}}}}' (quoted: Hydra reads nested "
                "interpolations only in quotes)"
            )
        if isinstance(error, InterpolationKeyError):
            absent = re.search(r"key '(.*)' not found", said)
            why = f"{absent.group(1) if absent else raw} is not a key of the config"
            fix = "name a key in full, e.g. ${model.seq_len} (`python -m runner ... --cfg job` prints every key)"
        elif isinstance(error, UnsupportedInterpolationType):
            why = f"there is no resolver {said.rpartition(' ')[2]!r}"
            fix = "e.g. ${oc.env:NAME,default} reads the environment, ${oc.select:key,default} another key"
        else:  # a resolver's own error (${hydra:...} outside a Hydra job: a library caller): said where it is read
            continue
        raise ConfigError(f"{key}={raw} cannot be resolved ({why}): {fix}")
