"""Data that reads a frozen model (experiments.sae.sources.source): the outputs of its named modules, one data option
per pipeline, each built on the same frozen source and validated on the same rows, the activations of the source's
validation inputs (frozen_source):

    data=activations_hooked, activations_lm        LiveActivations: computed as training goes, through a shuffling
                                                   ring buffer (experiments.sae.sources.buffer)
    data=activations_cached, activations_lm_cached CachedActivations: written to a folder once, read back
                                                   memory-mapped by every later run (experiments.sae.sources.cache)
    data=activations_spliced                       SourceWindows: the source's own windows, for a coder trained
                                                   through the model (experiments/sae/end_to_end.py)

HookedData reads the run folders written when the three were one class chosen by flags."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset

from experiments.sae.sources.buffer import ActivationBuffer, HookedActivations
from experiments.sae.sources.cache import SHARD_ROWS, cached, identity
from experiments.sae.sources.sharded import source_parameters
from experiments.sae.sources.source import SourceModel
from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data import DataModule, TensorData
from runner.load import TRUSTED_TARGETS
from runner.timeline import phase

HOOKED = ("LiveActivations", "CachedActivations", "SourceWindows", "HookedData")


def hooks_a_model(data: Any) -> bool:
    """Whether a run's `data` config reads the activations of a source model: one of these options (or an older
    run folder's HookedData), not a file or a generator."""
    return str(data.get("_target_", "")).rpartition(".")[2] in HOOKED


class Frozen(NamedTuple):
    """The frozen source model a data option reads, its validation rows, and what it decides of the coder."""

    source: SourceModel
    val: TensorData
    model_args: dict[str, Any]


def frozen_source(
    checkpoint: str,
    module: str | Sequence[str],
    d: int | None,
    trusted_targets: Sequence[str],
    skip_positions: int,
    inputs: dict | None,
    target: str | Sequence[str] | None,
    shard: str | None = None,
    limit: float | int | None = None,
) -> Frozen:
    """The model of run `checkpoint` (or a transformers model reading `inputs`: experiments.sae.sources.pretrained),
    frozen, on the CPU, hooked at `module` (and a transcoder's `target`: rows [module's | target's], from one forward);
    its validation activations; and the coder's widths (model_args). Refused: a source without a validation split,
    and a `d` (model.d_in) that is not the hooked module's width."""
    source = SourceModel(checkpoint, module, "cpu", trusted_targets, skip_positions, inputs, target, shard)
    # data.limit_val_batches counts the source's batches, whose forwards are the work: the rows validation reads come
    # from that many (debug=fast's two), as the splice's losses do (callbacks.sae_splice.limit_batches)
    source.data.limit_val_batches = limit
    if source.data.val_loader() is None:
        raise ConfigError(
            f"the source run {checkpoint} has no validation split, which the SAE validates (and splices) on: "
            "train the source with one (the lm data: data.val_every >= 2 and 2 files or more in data.paths)"
        )
    with phase("source validation rows"):
        val = torch.cat([source.activations(batch).cpu() for batch in source.data.val_loader()])
    read = [name for name in source.names if name not in source.targets]  # what an SAE (or transcoder) reads
    several = len(read) > 1 and not source.targets
    if d is not None and (several or source.widths[source.name] != d):
        widths = " + ".join(str(source.widths[name]) for name in read)
        raise ConfigError(
            f"{', '.join(read)} output{'' if several else 's'} {widths} features but model.d_in={d}: "
            "leave model.d_in out, the SAEs take their modules' widths"
        )
    # The SAE's width is the module's; with several modules, a family (model=sae_multi) takes each one's width
    # and columns, and a single SAE, given no width, says to use one. A transcoder's output is the target's.
    args: dict[str, Any] = {"hooks": dict(source.widths)} if several else {"d_in": source.widths[source.name]}
    if len(source.targets) == 1:
        args["d_out"] = source.widths[source.targets[0]]
    elif source.targets:  # a cross-layer transcoder's layers: their inputs alike, their outputs alike
        args = {
            "layers": len(read),
            **_same_width(source, read, "d_in"),
            **_same_width(source, source.targets, "d_out"),
        }
    return Frozen(source, TensorData(val), args)


def _same_width(source: SourceModel, names: list[str], key: str) -> dict[str, int]:
    widths = {source.widths[name] for name in names}
    if len(widths) > 1:
        raise ConfigError(
            f"{', '.join(names)} output {sorted(widths)} features: a cross-layer transcoder's layers need one {key}; "
            "hook modules of the same width at every layer"
        )
    return {key: widths.pop()}


@buildable("data")
class LiveActivations(DataModule):
    """Train on live activations of the source (frozen_source), served through a shuffling ring buffer of
    `buffer_size` rows, half of it refilled at a time; an epoch of this endless stream is `samples_per_epoch` rows.
    With `shard=fsdp` the source is sharded over the ranks (FSDP2), each running its slice of every batch."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        buffer_size: int = 16384,
        samples_per_epoch: int = 65536,
        d: int | None = None,
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        shard: str | None = None,
        **loader,
    ) -> None:
        if loader.get("num_workers", 0) != 0:
            raise ConfigError("activations_hooked keeps its buffer in this process: set data.num_workers=0")
        if buffer_size < 2 * loader.get("batch_size", 1):
            raise ConfigError(
                f"data.buffer_size={buffer_size} must hold at least two batches "
                f"(2 x data.batch_size={loader.get('batch_size')}): half of it is refilled at a time"
            )
        where = (checkpoint, module, d, trusted_targets, skip_positions, inputs, target, shard)
        # the splice callback reuses it (run.data)
        self.frozen = frozen_source(*where, loader.pop("limit_val_batches", None))
        source, val, model_args = self.frozen
        train = HookedActivations(ActivationBuffer(source, buffer_size, loader.get("seed", 0)), samples_per_epoch)
        super().__init__({"train": train, "val": val}, **loader)
        self.model_args = model_args
        if source.ranks is not None:  # run.json says what each rank holds of the source (rank 0's, as every rank's)
            self.info["source_parameters"] = source_parameters(source.model)

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> DataLoader:
        """The training loader; on a GPU the source runs there and the ring lives there (no copies of activations)."""
        device = torch.device(device or "cpu")
        train = self.splits["train"]
        if world_size > 1:  # every rank's ring alike, each keeping its share
            step = self.batch_size * world_size  # the rows every rank takes at once: its share and the others'
            if 2 * step > train.buffer.capacity or len(train) % (step * accumulate):
                raise ConfigError(
                    f"data.buffer_size={train.buffer.capacity} and data.samples_per_epoch={len(train)} on {world_size} "
                    f"processes: every rank takes the {step} rows of all ranks' micro-batches (data.batch_size="
                    f"{self.batch_size} each) from a ring alike, so the ring must hold two such takes and an epoch be "
                    f"whole global batches of {step * accumulate}: e.g. data.buffer_size={max(2 * step, 16384)} "
                    f"data.samples_per_epoch={max(1, len(train) // (step * accumulate)) * step * accumulate}"
                )
            train.rank, train.world_size = rank, world_size
        if device.type == "cuda":
            train.buffer.to(device)
            device = torch.device("cpu")  # the loader's device only decides pinning: these batches are born on the GPU
        return super().train_loader(rank, world_size, device, accumulate)


@buildable("data")
class CachedActivations(DataModule):
    """Train on activations of the source (frozen_source) written once to the folder `cache`: the first `cache_rows`
    of its stream, as `cache_dtype`, in .npy shards of `cache_shard_rows` rows, then a manifest naming what they were
    made from (experiments.sae.sources.cache); later runs of the same source read them back memory-mapped, in the
    sampler's shuffled order. An epoch is one pass over them. Validation activations are computed live.

    A run rebuilt from its folder by runner's tools has `cache=None` (runner.config.confine: a folder's config
    never says where runner reads or writes): its training split then has no rows to give."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        cache: str | None,
        cache_rows: int = 65536,
        cache_dtype: str = "float32",
        cache_shard_rows: int = SHARD_ROWS,
        d: int | None = None,
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        **loader,
    ) -> None:
        check_whole(cache_rows, "data.cache_rows")
        check_whole(cache_shard_rows, "data.cache_shard_rows")
        limit = loader.pop("limit_val_batches", None)
        self.frozen = frozen_source(checkpoint, module, d, trusted_targets, skip_positions, inputs, target, None, limit)
        source, val, model_args = self.frozen
        train: Dataset = _NoRows()
        if cache is not None:
            hooked = source.names if len(source.names) > 1 else source.name  # a transcoder's target too
            hf = source.pretrained  # a transformers source: its weight files and the text it read name the cache too
            weights, facts = (hf.weight_files(), hf.inputs) if hf else (None, None)
            key = identity(checkpoint, hooked, skip_positions, cache_dtype, val.tensors[0].shape[1], weights, facts)
            train = cached(cache, source, key, cache_rows, cache_shard_rows)
        loader["shuffle"] = True  # the cache holds the rows in the source's order; the sampler shuffles them
        super().__init__({"train": train, "val": val}, **loader)
        self.model_args = model_args
        if cache is not None:
            self.info = {"activation_cache": str(cache), "cached_rows": len(train)}


class _NoRows(Dataset):
    # the training split of CachedActivations without a cache folder (a run rebuilt by runner's tools)
    def __len__(self) -> int:
        raise ConfigError(
            "data.cache=null: this data's training rows are written to and read from a folder; give one, "
            "data.cache=DIR (a run rebuilt from its folder by runner's tools reads none: use its validation split)"
        )

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


@buildable("data")
class SourceWindows(DataModule):
    """Train on the source's own windows (its training split, batched and shuffled here), for a coder trained through
    the model (experiments/sae/end_to_end.py), which the data hands the source to (model_args["source"]: one copy
    of the model); validation still reads activation rows (frozen_source)."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        d: int | None = None,
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        **loader,
    ) -> None:
        limit = loader.pop("limit_val_batches", None)
        self.frozen = frozen_source(checkpoint, module, d, trusted_targets, skip_positions, inputs, target, None, limit)
        source, val, model_args = self.frozen
        loader["tokens_per_sample"] = source.data.tokens_per_sample
        super().__init__({"train": source.data.splits["train"], "val": val}, **loader)
        self.model_args = {**model_args, "source": source}
