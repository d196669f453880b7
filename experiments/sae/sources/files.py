"""Activation files for SAEs and transcoders (data=activations_file): .npy, .pt and .safetensors matrices of rows,
checked before training (shape, dtype, NaN/inf in a sample of rows; pickled data never loaded). A transcoder's rows hold
its input's columns, then its target's last `d_out` (as a hooked source with source.target writes them)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from runner import ConfigError
from runner.config.trust import buildable
from runner.data import DataModule, load_npy


class RowData(Dataset):
    """Rows [start, stop) of an [N, d] array (a numpy memmap or a tensor); a batch is one fancy-indexing read."""

    def __init__(self, array: np.ndarray | torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        self.array, self.start = array, start
        self.stop = len(array) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor]:
        rows = np.asarray(indices) + self.start
        if isinstance(self.array, np.ndarray):
            # sorted reads are sequential on disk; the order inside a batch does not matter to an SAE
            return (torch.from_numpy(np.ascontiguousarray(self.array[np.sort(rows)])).float(),)
        return (self.array[torch.from_numpy(rows)].float(),)


_FLOATS = {np.dtype("float16"), np.dtype("float32"), np.dtype("float64")}


def load_matrix(path: str | Path, key: str | None = None, d: int | None = None) -> np.ndarray | torch.Tensor:
    """An [N, d] float matrix from .npy (memory-mapped), .pt (a tensor or a dict of them) or .safetensors."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"activation file {path} does not exist")
    if path.is_dir():
        raise ConfigError(
            f"activation file {path} is a folder: give a file (.npy, .pt, .safetensors); a data.cache folder is "
            "read by the run that hooks its source (+experiment=sae_lm data=activations_lm_cached data.cache=DIR)"
        )
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            array = load_npy(path, f"activation file {path}")  # memory-mapped: reads only the rows asked for
        elif suffix == ".pt":
            array = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            array = load_file(str(path))
        else:
            raise ConfigError(f"activation file {path}: unknown format {suffix!r}; use .npy, .pt or .safetensors")
    except pickle.UnpicklingError:
        raise ConfigError(
            f"activation file {path} holds pickled Python objects, which runner never unpickles (they could run "
            "code); save a plain tensor: torch.save(tensor, path), or a dict of tensors"
        ) from None
    except ConfigError:
        raise
    except Exception as error:  # empty, truncated or not the format its suffix says
        raise ConfigError(f"activation file {path} cannot be read ({type(error).__name__}: {error})") from None
    if isinstance(array, dict):
        if key is None and len(array) != 1:
            raise ConfigError(f"activation file {path} holds {sorted(array)}: set data.key to one of them")
        if key is not None and key not in array:
            raise ConfigError(f"activation file {path} has no tensor {key!r}; it holds {sorted(array)}")
        array = array[key] if key is not None else next(iter(array.values()))
    if not isinstance(array, (np.ndarray, torch.Tensor)):
        raise ConfigError(f"activation file {path} holds a {type(array).__name__}, not a tensor or array")
    dtype_ok = array.dtype in _FLOATS if isinstance(array, np.ndarray) else array.is_floating_point()
    if array.ndim != 2 or not dtype_ok or (d is not None and array.shape[1] != d):
        want = f"[N, {d}]" if d is not None else "[N, d]"
        raise ConfigError(
            f"activation file {path} holds a {array.dtype} array of shape {list(array.shape)}; "
            f"expected a floating-point {want} matrix (one activation vector per row)"
        )
    _check_finite(array, path)
    return array


FINITE_SAMPLE_ROWS = 65536


def _check_finite(array: np.ndarray | torch.Tensor, path: Path) -> None:
    # Up to FINITE_SAMPLE_ROWS rows spread evenly over the file, read before training: a file with NaN or inf rows
    # would otherwise train only skipped steps and stop late (trainer.max_nonfinite_steps).
    rows = np.unique(np.linspace(0, len(array) - 1, min(len(array), FINITE_SAMPLE_ROWS)).astype(np.int64))
    sample = torch.as_tensor(
        np.asarray(array[rows]) if isinstance(array, np.ndarray) else array[torch.from_numpy(rows)]
    )
    bad = (~torch.isfinite(sample.float())).any(dim=1)
    if bool(bad.any()):
        first = int(rows[bad.nonzero()[0, 0]])
        raise ConfigError(
            f"activation file {path} holds NaN or inf values ({int(bad.sum())} of {len(rows)} sampled rows, the "
            f"first at row {first}); clean or regenerate the file"
        )


def file_splits(
    train_path: str,
    val_path: str | None = None,
    val_fraction: float = 0.05,
    key: str | None = None,
    d: int | None = None,
) -> dict[str, Dataset]:
    """Train/val activations from files: a separate validation file, or the last `val_fraction` of the rows."""
    train = load_matrix(train_path, key, d)
    if val_path:
        return {"train": RowData(train), "val": RowData(load_matrix(val_path, key, train.shape[1]))}
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(train) * val_fraction)
    if n_val == 0:
        return {"train": RowData(train)}
    return {"train": RowData(train, 0, len(train) - n_val), "val": RowData(train, len(train) - n_val)}


@buildable("data")
class ActivationFiles(DataModule):
    """A DataModule over activation files, so that the paths are top-level keys: data.train_path, data.val_path.
    `d_out` (null: an SAE's rows) makes each row a transcoder's: the input's columns, then the target's last d_out."""

    def __init__(
        self,
        train_path: str,
        val_path: str | None = None,
        val_fraction: float = 0.05,
        key: str | None = None,
        d: int | None = None,
        d_out: int | None = None,
        **loader,
    ) -> None:
        if d_out is not None and (isinstance(d_out, bool) or not isinstance(d_out, int) or d_out < 1):
            raise ConfigError(f"data.d_out={d_out!r}: give the target's width (the rows' last columns), or null")
        # d is the model's input width: a transcoder's rows are that and the target's columns
        width = d + d_out if d is not None and d_out is not None else d
        super().__init__(file_splits(train_path, val_path, val_fraction, key, width), **loader)
        columns = self.splits["train"].array.shape[1]
        if d_out is None:
            self.model_args = {"d_in": columns}  # the SAE's width is the file's
            return
        if d_out >= columns:
            raise ConfigError(
                f"data.d_out={d_out}, but the rows of {train_path} have {columns} columns: a transcoder's rows hold "
                "its input's columns, then the target's last d_out (give fewer, or data.d_out=null for an SAE)"
            )
        self.model_args = {"d_in": columns - d_out, "d_out": d_out}
