"""One GPU check: the GPU tests and every benchmark on the device, sized to a time budget, written to one folder.

    python benchmarks/gpu_check.py [--minutes 9] [--out gpu-check] [--device cuda] [--only STEP ...] [--archive F]

First the imports: a GPU machine may have torch but not Hydra, and no internet. Each missing package is named with the
way to bring its wheel (`wheels_hint`), and the check exits 2 before running anything. Then each step runs in a fresh
process, from the repository root, in order (what a short lease must not miss first):
- `pytest -m "gpu or triton"` over tests/unit (4 xdist workers where pytest-xdist is installed): the Triton kernels'
  tests compiled on the GPU;
- runner's SAE step with its torch and its Triton kernels beside sparsify's, in one process (sae_kernels.py, with
  the sparsify virtualenv's python where there is one), bf16 and fp32;
- the tiny model's step against the hand loop, eager and with CUDA graphs, with each step's device ops and syncs
  (overhead.py, `overhead tiny graphs`);
- the benchmarks with `--device`: the SAE peers (where their virtualenvs are), the LM -> SAE pipeline, a transformers
  source, SAE throughput, a cross-layer transcoder, transcoders against the peers, the lm, overhead, startup,
  checkpoint.
Each step's weight is its measured seconds on a GPU; its time limit is 1.5 times that, or the time left if less. So the
first steps get their whole time, a step that ends early leaves its time to the rest, and a short budget leaves out the
last steps (`not reached`). It never squeezes every step at once (the weights add up to more than one lease).

The folder gets, for every step, its JSON (where the script writes one) and its output, plus `report.md` (one table: the
device, then step, status, seconds, file, last line of output) and `report.json`. The table is printed too. With
`--archive F.tar.gz` the figures, logs and report (not the activations or weights) are packed into one file as well.

Exit code:
- 1: the GPU tests failed, or a step crashed.
- 2: a package is missing.
- 0: otherwise. A step that ran out of its time is marked `timeout` and is not a failure.

SAE peers run only where benchmarks/peers/install.sh has made their virtualenvs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# module -> what to install for it (runner's and the tests' imports; torch is the machine's own)
NEEDED = {
    "torch": "torch",
    "hydra": "hydra-core==1.3.2",
    "omegaconf": "omegaconf==2.3.0",
    "antlr4": "antlr4-python3-runtime==4.9.3",
    "yaml": "PyYAML",
    "numpy": "numpy",
    "rich": "rich",
    "safetensors": "safetensors",
    "pytest": "pytest",
}


PEERS_USUAL = "sae peers bf16"  # the peers' speed at the usual size, on Gaussian rows this check writes first

# module -> what it is for: the check warns and goes on without these
OPTIONAL = {"sklearn": "scikit-learn, whose bundled file the digits experiment reads (its GPU tests fail without it)"}


def missing_packages(needed: dict[str, str] = NEEDED) -> list[str]:
    """What to install for the modules of `needed` that this interpreter cannot import."""
    return [package for module, package in needed.items() if importlib.util.find_spec(module) is None]


def wheels_hint(packages: list[str]) -> str:
    """How to bring `packages` to a machine without internet: wheels made elsewhere, installed without an index."""
    pinned = " ".join(packages)
    return (
        f"missing: {', '.join(packages)}. On a machine with internet: pip download --no-deps -d wheels {pinned} "
        "(antlr4-python3-runtime has no wheel on PyPI: pip wheel --no-deps -w wheels antlr4-python3-runtime==4.9.3); "
        "bring the wheels folder here, then: pip install --no-index --no-deps wheels/*.whl"
    )


def steps(device: str, out: Path, reps: int) -> list[tuple[str, float, list[str]]]:
    """(name, weight, command) of each step, in order; a weight is the step's measured seconds (see run_plan)."""
    py, bench = sys.executable, lambda name: str(ROOT / "benchmarks" / f"{name}.py")

    def script(name: str, tag: str, *args: str) -> list[str]:
        return [py, bench(name), "--device", device, *args, "--json", str(out / f"{tag}.json")]

    usual = ["--size", "usual", "--reps", str(reps), "--steps", "20", "--backward", "dense", "sparse", "triton"]
    lm, overhead = ["--reps", "1", "--steps", "30"], ["--reps", str(reps - 1), "--steps", "1000"]
    # the tiny model's step, where runner's own cost per step shows most, eager and with CUDA graphs, runner against
    # the hand loop; the ops and syncs per step columns say where an eager gap goes (launches, or the host)
    graphs = ["--reps", "3", "--steps", "600", "--sizes", "tiny", "--contenders", "hand", "runner", "runner_usual"]
    graphs += ["hand_graphs", "runner_graphs"]
    pipeline = ["--shape", "gpt2_small", "--reps", str(reps), "--precision", "bf16", "model.n_latents=12288"]
    lightning = importlib.util.find_spec("lightning") is not None
    contenders = [] if lightning else ["--contenders", "hand", "runner", "runner_usual"]
    have_peers = all((ROOT / f".venv-{peer}" / "bin" / "python").exists() for peer in ("sparsify", "saelens"))
    peers = [
        *("--acts", str(out / "acts768.npy"), "--n-latents", "24576", "--k", "32", "--batch", "4096"),
        *("--heldout", "8192", "--steps", "60", "--seeds", "0", "1", "--threads", "8", "--dir", str(out / "peers")),
    ]
    lm_peers = ["--threads", "8", "--dir", str(out / "peers-lm")]
    transcoder_peers = ["--target-columns", "128", "--lm", str(out / "peers-lm" / "lm"), "--threads", "8"]
    transcoder_peers += ["--dir", str(out / "peers-transcoders"), "--runner-args", "model.encoder_init=0.6"]
    # a few test processes share the GPU: most tests are small, and the compiled ones wait on Inductor's CPU work
    xdist = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    tests = [py, "-m", "pytest", "-m", "gpu or triton", "tests/unit", "-q", "-p", "no:cacheprovider", "--durations=15"]
    tests += xdist
    # runner's SAE step (torch and Triton kernels) beside sparsify's, in one process: its virtualenv's python
    kernels_py = str(ROOT / ".venv-sparsify" / "bin" / "python") if have_peers else py
    kernels = [kernels_py, bench("sae_kernels"), "--device", device, "--reps", "5", "--steps", "20"]
    # in order of what a short lease must not miss; each weight is the step's seconds on an H200 (2026-11-26) or an
    # H100 (2026-11-28), measured (raised where a step ran out of its share), ~24 minutes in all: a lease of 15
    # minutes runs the first ones (run_plan). Estimated, not yet measured: the GPU tests' CUDA-graph variants (+30 s)
    # and the tiny step with CUDA graphs (15 processes, two of them compiling)
    plan = [
        ("gpu tests", 180, tests),
        ("sae kernels bf16", 30, [*kernels, "--precision", "bf16", "--json", str(out / "sae-kernels-bf16.json")]),
        ("sae kernels fp32", 30, [*kernels, "--precision", "fp32", "--json", str(out / "sae-kernels-fp32.json")]),
        ("overhead tiny graphs", 110, script("overhead", "overhead-tiny", *graphs)),
        (PEERS_USUAL, 200, script("sae_peers", "sae-peers", *peers, "--precision", "bf16")),
        # GPT-2 small's residual stream after block 6, a 16x SAE fed from a ring on the GPU, against a hand loop
        ("sae pipeline", 40, script("sae_pipeline", "sae-pipeline", *pipeline)),
        # a transformers GPT-2 small (random weights) as the source, in bf16, against the same model used by hand
        ("sae hf", 25, script("sae_hf", "sae-hf", "--dtype", "bfloat16", "--batch", "64", "--windows", "512")),
        ("sae usual bf16", 45, script("sae_throughput", "sae-usual-bf16", *usual, "--precision", "bf16")),
        ("sae usual fp32", 45, script("sae_throughput", "sae-usual-fp32", *usual)),
        ("sae preset", 25, script("sae_throughput", "sae-preset", "--size", "preset", "--reps", str(reps))),
        # a cross-layer transcoder against per-layer transcoders of its width (peak GPU memory and step time)
        ("clt", 25, script("clt", "clt", "--steps", "60")),
        # quality too, on a language model's activations: the README's side-by-side (the lm preset's GPT, trained
        # there first, its residual stream cached), one seed
        ("sae peers lm", 240, script("sae_peers", "sae-peers-lm", "--seeds", "0", *lm_peers)),
        # transcoders of the same GPT's blocks.2 MLP (its run from the step above, else trained here) against the peers
        ("sae peers transcoders", 120, script("sae_peers", "sae-peers-transcoders", "--seeds", "0", *transcoder_peers)),
        # one repetition: each mode is a fresh process per contender, and compiling GPT-2 small's blocks takes ~a minute
        ("lm bf16", 160, script("lm", "lm-bf16", "--precision", "bf16", "--modes", "eager,compile", *lm)),
        # Lightning only where it is installed
        ("overhead", 100, script("overhead", "overhead", *overhead, "--sizes", "mlp", *contenders)),
        ("startup", 60, script("startup", "startup", "--reps", str(reps))),
        ("checkpoint", 30, script("checkpoint", "checkpoint", "--reps", str(reps))),
    ]
    # the peers only where benchmarks/peers/install.sh (or offline.sh) made their virtualenvs
    return [step for step in plan if have_peers or not step[0].startswith("sae peers")]


def run_step(name: str, command: list[str], limit_s: float, out: Path) -> dict[str, Any]:
    """Run one step with a time limit; its status, seconds and last line of output (all of it in out/<name>.log)."""
    log = out / f"{name.replace(' ', '-')}.log"
    # the repository first, then whatever PYTHONPATH already holds (wheels installed with --target, say)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline"}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        status = "ok" if done.returncode == 0 else f"failed ({done.returncode})"
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status = "timeout"
        text = "".join(x.decode() if isinstance(x, bytes) else x or "" for x in (expired.stdout, expired.stderr))
    log.write_text(text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return {
        "step": name,
        "status": status,
        "seconds": time.perf_counter() - started,
        "log": log.name,
        "last": lines[-1][:160] if lines else "",
    }


HEADROOM = 1.5  # a step may take this many times its measured seconds before it is cut
MIN_STEP_S = 10.0  # less time left than this: the step is not started


def run_plan(plan: list[tuple[str, float, list[str]]], seconds: float, out: Path) -> list[dict[str, Any]]:
    """Run the steps in order, each limited to HEADROOM x its weight or the time left, whichever is less; the steps
    the time does not reach are reported as `not reached`."""
    deadline, results = time.monotonic() + seconds, []
    for name, weight, command in plan:
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            results.append({"step": name, "status": "not reached", "seconds": 0.0, "log": "-", "last": ""})
            continue
        results.append(run_step(name, command, min(weight * HEADROOM, left), out))
    return results


def report(results: list[dict[str, Any]], device: str, out: Path) -> str:
    """report.md and report.json in `out`; returns the markdown."""
    rows = [
        f"GPU check on {device}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| step | status | seconds | output | last line |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        last = r["last"].replace("|", "/")
        rows.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['log']} | {last} |")
    text = "\n".join(rows) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"device": device, "steps": results}, indent=2) + "\n")
    return text


def archive(out: Path, path: Path, kinds: tuple[str, ...] = (".json", ".jsonl", ".log", ".md")) -> int:
    """Pack every file of `out` of those kinds (the figures, logs and report; not the activations or weights) into the
    .tar.gz `path`; how many."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in kinds)
    with tarfile.open(path, "w:gz") as tar:
        for file in files:
            tar.add(file, arcname=str(Path(out.name) / file.relative_to(out)))
    return len(files)


def device_name(device: str) -> str:
    """The device in words: the GPU's name, or the CPU."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    return f"{device} (torch {torch.__version__})"


def main() -> int:
    """Check the imports, run the steps within the minutes, write and print the report; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=9.0)
    parser.add_argument("--out", default="gpu-check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="*", help="step names to run (default: all)")
    parser.add_argument("--archive", help="also pack the figures and logs into this .tar.gz (one file to bring back)")
    args = parser.parse_args()
    missing = missing_packages()
    if missing:
        print(wheels_hint(missing), file=sys.stderr)
        return 2
    for package in missing_packages(OPTIONAL):
        print(f"warning: {package}", file=sys.stderr)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = [s for s in steps(args.device, out, 2 if args.minutes < 15 else 3) if not args.only or s[0] in args.only]
    if not plan:
        print(f"--only {args.only}: no such step", file=sys.stderr)
        return 2
    if any(name == PEERS_USUAL for name, _, _ in plan):
        import numpy as np  # Gaussian rows: the peers' speed at the usual size (their quality means nothing here)

        np.save(out / "acts768.npy", np.random.default_rng(0).standard_normal((4096 * 60 + 8192, 768), np.float32))
    results = run_plan(plan, args.minutes * 60, out)
    print(report(results, device_name(args.device), out))
    if args.archive:
        print(f"{archive(out, Path(args.archive))} files in {args.archive}")
    failed = [r for r in results if r["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
