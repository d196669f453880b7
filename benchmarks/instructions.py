"""Instructions per step of overhead.py's contenders on the CPU, counted by valgrind: a figure this shared, noisy
machine cannot move (its clock varies by +-30% between processes; a count does not), for a loop's overhead of a few
percent.

    python benchmarks/instructions.py [--contenders hand hand_default runner] [--size tiny] [--steps 200 1200]

Each contender runs as overhead.py runs it (the same command lines, one thread) under `valgrind --tool=cachegrind
--cache-sim=no` twice, for a short and a long run; the difference of the two counts over the difference of their
steps is the instructions of one steady-state step, start-up cancelled. The processes run side by side (a count does
not depend on what else runs). Needs valgrind (Debian: apt-get install valgrind). Instructions are not time (a cache
miss costs more than an add), but on a step this small the two move together: overhead.py's clock gives the time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SIZES, machine, spawn, write_json  # noqa: E402
from benchmarks.overhead import CONTENDERS, GRAPHS, contender_command  # noqa: E402

VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]


def count(contender: str, size: str, steps: int, tmp: Path) -> int:
    """Instructions of one whole process of `contender` training `steps` steps (10 of them warm-up)."""
    command, out = contender_command(contender, size, steps, 10, tmp, "cpu")
    log = out.with_suffix(".log")
    spawn([*VALGRIND, *command], out, log=log)
    return int(re.search(r"I\s+refs:\s+([\d,]+)", log.read_text()).group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    choices = [c for c in CONTENDERS if c not in GRAPHS and not c.startswith("lightning")]
    parser.add_argument("--contenders", nargs="+", default=["hand", "hand_default", "runner"], choices=choices)
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--steps", nargs=2, type=int, default=[200, 1200], metavar=("SHORT", "LONG"))
    parser.add_argument("--device", default="cpu", choices=["cpu"], help="valgrind runs the CPU only")
    parser.add_argument("--json")
    args = parser.parse_args()
    if "hand" not in args.contenders:
        parser.error("--contenders needs hand: every ratio is to it")
    if shutil.which("valgrind") is None:
        parser.exit(2, "valgrind is not installed (Debian: apt-get install valgrind)\n")
    short, long = sorted(args.steps)
    jobs = [(c, n) for c in args.contenders for n in (short, long)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(jobs)) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(job[0], args.size, job[1], Path(tmp)), jobs), strict=True))
    per_step = {c: (counts[c, long] - counts[c, short]) / (long - short) for c in args.contenders}
    results = {"machine": machine(), "device": "cpu", "size": args.size, "steps": [short, long], "contenders": {}}
    print(f"# instructions per step on the CPU, {args.size} ({results['machine']})")
    print(f"{'contender':<14} {'instructions/step':>18} {'x hand':>8}")
    for name, value in per_step.items():
        results["contenders"][name] = {"instructions_per_step": value, "ratio_to_hand": value / per_step["hand"]}
        print(f"{name:<14} {value:>18,.0f} {value / per_step['hand']:>8.3f}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
