"""One convention for runner's tools (features, sae_eval, evaluate, generate, export, report, finetune,
init): KEY=VALUE, as the main command takes its overrides. `--key VALUE` and `--key=VALUE` are read the same way (a
dash in a key reads as an underscore: `--max-new-tokens 50` is `max_new_tokens=50`), and a bare `--flag` is a switch
(`--serve`). A user who guesses either spelling is understood by every tool."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection

from runner import ConfigError

HELP = ("-h", "--help", "help")  # what a user types for a tool's usage, argparse's spelling and the bare word


def help_asked(argv: list[str], doc: str) -> bool:
    """Whether `argv` asks only for help: if so the tool's `doc` (its module docstring: usage, options, exit codes) is
    printed to stdout, and the caller exits 0."""
    if len(argv) != 1 or argv[0] not in HELP:
        return False
    print(doc.strip())
    return True


def _known(key: str, keys: Collection[str]) -> bool:
    # a key ending in "." stands for every key under it (evaluate's data.KEY=VALUE)
    return key in keys or any(k.endswith(".") and key.startswith(k) for k in keys)


def key_values(argv: list[str], keys: Collection[str], switches: Collection[str] = ()) -> list[str]:
    """`argv` with every `--key VALUE` and `--key=VALUE` of `keys` written KEY=VALUE; `switches` (`--serve`) and
    anything else left as given, for the tool to accept or refuse."""
    out, args = [], iter(argv)
    for arg in args:
        name, sep, value = arg.removeprefix("--").partition("=")
        key = name.replace("-", "_")
        if not arg.startswith("--") or arg in switches or not _known(key, keys):
            out.append(arg)
            continue
        if not sep:
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value: give {arg} VALUE, or {key}=VALUE")
        out.append(f"{key}={value}")
    return out


def as_flags(argv: list[str], keys: Collection[str], switches: Collection[str] = ()) -> list[str]:
    """`argv` for an argparse tool: every KEY=VALUE of `keys` written `--key VALUE` (a list `[a,b]` as its items),
    and `switch=true` of `switches` as `--switch` (`=false`: left out). Dashes follow argparse's spelling; anything
    else is left for argparse to take or refuse."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.replace("-", "_")
        switch = key in switches and value.lower() in ("true", "false")
        if not sep or arg.startswith("-") or not (key in keys or switch):
            out.append(arg)  # argparse takes it or says what it does not know
        elif switch:
            out += [f"--{key.replace('_', '-')}"] if value.lower() == "true" else []
        else:
            items = value[1:-1].split(",") if value.startswith("[") and value.endswith("]") else [value]
            out += [f"--{key.replace('_', '-')}", *(item.strip() for item in items if item.strip())]
    return out


def task_tool(name: str) -> Callable[[list[str] | None], int]:
    """The `main` of the tool `python -m runner.NAME` that a task package registers (the `runner.tools` entry point
    group, pyproject.toml): the framework keeps the documented command and imports nothing of the task."""
    from importlib.metadata import entry_points

    for point in entry_points(group="runner.tools", name=name):
        return point.load()
    raise ConfigError(
        f"python -m runner.{name} is a task package's tool, and no installed package registers it: install the "
        "project (pip install -e .) so that its entry points are known"
    )


def run_task_tool(name: str, argv: list[str] | None = None) -> int:
    """Run the registered tool `name` on `argv`; exit 2 with one line if no installed package registers it."""
    try:
        tool = task_tool(name)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return tool(argv)
