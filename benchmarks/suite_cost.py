"""What a test tier costs in processes and CPU time: every Python process it starts (runs, torchrun's launchers and
ranks, scripts, loader workers), what each one spent, grouped by the pytest module whose folder it ran in.

    python benchmarks/suite_cost.py [--json out.json] [--top 25] -- PYTEST_ARGS...   (e.g. -- tests/e2e)

On a machine whose cores the tier keeps full, its wall time is its CPU time over the cores: the CPU seconds are what
a change to the tests must lower, where the wall times of jobs that share the cores only say how crowded they were.
Each process writes one line at exit (a `sitecustomize` on PYTHONPATH, which the tests pass on to their children):
its user + system CPU seconds (its own, not its children's), its pid and parent's, its folder and command. A process
killed by a signal (a test that kills a rank as the OOM killer would) writes nothing: the counts are a floor.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# at exit, and in os._exit (runner's ranks leave through it), append this process's line to $RUNNER_SUITE_COST
HOOK = """
import atexit, json, os, resource, sys

def _line():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row = [usage.ru_utime + usage.ru_stime, os.getpid(), os.getppid(), os.getcwd(), sys.argv]
    with open(os.environ["RUNNER_SUITE_COST"], "a") as log:
        log.write(json.dumps(row) + "\\n")

def _exit(code, _real=os._exit):
    _line()
    _real(code)

if os.environ.get("RUNNER_SUITE_COST"):
    atexit.register(_line)
    os._exit = _exit
"""
FOLDER = re.compile(r"/pytest-\d+/(?:popen-gw\d+/)?([^/]+?)\d*(?:/|$)")  # tmp_path_factory's folder: the module's


def kind(argv: list[str]) -> str:
    """What a process was: pytest, torchrun's launcher, a runner CLI or rank, a benchmark script, or other."""
    if argv and "pytest" in argv[0]:
        return "pytest"
    if argv and argv[0].endswith("torch/distributed/run.py"):
        return "torchrun launcher"
    if argv and argv[0].endswith("runner/__main__.py"):
        return "runner"
    if argv and "/benchmarks/" in argv[0]:
        return f"benchmarks/{Path(argv[0]).name}"
    return Path(argv[0]).name if argv and argv[0] not in ("", "-c") else "python -c"


def summarise(rows: list[list[Any]], top: int) -> dict[str, Any]:
    """Totals, and the processes grouped by kind and by the test module whose temporary folder they ran in."""
    by_pid = {row[1]: row for row in rows}

    def group(row: list[Any]) -> str:
        # the folder of the process, else of its nearest ancestor that ran in a test's folder
        while row is not None:
            found = FOLDER.search(row[3] + "/")
            if found:
                return found.group(1)
            row = by_pid.get(row[2])
        return "(outside a test folder)"

    totals: dict[str, dict[str, Any]] = {"kind": {}, "folder": {}}
    for name, key in (("kind", lambda row: kind(row[4])), ("folder", group)):
        counts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for row in rows:
            counts[key(row)][0] += row[0]
            counts[key(row)][1] += 1
        ordered = sorted(counts.items(), key=lambda item: -item[1][0])[:top]
        totals[name] = {k: {"cpu_s": round(c, 1), "processes": n} for k, (c, n) in ordered}
    cpu = sorted(row[0] for row in rows)
    return {
        "processes": len(rows),
        "cpu_s": round(sum(cpu), 1),
        "median_process_cpu_s": round(cpu[len(cpu) // 2], 2) if cpu else 0.0,
        **totals,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("pytest_args", nargs="+", help="what follows `--`: pytest's arguments")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "sitecustomize.py").write_text(HOOK)
        log = Path(folder) / "processes.jsonl"
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "RUNNER_SUITE_COST": str(log)}
        code = subprocess.run([sys.executable, "-m", "pytest", *args.pytest_args], cwd=ROOT, env=env).returncode
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    result = {"pytest": args.pytest_args, "exit_code": code, **summarise(rows, args.top)}
    print(f"\n{result['processes']} processes, {result['cpu_s']:.0f} CPU s (median {result['median_process_cpu_s']} s)")
    for name in ("kind", "folder"):
        print(f"\nby {name}:")
        for key, row in result[name].items():
            print(f"  {row['cpu_s']:8.1f} s {row['processes']:5d}  {key}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
