"""The README's quality figures (and its docs/ pages'), checked against what the code gives: every command they quote
a result of is run (one after another, each in a fresh run folder) and each quoted figure is compared with the run's
own, at the README's precision. Times are left out: they are the machine's, not the code's.

    python benchmarks/readme_figures.py [--only digits,sae] [--threads N] [--dir DIR] [--json out.json]

Exit 0 when every figure agrees; 1, with the differing ones marked, when any differs (fix the code or the README);
2 when a command fails or the README no longer holds a figure this script looks for (then update FIGURES).

What is checked (FIGURES): the digits headline (val/acc, the best val/loss and its step, where early stopping stopped;
the Optuna section's "preset's" val/loss) and the test split's accuracy; and every row of the synthetic SAE table
(MMCS, features recovered at cosine 0.9 / 0.95, FVE, L0, silent fraction), each row's own command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

Figure = Callable[[dict[str, Any]], float]


def _metric(key: str) -> Figure:
    return lambda run: run["summary"]["metrics"][key]


def _percent(key: str) -> Figure:
    return lambda run: 100 * run["summary"]["metrics"][key]


DIGITS = "python -m runner +experiment=digits"
N = r"(\d+(?:\.\d+)?)"  # a figure: 0.9777, 675 (not the full stop after it)
# name: (the command, [(a README pattern whose groups are figures, what each group is)]); the README's text is read
# with its line breaks as spaces
FIGURES: dict[str, tuple[str, list[tuple[str, list[Figure]]]]] = {
    "digits": (
        DIGITS,
        [
            (
                rf"`python -m runner \+experiment=digits` reaches \*\*val/acc {N}\*\* \(best val/loss {N} at "
                r"step (\d+); early stopping at step (\d+), epoch (\d+)[;)]",
                [
                    _metric("val/acc"),
                    lambda run: run["summary"]["best"]["value"],
                    lambda run: run["summary"]["best"]["step"],
                    lambda run: run["summary"]["progress"]["step"],
                    lambda run: run["summary"]["progress"]["epoch"],
                ],
            ),
            (rf"512\) against the preset's {N}", [lambda run: run["summary"]["best"]["value"]]),
            (
                rf"the default run scores test/acc {N} \(val/acc {N}\)",
                [lambda run: run["test"]["test/acc"], _metric("val/acc")],
            ),
        ],
    ),
}
# The synthetic SAE table: each row's command is run, and its columns checked
SAE_COMMAND = r"\| `(python -m runner \+experiment=sae[^`]*)`"
SAE_CELLS = rf"[^|]*\| \*\*{N}\*\* \| {N}% / {N}% \| {N} \| {N} \| {N} \|"
SAE_COLUMNS: list[Figure] = [
    _metric("val/mmcs"),
    _percent("val/recovered_0.9"),
    _percent("val/recovered_0.95"),
    _metric("val/fve"),
    _metric("val/l0"),
    _metric("val/silent_fraction"),
]


def readme_text() -> str:
    """The README and the docs/ pages it links, with line breaks as spaces (a figure's sentence may wrap): a figure is
    checked on whichever page quotes it."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    return " ".join(" ".join(page.read_text().split()) for page in pages)


def checks(text: str, only: set[str] | None) -> dict[str, tuple[str, list[tuple[str, list[Figure]]]]]:
    """The commands to run and the figures each must give: FIGURES and one per row of the SAE table."""
    found = dict(FIGURES)
    for match in re.finditer(SAE_COMMAND + SAE_CELLS, text):
        command = match.group(1)
        row = re.escape(f"| `{command}`") + SAE_CELLS
        found[f"sae: {command.removeprefix('python -m runner ')}"] = (command, [(row, SAE_COLUMNS)])
    if not any(name.startswith("sae") for name in found):
        raise LookupError("the README's SAE table: no row matches SAE_COMMAND + SAE_CELLS")
    return {n: c for n, c in found.items() if only is None or n.split(":")[0] in only}


def run(command: str, folder: Path, threads: int | None) -> dict[str, Any]:
    """Run one README command in `folder` (its run folder); its summary.json, and for digits its test split."""
    args = shlex.split(command)[1:] + [f"hydra.run.dir={folder}"]
    if threads and not any(a.startswith("threads=") for a in args):
        args.append(f"threads={threads}")
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stderr[-2000:]}")
    result = {"summary": json.loads((folder / "summary.json").read_text())}
    if command == DIGITS:
        evaluate = [sys.executable, "-m", "runner.evaluate", str(folder), "split=test"]
        subprocess.run(evaluate, cwd=ROOT, env=env, check=True, capture_output=True)
        result["test"] = json.loads((folder / "eval-test.json").read_text())["metrics"]
    return result


def _same(quoted: str, value: float) -> tuple[bool, str]:
    # the run's value at the README's precision
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    now = f"{value:.{decimals}f}"
    return now == quoted, now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated: digits, sae")
    parser.add_argument("--threads", type=int, help="threads=N for commands that set none")
    parser.add_argument("--dir", help="where the run folders go (default: a temporary folder)")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()
    text = readme_text()
    try:
        todo = checks(text, set(args.only.split(",")) if args.only else None)
    except LookupError as error:
        print(f"readme_figures: {error}", file=sys.stderr)
        return 2
    rows, missing = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        for i, (name, (command, patterns)) in enumerate(todo.items()):
            quoted = [(re.search(pattern, text), figures) for pattern, figures in patterns]
            missing += [f"{name}: {pattern}" for (m, _), (pattern, _) in zip(quoted, patterns, strict=True) if not m]
            if any(m is None for m, _ in quoted):
                continue
            try:
                result = run(command, root / f"{i:02d}", args.threads)
            except (RuntimeError, subprocess.CalledProcessError) as error:
                print(f"readme_figures: {error}", file=sys.stderr)
                return 2
            for match, figures in quoted:
                for readme, figure in zip(match.groups(), figures, strict=True):
                    same, now = _same(readme, float(figure(result)))
                    rows.append({"command": name, "readme": readme, "now": now, "same": same})
                    print(f"{'ok  ' if same else 'DIFF'} {name:<58} README {readme:>8}  now {now:>8}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": rows, "missing": missing}, indent=2))
    for pattern in missing:
        print(f"readme_figures: the README no longer holds {pattern}", file=sys.stderr)
    if missing:
        return 2
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
