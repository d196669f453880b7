"""A model whose weights are all read from a file next is built with its parameters on the meta device where they are
read into FSDP2's shards (runner.ckpt.sliced.built, materialize): a sharded source's model and an FSDP init_from. No
rank computes a whole parameter, its buffers are the constructor's, ties stay ties; and no such build moves the
caller's random stream, sharded or not. The ranks are torch's fake process group (no communication), as in
test_sharded_load.py."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LM
from omegaconf import DictConfig
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.sae.sources.sharded import shard_model
from runner.build import _task
from runner.ckpt.sliced import built
from runner.distributed.strategies import Single
from runner.load import load_trained, sharded_loads

register_parameter = nn.Module.register_parameter  # as torch defines it


@pytest.fixture(params=[(0, 2), (1, 3)], ids=["rank0of2", "rank1of3"])
def rank(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """This process as one rank of several (collectives do nothing: rank 1 is told rank 0's check passed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=request.param[0], world_size=request.param[1], store=FakeStore())
    if request.param[0]:
        monkeypatch.setattr(dist, "broadcast_object_list", lambda out, src: out.__setitem__(0, ("ok", None)))
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


class _WholeComputed(TorchDispatchMode):
    # the ops that give a tensor with storage (no meta tensor, no DTensor: its local shard is seen below it) of a
    # whole parameter's shape, but for the allocation that a module's constructor makes and never fills (torch.empty)
    # and views of it (its Parameter, before it goes to the meta device)
    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.found = shapes, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta or isinstance(tensor, DTensor):
                continue
            if tuple(tensor.shape) in self.shapes and not (func.is_view or func is torch.ops.aten.empty.memory_format):
                self.found.append((str(func), tuple(tensor.shape)))
        return out


def test_a_sharded_source_model_is_built_empty_and_holds_the_file_s_weights(
    lm_run: Path, rank: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, _ = load_trained(lm_run)  # as every rank built it whole: the reference
    file = load_file(lm_run / "model.safetensors")
    import torch.distributed.fsdp as fsdp

    devices: list[set[str]] = []
    shard = fsdp.fully_shard
    monkeypatch.setattr(
        fsdp, "fully_shard", lambda m, **k: devices.append({p.device.type for p in m.parameters()}) or shard(m, **k)
    )
    stream = torch.random.get_rng_state()
    shapes = {tuple(p.shape) for p in whole.parameters() if p.ndim == 2}
    shards = {(len(torch.empty(rows).chunk(rank[1])[rank[0]]), *rest) for rows, *rest in shapes}
    mode = _WholeComputed(shapes - shards)  # a shard of one may have the shape of another whole: not told apart
    with sharded_loads(lambda model: shard_model(model, torch.device("cpu"))), mode:
        model, _ = load_trained(lm_run)
    assert mode.found == [], sorted(set(mode.found))  # no parameter initialised, copied or read whole
    assert devices and all(kinds == {"meta"} for kinds in devices)  # sharded before any storage
    assert torch.equal(torch.random.get_rng_state(), stream)
    assert model.head.weight is model.embed.weight  # tied: one Parameter, one group
    assert torch.equal(model.rope, whole.rope)  # a non-persistent buffer: the constructor's
    at, world = rank
    for name, tensor in model.state_dict().items():
        local = tensor.to_local()
        assert local.device.type == "cpu" and torch.equal(local, file[name].chunk(world)[at]), name


def test_a_model_without_storage_is_built_whole_where_its_constructor_needs_its_values() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))
            self.register_buffer("scale", self.weight.abs().max().reshape(1) * float(self.weight.sum().item()))

    model = built(Scaled, torch.device("cpu"), empty=True)
    assert not model.weight.is_meta and torch.isfinite(model.scale).all()


def test_a_model_another_thread_builds_meanwhile_gets_real_parameters() -> None:
    inside, other_built = threading.Event(), threading.Event()

    class Waits(nn.Module):  # builds its parameter on meta, then holds the meta build open for the other thread
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, 2))
            inside.set()
            assert other_built.wait(10)

    meanwhile: list[nn.Module] = []

    def other() -> None:
        assert inside.wait(10)
        meanwhile.append(nn.Linear(3, 3))
        other_built.set()

    thread = threading.Thread(target=other)
    thread.start()
    model = built(Waits, torch.device("cpu"), empty=True)
    thread.join()
    assert model.weight.is_meta
    assert not meanwhile[0].weight.is_meta and torch.isfinite(meanwhile[0].weight).all()
    assert nn.Module.register_parameter is register_parameter  # put back once no build is open
    after = nn.Linear(2, 2)
    assert not after.weight.is_meta


def _cfg(compose_cfg: Callable[..., DictConfig], lm_run: Path, *overrides: str) -> DictConfig:
    return compose_cfg(*TINY_LM, f"init_from={lm_run / 'model.safetensors'}", *overrides)


def _fsdp_like(reads: list[str]) -> Any:
    # what build._task asks of FSDP over several ranks: it builds empty where init_from is strict, and reads later
    return types.SimpleNamespace(
        device=torch.device("cpu"),
        is_main=True,
        model_args={},
        empty_init=lambda strict: strict,
        init_from=lambda task, path, strict, say: reads.append(path),
    )


def test_an_fsdp_init_from_builds_the_task_empty_with_the_constructor_s_buffers(
    compose_cfg: Callable[..., DictConfig], lm_run: Path
) -> None:
    reads: list[str] = []
    whole, _ = load_trained(lm_run)
    task = _task(_cfg(compose_cfg, lm_run), None, _fsdp_like(reads))
    assert reads and all(p.is_meta for p in task.parameters())
    assert task.head.weight is task.embed.weight
    assert not task.rope.is_meta and torch.equal(task.rope, whole.rope)
    # init_strict=false: a parameter the file lacks keeps its random init, so every one is built with storage
    task = _task(_cfg(compose_cfg, lm_run, "init_strict=false"), None, _fsdp_like(reads))
    assert not any(p.is_meta for p in task.parameters()) and task.head.weight is task.embed.weight


@pytest.mark.parametrize("init_from", [True, False], ids=["init_from", "random_init"])
def test_a_task_built_for_init_from_leaves_the_random_stream_as_it_was(
    compose_cfg: Callable[..., DictConfig], lm_run: Path, init_from: bool
) -> None:
    cfg = _cfg(compose_cfg, lm_run) if init_from else compose_cfg(*TINY_LM)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    task = _task(cfg, None, Single("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before) == init_from  # a random init draws from it
    if init_from:
        assert torch.equal(task.embed.weight, load_file(lm_run / "model.safetensors")["embed.weight"])


def test_a_replicated_source_model_leaves_the_random_stream_as_it_was(lm_run: Path) -> None:
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    model, _ = load_trained(lm_run)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert not any(p.is_meta for p in model.parameters())
