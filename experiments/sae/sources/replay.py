"""A forward's prefix, recorded once and replayed: an end-to-end coder's step runs the frozen model twice on one batch
(clean, then with the coder spliced in), and both passes are the same up to the module the splice replaces. The clean
pass records the outputs of the outermost modules that complete up to that one (the embedding, the earlier blocks,
and the module itself); the spliced pass takes them back instead of computing them again. In eval mode a module's
output depends only on its inputs, which are the same in both passes up to there, so the replayed values are the ones
the spliced pass would compute (tests/unit/test_end_to_end.py compares both). The spliced pass's hooks still run around
a replayed module (a transcoder's read of its input)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from runner import ConfigError


class Prefix:
    """The outputs, in call order, of the outermost modules that completed up to module `until` in one forward."""

    def __init__(self, model: nn.Module, until: str) -> None:
        self.model, self.until = model, until
        self.outputs: dict[str, list[Any]] = {}  # module name -> its outputs, in call order (a module may run twice)


@contextlib.contextmanager
def recording(model: nn.Module, until: str) -> Iterator[Prefix]:
    """Within: a forward of `model` records its Prefix up to module `until` (inclusive)."""
    prefix, done = Prefix(model, until), []  # `done`: whether `until` has completed

    def record(name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, out: Any) -> None:
            if not done:
                prefix.outputs.setdefault(name, []).append(out)
                done.extend([True] if name == until else [])

        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules() if name]
    try:
        yield prefix
    finally:
        for handle in handles:
            handle.remove()
    if not done:  # `until` never ran: nothing is known to be the same in both passes
        prefix.outputs.clear()
    # the outermost of them: a module whose parent also completed is replayed with its parent
    names = set(prefix.outputs)
    for name in list(prefix.outputs):
        parts = name.split(".")
        if any(".".join(parts[:i]) in names for i in range(1, len(parts))):
            del prefix.outputs[name]


@contextlib.contextmanager
def replaying(prefix: Prefix) -> Iterator[None]:
    """Within: the next forward of the model takes the Prefix's modules' outputs from the record, in order."""
    modules = dict(prefix.model.named_modules())
    queues = {name: iter(outputs) for name, outputs in prefix.outputs.items()}

    def replay(name: str) -> Any:
        def forward(*_args: Any, **_kwargs: Any) -> Any:
            try:
                return next(queues[name])
            except StopIteration:
                raise ConfigError(
                    f"{name} ran more often in the spliced forward than in the clean one: its forward depends on "
                    "more than its inputs, so the clean pass's prefix cannot be replayed for it"
                ) from None

        return forward

    for name in queues:
        modules[name].forward = replay(name)  # an instance attribute: nn.Module.__call__ (and its hooks) call it
    try:
        yield
    finally:
        for name in queues:
            del modules[name].forward
