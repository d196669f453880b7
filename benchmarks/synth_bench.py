"""runner's SAEs against SAELens's own trainers on SynthSAEBench's reduced CPU protocol, side by side, one scorer.

    python benchmarks/synth_bench.py [--steps 3072] [--only topk batchtopk jumprelu matryoshka relu]
        [--contenders runner saelens] [--eval-samples 65536] [--out DIR] [--json out.json]
        [--saelens-python .venv-saelens/bin/python] [--runner-coeff jumprelu=0.05 ...] [--saelens-coeff relu=5 ...]
        [--runner-override jumprelu=model.bandwidth=0.05 ...]

Each architecture is trained twice, each in a fresh process with one thread: by runner (`python -m runner
+experiment=synth_sae_bench model=...`) and by SAELens 6 in its own virtualenv through its SyntheticSAERunner
(benchmarks/peers/saelens_synth.py). Same for both: the world (data=synth_sae_bench_cpu: 4,096 features in 256 dims,
world_seed 2026; SAELens builds it from the same settings with its own generator, bit for bit runner's), the training
samples (SAELens draws batch i from the seed runner draws it from; the first and last batches are compared here with
torch.equal), 1024 latents, k = 12 for TopK, BatchTopK and Matryoshka (Matryoshka's prefixes 64, 256, 1024), a target
L0 of 12 for JumpReLU (runner's model.target_l0, SAELens's quadratic mode's target_l0), batch 1024, Adam at --lr
(3e-3, the preset's) with 1% warmup, constant, then a linear decay to 0 over the last 20%, seed 0. ReLU + L1 has no
L0 target in either tool: runner's trains with model=sae_relu's own l1_coeff (0.1, what a user of the preset gets),
SAELens's with an L1 coefficient of 4.0 (--runner-coeff, --saelens-coeff change them; the L0 reached is in the table).
--runner-override ARCH=KEY=VALUE adds a Hydra override to that architecture's runner command, after all of the
script's own (so it wins over them); each row of the JSON keeps the overrides its run was given.

Not made equal (each tool's own recipe, as its users get it): the initialisation (runner: W_enc = W_dec^T at unit
norm, fitted encoder scale, b_dec at the geometric median; SAELens: decoder rows at norm 0.1, b_dec 0), input
scaling (runner scales inputs to E||x|| = sqrt(d); SAELens's synthetic runner trains on raw activations), the decoder
constraint (runner: unit rows, JumpReLU's free; SAELens: codes rescaled by decoder norms), the dead-latent window
(runner 10 steps, SAELens 1000) and its auxiliary loss (runner AuxK at 1/32; SAELens AuxK at 1.0, Matryoshka's
per-level), gradient clipping (SAELens clips at 1.0, runner's preset does not), the sparsity penalties' forms and
coefficients for JumpReLU and ReLU, and the evaluation data the preset's validation uses (here both are scored on
fresh held-out samples).

Quality: both final SAEs go through one scorer, experiments/sae/evals/ground_truth.py's score_sae (SAELens's
synthetic/evals.py definitions), on the same --eval-samples fresh samples of the world (a stream neither training
saw): runner's from its run folder, SAELens's from the folder its save_inference_model writes (read by runner's
SAELens reader, BatchTopK and Matryoshka at their learned thresholds as SAELens saves them; a JumpReLU threshold
SAELens left below 0 is scored at 0, counted in the row's thresholds_raised_to_0). Seconds: each process's
wall time, launch to exit, generation of the training data included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, spawn, write_json  # noqa: E402

ARCHS = ("topk", "batchtopk", "jumprelu", "matryoshka", "relu")
BATCH, LATENTS, K, SEED = 1024, 1024, 12, 0
WIDTHS = [64, 256, 1024]  # Matryoshka's prefixes: runner's default group sizes 1/16, 3/16, 3/4 of 1024
# runner's model options: the preset's TopK (1024 latents, k 12) and the others at the same width and L0
RUNNER_MODELS = {
    "topk": ["model=sae_synth_bench"],
    "batchtopk": ["model=sae_batchtopk", f"model.n_latents={LATENTS}", f"model.k={K}"],
    "matryoshka": ["model=sae_matryoshka", f"model.n_latents={LATENTS}", f"model.k={K}"],
    "jumprelu": ["model=sae_jumprelu", f"model.n_latents={LATENTS}", f"model.target_l0={K}"],
    "relu": ["model=sae_relu", f"model.n_latents={LATENTS}"],
}
# sparsity coefficients of the penalised architectures (runner: model.l0_coeff / model.l1_coeff; SAELens:
# l0_coefficient of its quadratic mode / l1_coefficient). runner's ReLU keeps its option's l1_coeff: 0.3, which lands
# at L0 12 after 256 steps, drifts to L0 7 with a fifth of the latents dead by the preset's full length. JumpReLU's
# 0.3 reaches the target L0 at full length with free decoder rows (12.5; 0.05 ended at 14.5)
RUNNER_COEFF = {"jumprelu": 0.3}
SAELENS_COEFF = {"jumprelu": 1.0, "relu": 4.0}
SCORER = "experiments.sae.evals.ground_truth.score_sae"


def world() -> dict[str, Any]:
    """data=synth_sae_bench_cpu's world settings, read from its config (and world_seed)."""
    conf = ROOT / "experiments" / "sae" / "conf" / "data"
    base = OmegaConf.load(conf / "synth_sae_bench.yaml").splits
    cpu = OmegaConf.load(conf / "synth_sae_bench_cpu.yaml").splits
    splits = OmegaConf.to_container(OmegaConf.merge(base, cpu))
    return {k: v for k, v in splits.items() if k not in ("_target_", "n_train", "n_val", "seed")}


def train_seeds(steps: int) -> list[int]:
    """The seed runner draws each training batch from (synth_bench_splits' train split, unshuffled, batch BATCH)."""
    from experiments.sae.sources.synthetic import _generator

    return [_generator(SEED, "train", step * BATCH).initial_seed() for step in range(steps)]


def runner_command(
    arch: str, steps: int, lr: float, coeff: dict[str, float], run_dir: Path, overrides: list[str] | None = None
) -> list[str]:
    """`python -m runner` on the preset, with this architecture's model and the protocol's length, then `overrides`
    (Hydra's KEY=VALUE, last: they win over the script's own settings)."""
    extra = []
    if arch == "jumprelu":
        extra = [f"model.l0_coeff={coeff['jumprelu']}"]
    elif arch == "relu" and "relu" in coeff:
        extra = [f"model.l1_coeff={coeff['relu']}"]
    return [
        *(sys.executable, "-m", "runner", "+experiment=synth_sae_bench", *RUNNER_MODELS[arch], *extra),
        *(f"data.splits.n_train={steps * BATCH}", f"data.batch_size={BATCH}", f"seed={SEED}", f"optimizer.lr={lr}"),
        *("trainer.val_interval=1.0dur", "checkpoint=none", "logger=[jsonl]", "threads=1", f"hydra.run.dir={run_dir}"),
        *(overrides or []),
    ]


def run_runner(arch: str, args: argparse.Namespace, out: Path) -> tuple[Path, float]:
    """Train runner's `arch`; its run folder and the process's wall seconds."""
    run_dir = out / f"runner-{arch}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own folder: a fresh run each time
    coeff = {**RUNNER_COEFF, **args.runner_coeff}
    command = runner_command(arch, args.steps, args.lr, coeff, run_dir, args.runner_override.get(arch, []))
    result = spawn(command, run_dir / "summary.json", env={"WANDB_MODE": "offline"}, log=out / f"runner-{arch}.log")
    return run_dir, result["wall_s"]


def run_saelens(arch: str, args: argparse.Namespace, out: Path, settings: dict[str, Any]) -> tuple[Path, float]:
    """Train SAELens's `arch` in its virtualenv on the same batches; its saved folder and the process's seconds."""
    folder = out / f"saelens-{arch}"
    shutil.rmtree(folder, ignore_errors=True)
    job = {
        **{"arch": arch, "world": settings, "seed": SEED, "seeds": train_seeds(args.steps), "batch": BATCH},
        **{"n_latents": LATENTS, "k": K, "widths": WIDTHS, "lr": args.lr, "out": str(folder)},
        # wsd's 1% warmup and 20% decay to 0, in SAELens's terms (its constant schedule decays to 0 over decay steps)
        **{"warmup": max(1, round(0.01 * args.steps)), "decay": max(1, round(0.2 * args.steps))},
        "coeff": {**SAELENS_COEFF, **args.saelens_coeff}.get(arch),
    }
    path = out / f"saelens-{arch}.json"
    path.write_text(json.dumps(job))
    script = ROOT / "benchmarks" / "peers" / "saelens_synth.py"
    result = spawn(
        [args.saelens_python, str(script), str(path)], folder / "timing.json", log=out / f"saelens-{arch}.log"
    )
    return folder, result["wall_s"]


def same_batches(folder: Path, settings: dict[str, Any], steps: int) -> bool:
    """Whether SAELens's first and last training batches are torch.equal to runner's."""
    from safetensors.torch import load_file

    from experiments.sae.sources.synth_bench import synth_bench_splits

    train = synth_bench_splits(n_train=steps * BATCH, n_val=0, seed=SEED, **settings)["train"]
    theirs = load_file(str(folder / "batches.safetensors"))
    return all(
        torch.equal(train.__getitems__(list(range(i * BATCH, (i + 1) * BATCH)))[0], theirs[f"batch_{i}"])
        for i in {0, steps - 1}
    )


def readable(folder: Path) -> tuple[Path, int]:
    """SAELens's saved folder as runner's reader takes it, and how many JumpReLU thresholds had to be raised to 0."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "sae_weights.safetensors"))
    threshold = weights.get("threshold")
    below = 0 if threshold is None else int((threshold < 0).sum())
    if below == 0:
        return folder, 0
    # SAELens trains thresholds unclamped and can leave a few a hair below 0 (-1.3e-6 seen), which runner's reader
    # refuses; at 0 they change only codes smaller than that
    scored = folder / "scored"
    shutil.rmtree(scored, ignore_errors=True)
    scored.mkdir()
    shutil.copy(folder / "cfg.json", scored / "cfg.json")
    save_file({**weights, "threshold": threshold.clamp_min(0)}, str(scored / "sae_weights.safetensors"))
    return scored, below


def score(path: Path, source: Any, samples: int) -> dict[str, Any]:
    """The one scorer on `samples` fresh samples (a stream neither tool trained on); their fingerprint."""
    from experiments.sae.api import load_sae
    from experiments.sae.evals.ground_truth import score_sae
    from experiments.sae.sources.synthetic import _generator

    digest = hashlib.sha256()

    def batches() -> Any:
        for x, codes in source.batches(samples, _generator(SEED, "side_by_side_eval")):
            digest.update(x.numpy().tobytes())
            yield x, codes

    metrics = score_sae(load_sae(path).float(), source.features, batches())
    return {**metrics, "scorer": SCORER, "samples": samples, "samples_sha256": digest.hexdigest()[:16]}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every row."""
    head = "| contender | architecture | L0 | F1 | MCC | uniqueness | explained variance | dead share | seconds |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dead = r["dead_latents"] / LATENTS
        lines.append(
            f"| {r['contender']} | {r['arch']} | {r['l0']:.1f} | {r['f1']:.3f} | {r['mcc']:.3f} | "
            f"{r['uniqueness']:.3f} | {r['explained_variance']:.3f} | {dead:.3f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def coefficients(values: list[str]) -> dict[str, float]:
    """ARCH=VALUE pairs."""
    pairs = [v.split("=", 1) for v in values]
    return {arch: float(value) for arch, value in pairs}


def overrides(values: list[str]) -> dict[str, list[str]]:
    """ARCH=KEY=VALUE pairs: each architecture's Hydra overrides, in the order given."""
    out: dict[str, list[str]] = {}
    for value in values:
        arch, _, override = value.partition("=")
        if arch not in ARCHS or "=" not in override:
            raise SystemExit(f"--runner-override {value!r}: give ARCH=KEY=VALUE, ARCH one of {', '.join(ARCHS)}")
        out.setdefault(arch, []).append(override)
    return out


def main() -> None:
    """Train every (contender, architecture), score each with the one scorer, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3072, help="optimizer steps of 1024 samples (3072: the preset)")
    parser.add_argument("--only", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--contenders", nargs="+", choices=("runner", "saelens"), default=["runner", "saelens"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-samples", type=int, default=65536)
    parser.add_argument("--runner-coeff", nargs="*", default=[], help="ARCH=VALUE: runner's l0_coeff / l1_coeff")
    parser.add_argument("--saelens-coeff", nargs="*", default=[], help="ARCH=VALUE: SAELens's l0 / l1 coefficient")
    parser.add_argument(
        "--runner-override", nargs="*", default=[], help="ARCH=KEY=VALUE: a Hydra override of runner's ARCH run"
    )
    parser.add_argument("--saelens-python", default=str(ROOT / ".venv-saelens" / "bin" / "python"))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "synth_bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.runner_coeff, args.saelens_coeff = coefficients(args.runner_coeff), coefficients(args.saelens_coeff)
    args.runner_override = overrides(args.runner_override)
    if "saelens" in args.contenders and not Path(args.saelens_python).exists():
        raise SystemExit(f"{args.saelens_python} is missing: benchmarks/peers/install.sh makes .venv-saelens")
    torch.set_num_threads(1)
    from experiments.sae.sources.synth_bench import SynthBench

    args.out.mkdir(parents=True, exist_ok=True)
    settings = world()
    source = SynthBench(seed=settings["world_seed"], **{k: v for k, v in settings.items() if k != "world_seed"})
    rows = []
    for arch in args.only:
        for contender in args.contenders:  # one process at a time: one training on the machine
            raised = 0
            if contender == "runner":
                path, seconds = run_runner(arch, args, args.out)
                same = True
            else:
                path, seconds = run_saelens(arch, args, args.out, settings)
                same = same_batches(path, settings, args.steps)
                path, raised = readable(path)
            rows.append({"contender": contender, "arch": arch, "seconds": seconds, "same_batches": same})
            rows[-1]["overrides"] = args.runner_override.get(arch, []) if contender == "runner" else []
            rows[-1]["thresholds_raised_to_0"] = raised
            rows[-1].update(score(path, source, args.eval_samples))
            print(
                f"{contender} {arch}: {seconds:.0f} s, F1 {rows[-1]['f1']:.3f}, MCC {rows[-1]['mcc']:.3f}", flush=True
            )
    print(
        f"\n{machine()}; {args.steps} steps of {BATCH} samples, one thread a process; scored by {SCORER} on "
        f"{args.eval_samples} fresh samples (sha256 {rows[0]['samples_sha256']})\n"
    )
    print(table(rows))
    if not all(r["same_batches"] for r in rows):
        print("\nwarning: SAELens's training batches differ from runner's (see same_batches in the JSON)")
    write_json(args.json, {"steps": args.steps, "lr": args.lr, "rows": rows, "time": time.time()})


if __name__ == "__main__":
    main()
