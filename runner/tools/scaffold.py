"""`runner init DIR [--name NAME]` (or `python -m runner.init`): a project of your own beside the runner package.

It writes a Python package (your model and data, importable by `_target_` from the project folder) and a `conf/`
folder of config groups that Hydra adds to runner's own with `--config-dir conf`:

    DIR/NAME/{__init__,model,data}.py  DIR/conf/{model,data,experiment}/NAME.yaml  DIR/README.md  DIR/runner.yaml

then `cd DIR && python -m runner --config-dir conf +experiment=NAME` trains the example (a small regression MLP on
data made in-process) with every runner option. Nothing is overwritten: an existing file stops it before it writes.
"""

from __future__ import annotations

import argparse
import keyword
import sys
from importlib.machinery import PathFinder
from pathlib import Path

from runner import ConfigError
from runner.tools.cli import as_flags

MODEL = '''"""NAME's model: an nn.Module with training_step (and validation_step) is all runner needs."""

from __future__ import annotations

import torch
from torch import nn

from runner.config.trust import buildable


@buildable("model")  # runner's tools (evaluate, an SAE on this model) may rebuild it from a run folder's config
class Model(nn.Module):
    """An MLP regressor: mean squared error of y from x."""

    def __init__(self, d_in: int = 8, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss runner minimises, and any metric to log."""
        x, y = batch
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(1), y)}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Metrics averaged over the whole validation split."""
        return self.training_step(batch)
'''

DATA = '''"""NAME's data: a mapping of datasets ('train', 'val') that runner.data.DataModule turns into loaders."""

from __future__ import annotations

import torch

from runner.data import TensorData
from runner.config.trust import buildable


@buildable("splits")  # a run folder's data.splits may name it (it only computes; nothing here may write files)
def splits(n_train: int = 4096, n_val: int = 512, d_in: int = 8, noise: float = 0.05, seed: int = 0) -> dict:
    """y = sum(sin(x)) + noise, from a seeded generator: the same data on every run and rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_val, d_in, generator=g)
    y = torch.sin(x).sum(1) + noise * torch.randn(n_train + n_val, generator=g)
    return {"train": TensorData(x[:n_train], y[:n_train]), "val": TensorData(x[n_train:], y[n_train:])}
'''

MODEL_YAML = """# NAME's model (NAME/model.py). Each key is a constructor argument: model.hidden=128 to change it.
_target_: NAME.model.Model
d_in: 8
hidden: 64
"""

DATA_YAML = """# NAME's data (NAME/data.py) through runner's DataModule (batching, shuffling, ranks, exact resume).
_target_: runner.data.DataModule
splits:
  _target_: NAME.data.splits
  n_train: 4096
  n_val: 512
  d_in: ${model.d_in}
  seed: ${seed}
batch_size: 64
val_batch_size: 512
num_workers: 0
shuffle: true
drop_last: false
seed: ${seed}
"""

EXPERIMENT_YAML = """# @package _global_
# python -m runner --config-dir conf +experiment=NAME   (from the project folder)
defaults:
  - override /model: NAME
  - override /data: NAME
  - override /optimizer: adamw

optimizer:
  lr: 3e-3

trainer:
  max_duration: 20ep
  val_interval: 1ep
  log_interval: 50st

trusted_targets: [experiments, runner.data, NAME]   # a later run may use this one as a source (SAEs on it)
"""

README = """# NAME

A project trained with runner: your code in `NAME/`, your configs in `conf/` (groups beside runner's own).

```bash
python -m runner --config-dir conf +experiment=NAME                    # train
python -m runner --config-dir conf +experiment=NAME model.hidden=256 optimizer.lr=1e-3
python -m runner --config-dir conf -m +experiment=NAME optimizer.lr=1e-3,3e-3   # a sweep
torchrun --nproc_per_node=2 -m runner --config-dir conf +experiment=NAME distributed=ddp
python -m runner.evaluate outputs/DATE/TIME split=val                   # on the validation split again
```

Run these from this folder: Python imports `NAME` from the working directory (or `pip install -e .` a package of your
own), and runner's tools (`runner.evaluate`, `runner.features`, `runner.generate`) read `runner.yaml`
here, which lets them build `NAME`'s classes named in a run folder's config (a run folder alone is never trusted to),
those marked `@buildable(...)` (runner.config.trust): a run folder from elsewhere builds nothing else. Add a model: a
class in `NAME/` marked `@buildable("model")`, a file `conf/model/OTHER.yaml` with its `_target_`, then `model=OTHER`.
"""

RUNNER_YAML = """# What runner's tools launched from this folder trust a run folder's config to build, beside runner's
# own (experiments, runner.data): python -m runner.evaluate RUN_DIR builds NAME's model and data with no
# trusted_targets= on the command line.
trusted_targets: [NAME]
"""

FILES = {
    "{name}/__init__.py": "",
    "{name}/model.py": MODEL,
    "{name}/data.py": DATA,
    "conf/model/{name}.yaml": MODEL_YAML,
    "conf/data/{name}.yaml": DATA_YAML,
    "conf/experiment/{name}.yaml": EXPERIMENT_YAML,
    "README.md": README,
    "runner.yaml": RUNNER_YAML,
}


# Folders a project holds beside its package (Hydra's config groups and output folders): not package names
FOLDERS = ("conf", "outputs", "multirun")


def _check_name(name: str) -> None:
    # The project runs with its folder first on sys.path, so a package named like an importable module (numpy, json,
    # google) would hide that module from everything else that imports it, torch and runner included.
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(f"--name {name!r} is not a Python package name: give letters, digits and _, e.g. --name task")
    if name in FOLDERS:
        raise ConfigError(f"--name {name}: the project already has a folder {name}/ of its own; give another name")
    if _importable(name):
        raise ConfigError(
            f"--name {name}: {name} is already importable here (the standard library or an installed package), "
            f"and a package of that name in your project would hide it from the code that imports it; "
            f"give another name, e.g. --name my_{name}"
        )


def _importable(name: str) -> bool:
    # importlib.util.find_spec's search, less the working folder (a project made there before is not installed): each
    # finder on sys.meta_path (the stdlib's, an editable install's), the path finder over sys.path without that folder
    here = Path.cwd().resolve()
    path = [p for p in sys.path if p and Path(p).resolve() != here]
    if name in sys.modules or name in sys.builtin_module_names:
        return True
    for finder in sys.meta_path:
        try:
            if finder.find_spec(name, path if finder is PathFinder else None) is not None:
                return True
        except (AttributeError, ImportError, ValueError):  # a finder without find_spec, or one that cannot say
            continue
    return False


def init(directory: str | Path, name: str = "project") -> list[Path]:
    """Write the project skeleton into `directory` (created if needed); returns the files written."""
    _check_name(name)
    root = Path(directory)
    paths = {root / pattern.format(name=name): text.replace("NAME", name) for pattern, text in FILES.items()}
    existing = [str(path) for path in paths if path.exists()]
    if existing:
        raise ConfigError(f"runner init would overwrite {', '.join(existing)}: pick an empty folder or another --name")
    # A file where a folder must go (DIR itself, or one above it) stops it before anything is written
    blocking = next((p for p in [root, *root.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"runner init {directory}: {blocking} is a file, not a folder; give a new or empty folder")
    try:
        for path, text in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except OSError as error:  # no permission, a file named like one of the folders, a full disk
        raise ConfigError(f"runner init cannot write {error.filename or directory}: {error.strerror}") from None
    return list(paths)


def main(argv: list[str] | None = None) -> int:
    """The command: write the skeleton and say how to train it; exit 2 with one line if it cannot."""
    parser = argparse.ArgumentParser(prog="runner init", description="Create a project of your own for runner.")
    parser.add_argument("directory")
    parser.add_argument("--name", default="project", help="the Python package of your code (default: project)")
    args = parser.parse_args(as_flags(sys.argv[1:] if argv is None else argv, ("name",)))
    try:
        written = init(args.directory, args.name)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files; train the example with:")
    print(f"  cd {args.directory} && python -m runner --config-dir conf +experiment={args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
