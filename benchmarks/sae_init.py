"""The SAE recipe's initialisation, measured on a language model's activations: held-out FVE, dead fraction (latents
that never fire on the held-out windows) and silent fraction (silent through the last `dead_window` of training) of a
TopK SAE on the residual stream of the lm experiment's GPT, one variant of the recipe at a time.

    python benchmarks/sae_init.py [--lm RUN_DIR] [--seeds 0 1 2] [--dir DIR] [--json out.json] [--device cpu|cuda]
        [--rows 589824] [--batch 1024] [--layer 2] [--variants NAME ...] [SAE KEY=VALUE ...] [--lm-args KEY=VALUE ...]

Without --lm it first trains `python -m runner +experiment=lm` (~4.5 min on 2 cores). Every variant then trains as a
user would, `python -m runner +experiment=sae_lm` in a fresh process: blocks.2 of that GPT (d 128), 2048 latents,
k 32, AuxK 1/32, one epoch of 589,824 rows (the second position on) from one activation cache written by the first
run, batch 1024, Adam 1e-3 with 1% warmup and linear decay to 0, the same batch order for every variant of a seed.
FVE is measured on the GPT's held-out validation windows (float64 means over the split).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import default_device, device_name, machine, write_json  # noqa: E402

SETTINGS = [
    "trainer.max_duration=1ep",
    "trainer.val_interval=1.0dur",
    "optimizer.lr=1e-3",
    "scheduler=wsd",
    "scheduler.warmup=0.01dur",
    "scheduler.decay=0.98dur",  # 6 + 565 of 576 steps: linear decay to 0 over the rest of the run
    "callbacks=none",
    "logger=[jsonl]",
    "checkpoint=none",
]
# name -> overrides of the sae_lm preset (whose TopK SAE starts its encoder columns at norm 0.5)
VARIANTS = {
    "unit-norm encoder": ["model.encoder_init=unit"],
    "fit encoder scale": ["model.encoder_init=fit"],
    "norm 0.5 (default)": [],
    "unit, no input scaling": ["model.encoder_init=unit", "model.normalize_input=false"],
    "fit, no input scaling": ["model.encoder_init=fit", "model.normalize_input=false"],
    "fit, untied encoder": ["model.encoder_init=fit", "model.tied_init=false"],
    "fit, b_dec zero": ["model.encoder_init=fit", "model.geometric_median_init=false"],
}


def _run(out: Path, name: str, overrides: list[str]) -> dict[str, float]:
    folder = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    command = [sys.executable, "-m", "runner", "+experiment=sae_lm", *SETTINGS, *overrides, f"hydra.run.dir={folder}"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    return {key: summary["metrics"][f"val/{key}"] for key in ("fve", "dead_fraction", "silent_fraction", "l0")} | {
        "wall_time_s": summary["wall_time_s"]
    }


def main() -> None:
    """Train the GPT if needed, then every variant for every seed; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm", help="a finished +experiment=lm run folder (default: train one)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dir", default="outputs/bench-sae-init")
    parser.add_argument("--json")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--rows", type=int, default=589824, help="cached rows: one epoch")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--lm-args", nargs="*", default=[], help="overrides of the GPT trained without --lm")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME")
    args, sae_args = parser.parse_known_args()
    device = [f"distributed.device={args.device}"]
    SETTINGS.extend([f"source.layer={args.layer}", f"data.cache_rows={args.rows}", f"data.batch_size={args.batch}"])
    SETTINGS.extend([*device, *sae_args])
    out = Path(args.dir).resolve()
    lm = Path(args.lm).resolve() if args.lm else out / "lm"
    if not args.lm and not (lm / "model.safetensors").exists():
        command = [sys.executable, "-m", "runner", "+experiment=lm", "logger=none", *device, *args.lm_args]
        subprocess.run([*command, f"hydra.run.dir={lm}"], check=True)
    SETTINGS.extend([f"source.checkpoint={lm}", "data=activations_lm_cached", f"data.cache={out / 'acts'}"])
    results: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:
        for name in args.variants:
            overrides = VARIANTS[name]
            results.setdefault(name, []).append(_run(out / f"seed{seed}", name, [*overrides, f"seed={seed}"]))
    print(f"\n{machine()}, {device_name(args.device)}; seeds {args.seeds}\n")
    print("| variant | held-out FVE per seed | dead on held-out (max) | silent for dead_window (max) | L0 |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        fves = " / ".join(f"{r['fve']:.4f}" for r in runs)
        dead, silent = (max(r[key] for r in runs) for key in ("dead_fraction", "silent_fraction"))
        print(f"| {name} | {fves} | {dead:.4f} | {silent:.4f} | {runs[0]['l0']:.1f} |")
    write_json(args.json, {"device": args.device, "seeds": args.seeds, "results": results})


if __name__ == "__main__":
    main()
