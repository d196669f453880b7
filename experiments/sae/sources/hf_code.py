"""What a transformers model folder may ask of runner: nothing that runs code of its own. Its config.json and
tokenizer_config.json are read as plain JSON before transformers sees them, and refused when they ask for the model's
own code (`auto_map`) or name a model_type transformers does not implement; transformers' loads then run with standard
input closed (no_prompt), so no "run the custom code? [y/N]" prompt can be answered yes. A model folder is data."""

from __future__ import annotations

import builtins
import contextlib
import inspect
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
    except (OSError, ValueError, ImportError) as error:  # ImportError: a backend package transformers lacks here
        raise ConfigError(f"{failed} ({first_line(error)}). {fix}") from None


@contextlib.contextmanager
def hub_offline(on: bool = True) -> Iterator[None]:
    """huggingface_hub's offline mode inside (when `on`): no request at all. local_files_only alone does not stop
    every one: transformers looks for an adapter with settings of its own, and the hub fetches an agent registry
    (writing it under HF_HOME) while it builds a request's headers."""
    from huggingface_hub import constants  # noqa: PLC0415 - an optional extra

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = was or on
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was


WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def model_weights(folder: Path, root: Path, what: str) -> list[Path]:
    """The files a model folder's weights load from (model.safetensors, else the shards its index names), each a
    file in it: a name in the index or a link that leads out of `root` (the folder; a hub snapshot's repository) is
    a ConfigError. None yet (a hub model not fetched): an empty list."""
    if (folder / WEIGHTS).exists() or (folder / WEIGHTS).is_symlink():
        names = [WEIGHTS]
    elif (folder / INDEX).is_file():
        mapping = _json_object(folder / INDEX, what).get("weight_map")
        names = sorted(set(mapping.values())) if isinstance(mapping, dict) else [None]
        if not names or not all(isinstance(n, str) and n == Path(n).name and n not in (".", "..") for n in names):
            raise ConfigError(
                f"{what}: {INDEX}'s weight_map names {names[:3]}: a sharded model's weights are files in its folder, "
                "named without a path; write it again with save_pretrained"
            )
    else:
        return []  # transformers says what is missing
    files = [folder / name for name in names]
    for file in files:
        real = file.resolve()
        if not real.is_file() or not real.is_relative_to(root.resolve()):
            raise ConfigError(
                f"{what}: {file} leads to {real}, which is not a file in the model's folder: a model folder is data, "
                "and its weights are files in it (copy them in)"
            )
    return files


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
    tokenizer = _json_object(tokenizer_file, what) if tokenizer_file else {}
    for file, found in ((config_file, config), (tokenizer_file, tokenizer)):
        if "auto_map" in found:
            raise ConfigError(
                f"{what}: {file.name} has auto_map ({json.dumps(found['auto_map'])}), which asks transformers to "
                f"import code shipped with the model; {refused}. Use a model that transformers implements itself, "
                "or one saved again by save_pretrained from a transformers class"
            )
    if (config_file.parent / "adapter_config.json").exists():
        raise ConfigError(
            f"{what}: the folder holds a peft adapter (adapter_config.json), which transformers would load onto a "
            "model the adapter names: give the folder of a whole model (merge the adapter and save_pretrained)"
        )
    attention = config.get("attn_implementation", config.get("_attn_implementation"))
    if attention not in (None, "eager", "sdpa", "flex_attention"):
        raise ConfigError(
            f"{what}: config.json asks for the attention implementation {attention!r}, which transformers may fetch "
            "from the hub as a kernel and run, and a model folder is data: remove it (runner uses transformers' "
            "default, sdpa or eager)"
        )
    if "quantization_config" in config:
        raise ConfigError(
            f"{what}: config.json holds a quantization_config, whose kernels transformers may fetch and run, and a "
            "model folder is data: save the model unquantized (save_pretrained after dequantizing) to use it"
        )
    for file, found in ((config_file, config), (tokenizer_file, tokenizer)):
        named = found.get("tokenizer_class")
        if named is not None and not _is_tokenizer(named):
            raise ConfigError(
                f"{what}: {file.name} names the tokenizer_class {named!r}, which is no tokenizer of transformers "
                f"{__version__}; {refused}"
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


def _is_tokenizer(name: Any) -> bool:
    # transformers finds a tokenizer_class by its name among its own attributes, whatever they are (a model class
    # loaded a second model as the "tokenizer"); only its tokenizer classes are
    import transformers  # noqa: PLC0415 - an optional extra

    try:
        found = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    except ImportError:  # a tokenizer whose backend package is not installed here: transformers says which
        return True
    return inspect.isclass(found) and issubclass(found, transformers.PreTrainedTokenizerBase)


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
