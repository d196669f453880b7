"""Which thread setting loses least, on an idle machine and on one whose cores are busy with other work: runner's own
choice (`auto`: OpenMP's wait policy picked at start from the machine's load, runner/waits.py), threads that always
spin (OMP_WAIT_POLICY=ACTIVE), that always sleep at once (PASSIVE), and threads=1 (with PASSIVE).

    python benchmarks/threads.py [--reps 5] [--load N] [--only digits,sae,lm] [--json out.json]

Each workload is a whole `python -m runner` process (a README command, the SAE one shortened to 300 steps, the lm one
to 60), timed wall-clock, the settings in turn (A B C D A B C D ...) so that drift hits them alike; "loaded" runs the
same with `--load` busy processes (default: one per core) spinning beside it, as on a shared machine. Prints each
setting's median seconds and its ratio to the best setting of that row, and each setting's worst ratio over the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "digits": ["+experiment=digits"],
    "sae": ["+experiment=sae", "trainer.max_duration=300st"],
    "lm": ["+experiment=lm", "trainer.max_duration=60st", "logger=none", "callbacks=none"],
}
SETTINGS = {
    "auto": ({}, []),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "threads=1": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["threads=1"]),
}


def _timed(workload: list[str], setting: str, folder: Path) -> float:
    env_extra, args = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update(env_extra, WANDB_MODE="offline")
    command = [sys.executable, "-m", "runner", *workload, *args, f"hydra.run.dir={folder}", "checkpoint=none"]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def _load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)), help="busy processes when loaded")
    parser.add_argument("--only", help="comma-separated workloads: digits, sae, lm")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for condition in ("idle", "loaded"):
            busy = _load(args.load) if condition == "loaded" else []
            try:
                for name in names:
                    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
                    for rep in range(args.reps):
                        for setting in SETTINGS:
                            folder = Path(tmp) / f"{condition}-{name}-{setting}-{rep}".replace("=", "")
                            times[setting].append(_timed(WORKLOADS[name], setting, folder))
                    medians = {s: statistics.median(t) for s, t in times.items()}
                    best = min(medians.values())
                    results.setdefault(condition, {})[name] = medians
                    row = "  ".join(f"{s} {m:6.1f} s ({m / best:.2f}x)" for s, m in medians.items())
                    print(f"{condition:<7} {name:<7} {row}", flush=True)
            finally:
                for process in busy:
                    process.kill()
    worst = {s: max(results[c][n][s] / min(results[c][n].values()) for c in results for n in names) for s in SETTINGS}
    print("worst ratio to the best setting, over every row: " + ", ".join(f"{s} {w:.2f}x" for s, w in worst.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": len(os.sched_getaffinity(0)), **results, "worst": worst}))


if __name__ == "__main__":
    main()
