"""Weights read into an FSDP2-sharded model (runner.ckpt.sliced: an FSDP init_from, the sharded source): each rank
reads from the safetensors file only the rows its shards hold, checked by one rank. In one process, as rank 0 or 1
of 2 on torch's fake process group (no communication: each rank's own reads are what is counted)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runner.ckpt import sliced
from runner.ckpt.dcp import check_share
from runner.ckpt.files import CheckpointError, read_manifest
from runner.ckpt.weights import save_weights


class _Counted:
    # a safe_open handle that counts the bytes of the tensors read through it
    def __init__(self, handle: Any, read: list[int]) -> None:
        self.handle, self.read = handle, read

    def __enter__(self) -> _Counted:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        tensor = self.handle.get_tensor(key)
        self.read.append(tensor.numel() * tensor.element_size())
        return tensor

    def get_slice(self, key: str) -> Any:
        part, read = self.handle.get_slice(key), self.read

        class Slice:
            def get_shape(self) -> list[int]:
                return part.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                tensor = part[index]
                read.append(tensor.numel() * tensor.element_size())
                return tensor

        return Slice()


def _model() -> nn.Module:
    # 9 rows: uneven over 2 ranks; a BatchNorm's running statistics are buffers, read whole
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 9))


# Rank 0 of 2 and rank 1 of 3: torch keeps the device meshes of one process's group by their ranks, and a mesh of the
# same ranks from an earlier group (of another rank) would be found again
@pytest.fixture(params=[(0, 2), (1, 3)], ids=["rank0of2", "rank1of3"])
def rank(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """This process as one rank of several (torch's fake process group: collectives do nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=request.param[0], world_size=request.param[1], store=FakeStore())
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def _sharded(rank: tuple[int, int], monkeypatch: pytest.MonkeyPatch, verdict: Any = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = _model(), init_device_mesh("cpu", (rank[1],))
    for module in (model[0], model[2]):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank[0]:  # the fake group broadcasts nothing: rank 1 is told what rank 0 found
        monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda out, src: out.__setitem__(0, verdict))
    return model


def test_each_rank_reads_only_the_rows_its_shards_hold(
    rank: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    weights = {k: torch.randn_like(v) if v.is_floating_point() else v + 3 for k, v in _model().state_dict().items()}
    save_weights(weights, tmp_path / "model.safetensors")  # with its sha256 record
    model = _sharded(rank, monkeypatch, ("ok", None))
    read: list[int] = []
    opened = sliced.safe_open
    monkeypatch.setattr(sliced, "safe_open", lambda *a, **k: _Counted(opened(*a, **k), read))
    checked: list[Path] = []
    digest = sliced.digest
    monkeypatch.setattr(sliced, "digest", lambda file: checked.append(file) or digest(file))
    report = sliced.load_sliced(model, tmp_path, say=False)
    assert report == {"missing": [], "unexpected": [], "shape_mismatch": []}
    own = {}
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        own[name] = local.numel() * local.element_size()
        rows = weights[name].chunk(rank[1])[rank[0]] if hasattr(tensor, "to_local") else weights[name]
        assert torch.equal(local, rows), name  # torch.chunk's split, as FSDP's: 9 rows are 5 + 4, or 3 + 3 + 3
    whole = sum(t.numel() * t.element_size() for t in weights.values())
    assert sum(read) == sum(own.values()) < 0.6 * whole, (read, own)  # its shards' rows and the buffers, once
    assert checked == ([tmp_path / "model.safetensors"] if rank[0] == 0 else [])  # one rank hashes the file


def test_a_corrupted_file_is_refused_on_every_rank(
    rank: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_weights(_model().state_dict(), tmp_path / "w.safetensors")
    data = bytearray((tmp_path / "w.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "w.safetensors").write_bytes(bytes(data))
    model = _sharded(rank, monkeypatch, ("error", "as rank 0 said"))
    said = "does not match the sha256 recorded" if rank[0] == 0 else "as rank 0 said"
    with pytest.raises(CheckpointError, match=said):
        sliced.load_sliced(model, tmp_path / "w.safetensors")


def test_weights_of_another_shape_are_refused_as_load_weights_refuses_them(
    rank: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    save_weights(other.state_dict(), tmp_path / "w.safetensors")
    model = _sharded(rank, monkeypatch, ("ok", None))
    with pytest.raises(CheckpointError, match=r"does not fit the model \(shape_mismatch: \['2.bias', '2.weight'\]\)"):
        sliced.load_sliced(model, tmp_path / "w.safetensors")


def _distributed_checkpoint(state: dict[str, torch.Tensor], folder: Path) -> Path:
    # a sealed checkpoint.format=dcp folder of one process holding `state` as its model (no optimizer state)
    import hashlib
    import json

    import torch.distributed.checkpoint as dcp

    from runner.ckpt.files import manifest_checksum

    dcp.save({"model": state}, checkpoint_id=folder, no_dist=True)
    for name in ("shared.pt", "rank-0.pt"):
        torch.save({}, folder / name)
    files = {
        f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in folder.iterdir()
    }
    manifest = {"format": "dcp", "world_size": 1, "step": 1, "files": files}
    (folder / "manifest.json").write_text(json.dumps({**manifest, "manifest_sha256": manifest_checksum(manifest)}))
    return folder


def test_a_distributed_checkpoint_is_read_by_dcp_into_the_shards_never_whole(
    rank: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's load plans each rank's reads from its shards' own chunks (the fake group cannot coordinate: no_dist)
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1)
    weights = {k: torch.randn_like(v) if v.is_floating_point() else v + 1 for k, v in _model().state_dict().items()}
    folder = _distributed_checkpoint(weights, tmp_path / "step-1")
    model = _sharded(rank, monkeypatch, ("ok", read_manifest(folder)))  # what rank 0 read, for rank 1
    load, targets = dcp.load, []
    monkeypatch.setattr(dcp, "load", lambda state, **k: targets.append(state) or load(state, **{**k, "no_dist": True}))
    monkeypatch.setattr(sliced, "safe_open", lambda *a, **k: pytest.fail("a distributed checkpoint read as a file"))
    report = sliced.load_sliced(model, folder, say=False)
    assert report == {"missing": [], "unexpected": [], "shape_mismatch": []}
    sharded = [name for name, tensor in model.state_dict().items() if hasattr(tensor, "to_local")]
    assert [name for name, t in targets[0]["model"].items() if hasattr(t, "to_local")] == sharded  # into the shards
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        rows = weights[name].chunk(rank[1])[rank[0]] if hasattr(tensor, "to_local") else weights[name]
        assert torch.equal(local, rows), name


def test_the_ranks_split_the_checking_of_a_distributed_checkpoint_and_all_refuse_a_corrupt_file(
    rank: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    from runner.ckpt import files

    load = dcp.load  # the fake group cannot plan DCP's reads together: each rank plans its own (no_dist)
    monkeypatch.setattr(dcp, "load", lambda state, **k: load(state, **{**k, "no_dist": True}))
    folder = _distributed_checkpoint(_model().state_dict(), tmp_path / "step-1")
    names = sorted(read_manifest(folder)["files"])  # .metadata, a .distcp, shared.pt, rank-0.pt
    model = _sharded(rank, monkeypatch, ("ok", read_manifest(folder)))
    hashed: list[str] = []
    digest = files.digest
    monkeypatch.setattr(files, "digest", lambda file: hashed.append(file.name) or digest(file))
    sliced.load_sliced(model, folder, say=False)
    assert hashed == names[rank[0] :: rank[1]] and len(names) == 4  # this rank's share, no other file

    # a file of another rank's share is corrupt: that rank's finding (all_gather) is raised here too
    other = names[(rank[0] + 1) % rank[1] :: rank[1]][0]
    (folder / other).write_bytes((folder / other).read_bytes()[:-1])
    theirs = check_share(folder, (rank[0] + 1) % rank[1], rank[1])
    assert theirs and other in theirs

    def gathered(out: list, found: str | None) -> None:  # what every rank found: theirs, and this rank's own
        out[:] = [found if r == rank[0] else theirs for r in range(rank[1])]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gathered)
    with pytest.raises(CheckpointError, match="does not match|is cut short|bytes"):
        sliced.load_sliced(_sharded(rank, monkeypatch, ("ok", read_manifest(folder))), folder, say=False)
