"""Digits: an MLP classifier on scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download)."""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data import TensorData


def _digits_file() -> Path:
    # Locate the data file shipped inside scikit-learn without importing it (sklearn's import costs ~1 s).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the digits experiment reads the data set shipped with scikit-learn, which is not installed. "
            'Fix: pip install -e ".[examples]"   (or: pip install scikit-learn)'
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():
        raise ConfigError(
            f"scikit-learn is installed but {path} is missing; reinstall it: pip install --force-reinstall scikit-learn"
        )
    return path


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 [1797, 64] scaled to [0, 1], labels as int64 [1797] (fresh arrays: the caller's to change)."""
    images, labels = _parsed(_digits_file())
    return images.copy(), labels.copy()


@functools.lru_cache(maxsize=1)
def _parsed(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # the text table parsed once a process: a third of a digits run's build, and a sweep builds one a job
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a train/val split that keeps each class's share in both parts."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


@buildable("splits")
def digits_splits(val_fraction: float = 0.2, seed: int = 0, test_fraction: float = 0.0) -> dict[str, TensorData]:
    """{'train': ..., 'val': ..., 'test': ...} datasets of (image, label) tensors; the test split (when
    test_fraction > 0) is carved out of the held-out val_fraction, so that the training split does not change."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"data.splits.seed must be a whole number >= 0, got {seed!r}: e.g. data.splits.seed=0")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.splits.val_fraction must be in (0, 1), got {val_fraction}")
    if not 0.0 <= test_fraction < val_fraction:
        raise ConfigError(
            f"data.splits.test_fraction={test_fraction} must be in [0, val_fraction={val_fraction}): the test split "
            "is part of the held-out images"
        )
    x, y = load_digits()
    train, val = stratified_split(y, val_fraction, seed)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if test_fraction == 0:
        return {"train": TensorData(x[train], y[train]), "val": TensorData(x[val], y[val])}
    kept, test = stratified_split(y[val].numpy(), test_fraction / val_fraction, seed + 1)
    val, test = val[kept], val[test]
    return {
        "train": TensorData(x[train], y[train]),
        "val": TensorData(x[val], y[val]),
        "test": TensorData(x[test], y[test]),
    }


@buildable("model")
class MLPClassifier(nn.Module):
    """ReLU MLP with dropout; training_step returns cross-entropy loss and accuracy."""

    def __init__(
        self, in_features: int = 64, hidden: list[int] = (256, 256), num_classes: int = 10, dropout: float = 0.0
    ) -> None:
        super().__init__()
        check_whole(in_features, "model.in_features")
        check_whole(num_classes, "model.num_classes")
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in hidden):
            raise ConfigError(
                f"model.hidden={list(hidden)}: each hidden layer's width must be a whole number >= 1: e.g. "
                "model.hidden=[256,256] ([] for none)"
            )
        if not 0 <= dropout < 1:  # torch takes 1.0, which zeroes every activation: nothing could be learned
            raise ConfigError(
                f"model.dropout must be in [0, 1) (the share of activations zeroed), got {dropout}: "
                "e.g. model.dropout=0.1"
            )
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU(), nn.Dropout(dropout)]
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy and accuracy of one batch."""
        x, y = batch
        logits = self(x)
        return {"loss": F.cross_entropy(logits.float(), y), "acc": (logits.argmax(-1) == y).float().mean()}

    validation_step = training_step
