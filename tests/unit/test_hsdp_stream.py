"""The final weights streamed tensor by tensor (runner.ckpt.stream) are the bytes safetensors' own save writes, with
the same sha256 record; a failure mid-file leaves the earlier file as it was. HSDP's replicas must divide the ranks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner import ConfigError
from runner.ckpt import stream
from runner.ckpt.files import safetensors_bytes
from runner.ckpt.stream import DTYPES, stream_weights
from runner.ckpt.weights import read_weights, save_weights
from runner.distributed.fsdp import _replicas


def tensors() -> dict[str, torch.Tensor]:
    """Every dtype safetensors has, a scalar, an empty tensor, a transposed (strided) one and a tied pair."""
    gen = torch.Generator().manual_seed(0)
    found = {f"t.{str(dtype)[6:]}": (torch.randn(3, 5, generator=gen) * 40).to(dtype) for dtype in DTYPES}
    shared = torch.randn(4, 2, generator=gen)
    found |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3), "strided": torch.randn(6, 4).t()}
    return found | {"emb.weight": shared, "head.weight": shared, "ä.unicode": torch.ones(2, dtype=torch.float64)}


def streamed(state: dict[str, torch.Tensor], path: Path) -> bytes:
    stream_weights(state, {path: {name: name for name in state}}, write=True)
    return path.read_bytes()


def test_streamed_bytes_equal_safetensors_save_file(tmp_path: Path) -> None:
    state = tensors()
    expected = tmp_path / "expected.safetensors"
    save_file({k: v.clone().contiguous() for k, v in state.items()}, expected)  # no tied storage
    data = streamed(state, tmp_path / "model.safetensors")
    assert data == expected.read_bytes()
    record = (tmp_path / "model.safetensors.sha256").read_text()
    assert record == f"{hashlib.sha256(data).hexdigest()}  model.safetensors\n"
    loaded = read_weights(tmp_path / "model.safetensors")  # checked against the record
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name].float(), tensor.float()), name


def test_streamed_file_equals_save_weights_with_its_record(tmp_path: Path) -> None:
    # an adapters-only file (its metadata) and an empty one, as save_weights writes them
    for state in ({"a.lora_A": torch.randn(2, 3), "a.lora_B": torch.randn(3, 2)}, {}):
        save_weights(state, tmp_path / "saved.safetensors")
        assert streamed(state, tmp_path / "model.safetensors") == safetensors_bytes(state)
        saved, got = (
            hashlib.sha256((tmp_path / f"{n}.safetensors").read_bytes()).hexdigest() for n in ("saved", "model")
        )
        assert (tmp_path / "saved.safetensors.sha256").read_text().split()[0] == saved == got


def test_parts_are_streamed_in_the_same_pass_under_their_own_names(tmp_path: Path) -> None:
    state = {"sae.0.W": torch.randn(3, 2), "sae.0.b": torch.randn(2).half(), "sae.1.W": torch.randn(2, 2)}
    files = {tmp_path / "all.safetensors": {k: k for k in state}}
    files[tmp_path / "zero.safetensors"] = {k[len("sae.0.") :]: k for k in state if k.startswith("sae.0.")}
    stream_weights(state, files, write=True)
    zero = load_file(tmp_path / "zero.safetensors")
    assert zero.keys() == {"W", "b"} and torch.equal(zero["b"], state["sae.0.b"])
    assert (tmp_path / "zero.safetensors").read_bytes() == safetensors_bytes({"W": state["sae.0.W"], "b": zero["b"]})


def test_a_failure_mid_file_leaves_the_earlier_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.safetensors"
    before = streamed({"w": torch.zeros(2)}, path)
    written = []

    def failing(self: stream.StreamedFile, name: str, tensor: torch.Tensor) -> None:
        written.append(name)
        if len(written) == 2:
            raise OSError("the disk went away")

    monkeypatch.setattr(stream.StreamedFile, "write", failing)
    with pytest.raises(OSError, match="went away"):
        stream_weights(
            {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}, {path: {k: k for k in "abc"}}, write=True
        )
    # the record went first (as save_weights): the earlier weights stay, loaded unchecked; no temporary file is left
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_hsdp_replicas_must_divide_the_ranks() -> None:
    assert _replicas("auto", 16, 8) == 2 and _replicas(2, 4, 4) == 2 and _replicas(3, 1, 1) == 1
    for bad in (3, 0, "two", True):
        with pytest.raises(ConfigError, match="must divide the 4 ranks"):
            _replicas(bad, 4, 4)
