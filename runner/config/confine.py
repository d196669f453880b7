"""What a run folder rebuilt from elsewhere may not decide for itself: the trust its sources read with, and where it
writes (caches go nowhere, or to a scratch folder of this process's own; a hub model is read from the hub's cache)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any


def _scratch() -> str:
    # A rebuilt run's text caches (text_bytes' encoded corpus, a transformers source's tokens) go to a folder of this
    # process's own, removed when it ends: a run folder's config names what it reads, never where runner writes (its
    # paths could name every readable file, copied into ~/.cache/runner)
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="runner-rebuilt-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return _SCRATCH[0]


_SCRATCH: list[str] = []
# A transformers source a run folder names on the hub (checkpoint: hf:NAME) is read from the hub's cache alone: its
# name is the folder's word, and a request for it would tell whoever wrote the folder that it was opened (or fetch
# their model)
HUB, HUB_CACHED = "hf:", "hf-cache:"


def _cached(checkpoint: Any) -> Any:
    return (
        HUB_CACHED + checkpoint[len(HUB) :]
        if isinstance(checkpoint, str) and checkpoint.startswith(HUB)
        else checkpoint
    )


# Each key a rebuilt run's config may not decide for itself -> (its value, the reader's trust) -> what is used instead
CONFINED = {
    "trusted_targets": lambda _, trusted: list(trusted),
    "cache": lambda *_: None,
    "cache_dir": lambda *_: _scratch(),
    "checkpoint": lambda value, _: _cached(value),
}


def confined(node: Any, trusted: Sequence[str]) -> Any:
    # A component that reads another run folder (an SAE's source: its data options, SpliceEval) takes the reader's
    # trust, never the one this folder's config gives it: else a folder could name a run whose torch.load it trusts
    # itself. And a rebuilt run writes no cache where its config says (a folder of anybody's choosing): an activation
    # cache holds training rows, which a rebuilt run does not read; text caches go to a scratch folder (_scratch), and a
    # hub name to the hub's cache alone (CONFINED).
    if isinstance(node, dict):
        if isinstance(node.get("inputs"), dict):  # a transformers source's text: its token cache, when it names none
            node = {**node, "inputs": {"cache_dir": None, **node["inputs"]}}
        return {k: CONFINED[k](v, trusted) if k in CONFINED else confined(v, trusted) for k, v in node.items()}
    if isinstance(node, list):
        return [confined(value, trusted) for value in node]
    return node
