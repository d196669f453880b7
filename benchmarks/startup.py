"""Startup: launch to the end of the first optimizer step, and the whole process, runner against a hand-written script.

    python benchmarks/startup.py [--device cpu|cuda] [--reps 5] [--steps 20] [--json out.json]

Contenders, each a fresh process, repetitions interleaved (the order rotates):
  hand          overhead.py's hand-written loop as a script: import torch, build data, model and AdamW, train
  runner        python -m runner on the same model and data (no loggers)
  runner_usual  the same with its usual loggers (console and metrics.jsonl)
  imports       what runner imports beyond torch (hydra, omegaconf, rich, safetensors, runner), timed alone
  compose       Hydra composing runner's config in memory (compose API), timed alone
hand and runner train on --device (default: cuda when present; on CUDA the first step's end is read after
torch.cuda.synchronize(), so it includes starting CUDA). Reports launch -> end of step 1, whole-process wall time,
peak RSS (and peak GPU memory on CUDA), medians with half the spread; `imports` and `compose` show what Hydra itself
adds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    ROOT,
    default_device,
    device_name,
    machine,
    median_gpu_mb,
    mib,
    runner_command,
    spawn,
    summary,
    write_json,
)

CONTENDERS = ("hand", "runner", "runner_usual", "imports", "compose")


def imports(out: str) -> None:
    """Time the modules runner adds to a torch script (torch itself is imported first, untimed)."""
    import torch  # noqa: F401

    started = time.perf_counter()
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401

    hydra_done = time.perf_counter()
    import rich.console  # noqa: F401
    import safetensors.torch  # noqa: F401

    import runner.build  # noqa: F401
    import runner.log.console  # noqa: F401
    import runner.train  # noqa: F401

    Path(out).write_text(json.dumps({"hydra_s": hydra_done - started, "all_s": time.perf_counter() - started}))


def compose(out: str) -> None:
    """Time Hydra's composition of the benchmark run's config (what @hydra.main does before calling main)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    started = time.perf_counter()
    with initialize_config_dir(str(ROOT / "runner" / "conf"), version_base="1.3"):
        hydra_compose(
            "config", [f"hydra.searchpath=[file://{ROOT / 'benchmarks' / 'conf'}]", "+experiment=bench", "bench.out=x"]
        )
    Path(out).write_text(json.dumps({"compose_s": time.perf_counter() - started}))


def measure(contender: str, steps: int, tmp: Path, device: str) -> dict:
    """One fresh process of `contender`."""
    # a folder of its own each time: runner refuses to start a new run in a folder that holds one
    out, run_dir = tmp / f"{contender}.json", Path(tempfile.mkdtemp(dir=tmp, prefix=f"{contender}-run-")) / "run"
    if contender.startswith("runner"):
        extra = ["logger=default"] if contender == "runner_usual" else []
        command = runner_command("tiny", steps, 1, out, run_dir, *extra, device=device)
    elif contender == "hand":
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "overhead.py"),
            "--worker",
            "hand",
            "--size",
            "tiny",
            "--steps",
            str(steps),
            "--warmup",
            "1",
            "--out",
            str(out),
            "--device",
            device,
        ]
    else:
        command = [sys.executable, __file__, "--worker", contender, "--out", str(out)]
    return spawn(command, out, log=tmp / f"{contender}.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=["imports", "compose"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return {"imports": imports, "compose": compose}[args.worker](args.out)

    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for contender in CONTENDERS[rep % len(CONTENDERS) :] + CONTENDERS[: rep % len(CONTENDERS)]:
                runs[contender].append(measure(contender, args.steps, Path(tmp), args.device))
    results = {
        "machine": machine(),
        "device": device_name(args.device),
        "steps": args.steps,
        "reps": args.reps,
        "contenders": {},
    }
    for contender in ("hand", "runner", "runner_usual"):
        reps = runs[contender]
        results["contenders"][contender] = {
            "to_first_step_s": summary([r["to_first_step_s"] for r in reps]),
            "wall_s": summary([r["wall_s"] for r in reps]),
            "peak_rss_mb": summary([r["peak_rss_mb"] for r in reps]),
            "peak_gpu_mb": median_gpu_mb(reps),
            # paired with the hand-written script of the same repetition
            "first_step_minus_hand_s": summary(
                [r["to_first_step_s"] - h["to_first_step_s"] for r, h in zip(reps, runs["hand"], strict=True)]
            ),
        }
    for key, contender in (("hydra_s", "imports"), ("all_s", "imports"), ("compose_s", "compose")):
        results[f"{contender}_{key}"] = summary([r[key] for r in runs[contender]])
    report(results)
    write_json(args.json, results)


def report(results: dict) -> None:
    """Print the table."""
    print(
        f"# startup on {results['device']} ({results['machine']}), {results['reps']} fresh processes each, "
        f"{results['steps']} steps"
    )
    print(f"{'contender':<13} {'to 1st step s':>15} {'- hand s':>15} {'process s':>14} {'RSS MiB':>8} {'GPU MiB':>8}")
    for name, row in results["contenders"].items():
        t, d, w = row["to_first_step_s"], row["first_step_minus_hand_s"], row["wall_s"]
        rss, gpu = row["peak_rss_mb"]["median"], mib(row["peak_gpu_mb"])
        print(
            f"{name:<13} {t['median']:>8.3f} ±{t['spread']:<5.3f} {d['median']:>+8.3f} ±{d['spread']:<5.3f}"
            f" {w['median']:>7.3f} ±{w['spread']:<5.3f} {rss:>8.0f} {gpu:>8}"
        )
    print(
        f"importing hydra + omegaconf after torch: {results['imports_hydra_s']['median']:.3f} s; with rich, "
        f"safetensors and runner: {results['imports_all_s']['median']:.3f} s; composing the config: "
        f"{results['compose_compose_s']['median']:.3f} s"
    )


if __name__ == "__main__":
    main()
