"""What `optimizer.fused: null` gains on the CPU, where null picks the fused kernel: each preset that steps torch's
Adam or AdamW without setting `fused` (digits, lm) trained by `python -m runner` as it comes and with
`optimizer.fused=false` (torch's default there: a for-loop over the tensors, what a hand-written loop gets).

    python benchmarks/fused.py [--reps 5] [--only digits,lm] [--steps N] [--json out.json]

Each run is a whole process, the two settings in turn (A B A B ...) so that drift hits them alike. Reports each
setting's median steady-state samples/s (summary.json's `steady`: the log windows after the first) and the median of
the paired ratios fused / for-loop. The final losses differ in the last digits (the kernels round otherwise): printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name: (overrides, optimizer steps)
WORKLOADS = {
    "digits": (["+experiment=digits", "callbacks=none"], 600),
    "lm": (["+experiment=lm", "callbacks=none"], 60),
}
SETTINGS = {"fused (default)": [], "for-loop (fused=false)": ["optimizer.fused=false"]}


def _run(workload: list[str], steps: int, extra: list[str], folder: Path) -> dict:
    command = [sys.executable, "-m", "runner", *workload, *extra, f"trainer.max_duration={steps}st"]
    command += [f"hydra.run.dir={folder}", "logger=none", "checkpoint=none", "distributed.device=cpu"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "WANDB_MODE": "offline"})
    summary = json.loads((folder / "summary.json").read_text())
    return {"samples_per_s": summary["steady"]["samples_per_s"], "loss": summary["metrics"].get("train/loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", help="comma-separated workloads: digits, lm")
    # the CPU's question (on CUDA `fused: null` was fused before): --device exists so that every script takes it
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--steps", type=int, help="optimizer steps of each run (default: digits 600, lm 60)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    results: dict = {"machine": machine(), "device": device_name(args.device), "workloads": {}}
    print(f"# optimizer.fused on the CPU ({results['machine']})")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            (workload, steps), runs = WORKLOADS[name], {s: [] for s in SETTINGS}
            for _ in range(args.reps):
                for setting, extra in SETTINGS.items():
                    folder = Path(tmp) / f"{name}-{len(runs[setting])}-{'fused' if not extra else 'loop'}"
                    runs[setting].append(_run(workload, args.steps or steps, extra, folder))
            fused, loop = (runs[s] for s in SETTINGS)
            ratios = [f["samples_per_s"] / g["samples_per_s"] for f, g in zip(fused, loop, strict=True)]
            row: dict = {}
            for s, reps in runs.items():
                speeds = [r["samples_per_s"] for r in reps]
                row[s] = {"samples_per_s": statistics.median(speeds), "loss": reps[-1]["loss"]}
            row["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            results["workloads"][name] = row
            cells = "  ".join(f"{s} {row[s]['samples_per_s']:7.0f}/s (loss {row[s]['loss']:.6f})" for s in SETTINGS)
            ratio = row["ratio"]
            print(f"{name:<7} {cells}  fused / for-loop {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
