"""What a transformers model folder may ask of runner: nothing that runs code of its own. Its config.json and
tokenizer_config.json are read as plain JSON before transformers sees them, and refused when they ask for the model's
own code (`auto_map`) or name a model_type transformers does not implement; transformers' loads then run with standard
input closed (no_prompt), so no "run the custom code? [y/N]" prompt can be answered yes. A model folder is data."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from runner import ConfigError

T = TypeVar("T")


def loaded(load: Callable[[], T], failed: str, fix: str) -> T:
    """What transformers' `load()` returns, with standard input closed (no_prompt); its OSError or ValueError as one
    ConfigError: `failed` (what could not be loaded), the error's first line, then `fix`."""
    try:
        with no_prompt():
            return load()
    except (OSError, ValueError) as error:
        raise ConfigError(f"{failed} ({first_line(error)}). {fix}") from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def refuse_own_code(name: str, hub: bool, what: str, offline: bool = False) -> tuple[Path, str | None]:
    """The folder holding `name`'s config.json and the hub commit it was read at, or a ConfigError if it needs code
    of its own; `offline`: a hub name's files from the hub's cache alone."""
    # (a hub name's folder: its cache snapshot.) Checked before transformers sees them: it would otherwise import the
    # folder's .py files (auto_map), or go looking for them (a model_type it does not implement).
    from transformers import __version__  # noqa: PLC0415 - an optional extra
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: PLC0415

    refused = (
        "models that need their own code (trust_remote_code) are refused: a model folder is data, and runner never "
        "runs the .py files in it"
    )
    config_file, tokenizer_file, revision = _config_files(name, hub, what, offline)
    config = _json_object(config_file, what)
    for file in (config_file, tokenizer_file):
        found = config if file is config_file else _json_object(file, what) if file else {}
        if "auto_map" in found:
            raise ConfigError(
                f"{what}: {file.name} has auto_map ({json.dumps(found['auto_map'])}), which asks transformers to "
                f"import code shipped with the model; {refused}. Use a model that transformers implements itself, "
                "or one saved again by save_pretrained from a transformers class"
            )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"{what}: config.json has model_type={model_type!r}, which transformers {__version__} does not implement "
            f"itself; {refused}. A newer transformers may know it (pip install -U transformers); a folder written by "
            "save_pretrained from a transformers class names its own type"
        )
    return config_file.parent, revision


def _config_files(name: str, hub: bool, what: str, offline: bool) -> tuple[Path, Path | None, str | None]:
    # (config.json, tokenizer_config.json or None, the hub commit they were read at): a folder's own files, or a hub
    # name's from the network or the hub's cache, both at one commit
    if not hub:
        tokenizer = Path(name) / "tokenizer_config.json"
        return Path(name) / "config.json", tokenizer if tokenizer.is_file() else None, None
    from transformers.utils.hub import cached_file, extract_commit_hash  # noqa: PLC0415 - an optional extra

    try:
        config = cached_file(name, "config.json", local_files_only=offline)
        revision = extract_commit_hash(config, None)
        # a repository without a tokenizer_config.json gives None (the flag is transformers' own, private spelling)
        tokenizer = cached_file(
            name,
            "tokenizer_config.json",
            revision=revision,
            local_files_only=offline,
            _raise_exceptions_for_missing_entries=False,
        )
    except (OSError, ValueError) as error:
        fix = (
            "a hub model that a run folder names is read from the hub's cache alone, never fetched on the folder's "
            "word: fetch it once yourself (source.checkpoint=hf:NAME in a run of your own), or name a folder"
            if offline
            else "hf:NAME needs network or the hub's cache (HF_HOME), and a hub name; or name a folder written by "
            "save_pretrained"
        )
        raise ConfigError(f"{what}: its config cannot be fetched from the hub ({first_line(error)}): {fix}") from None
    return Path(config), Path(tokenizer) if tokenizer else None, revision


def _json_object(path: Path, what: str) -> dict[str, Any]:
    # a model's JSON file, as data
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(
            f"{what}: {path} cannot be read as JSON ({first_line(error)}); write the folder again with save_pretrained"
        ) from None
    if not isinstance(found, dict):
        raise ConfigError(
            f"{what}: {path} holds {type(found).__name__}, not a JSON object; write it again with save_pretrained"
        )
    return found


@contextlib.contextmanager
def no_prompt() -> Iterator[None]:
    """Standard input closed while transformers loads: its "run the custom code? [y/N]" prompt gets no answer."""
    # Belt and braces beside trust_remote_code=False, for a transformers version that would still ask: input() is
    # replaced too, as a caller (or a test) may have replaced it with something that answers. The prompt's own
    # `except Exception` turns the EOFError into transformers' ValueError, "pass trust_remote_code=True".
    stdin, ask = sys.stdin, builtins.input
    sys.stdin, builtins.input = io.StringIO(), _no_answer
    try:
        yield
    finally:
        sys.stdin, builtins.input = stdin, ask


def _no_answer(prompt: object = "") -> str:
    raise EOFError("standard input is closed while a model loads: runner never runs a model's own code")
