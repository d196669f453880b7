"""runner's TopK SAE (or transcoder) against EleutherAI's sparsify and SAELens, side by side on one activation file:
held-out quality and training speed.

    python benchmarks/sae_peers.py [--acts CACHE_DIR|FILE.npy] [--lm RUN_DIR] [--seeds 0 1 2] [--threads 1]
        [--contenders runner sparsify saelens] [--sparsify-python PY] [--saelens-python PY] [--json out.json]
        [--runner-model sae_lm|sae_topk|sae_file] [--runner-args model.encoder_init=unit ...]
    python benchmarks/sae_peers.py --target-columns 128 [...]     # transcoders: runner, sparsify, SAELens, each with
        # and without a skip connection (contenders runner runner-skip sparsify sparsify-skip saelens saelens-skip)

The peers run in their own virtualenvs (`benchmarks/peers/install.sh` makes .venv-sparsify and .venv-saelens), each
through its own trainer (benchmarks/peers/*_run.py); runner runs as `python -m runner`. Without --acts, the
activations are the lm preset's GPT's residual stream after blocks.2 (`data.cache`, written by a one-step
`+experiment=sae_lm` run; the GPT is trained first without --lm, as benchmarks/sae_init.py does). With
--target-columns N the last N columns of each row are a transcoder's target, and without --acts the rows are blocks.2's
MLP input and output side by side (a one-step `+experiment=transcoder_lm` run writes them): every contender reads the
rest of the row and predicts those N columns.

Same for every contender: the rows (the file's last --heldout rows held out, whole windows of text; the rest shuffled
once per seed into a training file read in order, so every tool sees the same batches), latents, k, batch, Adam at
--lr with a linear warmup over 1% of the steps and a linear decay to 0, AuxK at 1/32 over latents silent for
--dead-steps steps, the seed, one thread (--threads), fresh processes in rotating order. What differs is each tool's
recipe (its initialisation, input scaling, decoder constraint, loss normalisation and AuxK form) and a few things that
could not be made equal, listed in benchmarks/README.md.

Quality: the trained SAEs are rewritten into one form and scored by one scorer (benchmarks/peers/driver.py) on the
held-out rows in float64: FVE (1 - SSE/SST, SST about the split's mean; a transcoder's: of its target), L0, and the
share of latents that never fire there; each tool's own figure (its own forward, float32) stands beside it. Speed:
samples/s over the steady state (median of ten stretches after the first 10% of steps), launch to the end of the first
optimizer step, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, machine, spawn, write_json  # noqa: E402
from benchmarks.peers.driver import score  # noqa: E402

PEERS = {"sparsify": "sparsify_run.py", "saelens": "saelens_run.py"}
TOOLS = ["runner", *PEERS]
SKIP = "-skip"  # a transcoder contender with a skip connection: runner-skip, sparsify-skip, saelens-skip


def cached_rows(path: Path) -> np.ndarray:
    """The rows of a data.cache folder (its shards in order) or of one .npy file, as float32."""
    if path.is_dir():
        manifest = json.loads((path / "manifest.json").read_text())
        return np.concatenate([np.load(path / s["file"]) for s in manifest["shards"]]).astype(np.float32)
    return np.load(path).astype(np.float32)


def write_data(acts: Path, out: Path, seeds: list[int], heldout: int) -> dict[str, object]:
    """heldout.npy (the last `heldout` rows: whole windows of text the training never sees) and one training file per
    seed (the other rows in that seed's order), once."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"heldout": out / "heldout.npy", **{f"train{s}": out / f"train-s{s}.npy" for s in seeds}}
    if all(f.exists() for f in files.values()):
        return {"rows": len(np.load(files["train" + str(seeds[0])], mmap_mode="r")), "files": files}
    array = cached_rows(acts)
    if len(array) <= heldout:
        raise SystemExit(f"{acts} holds {len(array)} rows: fewer than --heldout {heldout}")
    np.save(files["heldout"], array[-heldout:])
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(len(array) - heldout)
        np.save(files[f"train{seed}"], array[order])
    return {"rows": len(array) - heldout, "files": files}


def build_acts(args: argparse.Namespace, out: Path) -> Path:
    """The lm preset's residual-stream cache: train the GPT (without --lm), then a one-step sae_lm run writes it; with
    --target-columns, blocks.2's MLP input and output side by side, from a one-step transcoder_lm run."""
    preset = "transcoder_lm" if args.target_columns else "sae_lm"
    cache = out / ("acts-transcoder" if args.target_columns else "acts")
    if (cache / "manifest.json").exists():
        return cache
    lm = Path(args.lm).resolve() if args.lm else out / "lm"
    if not (lm / "model.safetensors").exists():
        train = [sys.executable, "-m", "runner", "+experiment=lm", "logger=none", f"hydra.run.dir={lm}"]
        subprocess.run(train, check=True)
    command = [
        *("-m", "runner", f"+experiment={preset}", f"source.checkpoint={lm}", "data=activations_lm_cached"),
        f"data.cache={cache}",
        *(f"data.cache_rows={args.rows}", "trainer.max_duration=1st", "callbacks=none", "logger=none"),
        *("checkpoint=none", "trainer.val_interval=1.0dur", f"hydra.run.dir={out / 'cache-run'}"),
    ]
    subprocess.run([sys.executable, *command], check=True, env={**os.environ, "WANDB_MODE": "offline"})
    return cache


def runner_command(spec: dict, run_dir: Path) -> list[str]:
    """`python -m runner` with the job's settings: the TopK SAE preset on the training file, held-out validation (a
    transcoder: the file's last d_out columns are its target, with a skip connection or not)."""
    cool = spec["steps"] - spec["lr_warmup_steps"]
    shape = [f"data.d_out={spec['d_out']}", f"model.skip={str(spec['skip']).lower()}"] if spec["d_out"] else []
    return [
        *(sys.executable, "-m", "runner", "+experiment=sae", f"model={spec['runner_model']}", "data=activations_file"),
        *(f"data.train_path={spec['train']}", f"data.val_path={spec['heldout']}", "data.shuffle=false"),
        *(f"data.batch_size={spec['batch']}", f"model.n_latents={spec['n_latents']}", f"model.k={spec['k']}"),
        # runner's window counts steps >= it; the peers count > dead_steps
        *(f"model.auxk_coeff={spec['auxk_coeff']}", f"model.dead_window={spec['dead_steps'] + 1}st"),
        *(f"optimizer.lr={spec['lr']}", "scheduler=wsd", f"scheduler.warmup={spec['lr_warmup_steps']}st"),
        *(f"scheduler.decay={cool}st", f"trainer.max_duration={spec['steps']}st", "trainer.val_interval=1.0dur"),
        *("callbacks=none", "logger=[jsonl]", "checkpoint=none", f"seed={spec['seed']}", f"threads={spec['threads']}"),
        *(f"distributed.device={spec['device']}", f"precision={spec['precision']}", f"hydra.run.dir={run_dir}"),
        "+callbacks.peer_timer._target_=benchmarks.timer.StepTimer",
        f"+callbacks.peer_timer.warmup={spec['warmup_steps']}",
        f"+callbacks.peer_timer.out={spec['out']}",
        *shape,
        *spec["runner_args"],
    ]


def runner_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """runner's trained SAE (or transcoder) in the shared form."""
    from safetensors.torch import load_file

    state = load_file(str(run_dir / "model.safetensors"))
    keep = {k: state[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "target_scale") if k in state}
    if "target_scale" not in state:  # an SAE: its encoder centres by b_dec
        return {**keep, "center": state["b_dec"], "scale": state["input_scale"]}
    # a transcoder's encoder reads its input uncentred: pre = x * input_scale @ W_enc + b_enc
    return {**keep, "center": torch.zeros(state["W_enc"].shape[0]), "scale": state["input_scale"]}


def run_one(name: str, spec: dict, args: argparse.Namespace, out: Path) -> dict:
    """One fresh process of contender `name` on `spec`; its figures, the shared score and its own figure."""
    spec = {**spec, "out": str(out / f"{name}.json")}
    log = out / f"{name}.log"
    threads = {"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
    tool = name.removesuffix(SKIP)
    spec = {**spec, "skip": name.endswith(SKIP)}
    if tool == "runner":
        run_dir = out / f"{name}-run"
        shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own folder: a fresh run each time
        env = {**threads, "WANDB_MODE": "offline"}
        result = spawn(runner_command(spec, run_dir), Path(spec["out"]), env=env, log=log)
        weights = runner_weights(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        result["own"] = {"fve": summary["metrics"]["val/fve"], "tool": "runner"}
    else:
        job = out / f"{name}-job.json"
        job.write_text(json.dumps(spec))
        python = getattr(args, f"{tool}_python")
        script = ROOT / "benchmarks" / "peers" / PEERS[tool]
        result = spawn([python, str(script), str(job)], Path(spec["out"]), env=threads, log=log)
        from safetensors.torch import load_file

        weights = load_file(str(Path(spec["out"]).with_suffix(".safetensors")))
    result["score"] = score(weights, np.load(spec["heldout"], mmap_mode="r"), spec["k"], spec["d_out"])
    result["samples_per_s"] = spec["batch"] / result["per_step_s"]
    return result


def main() -> None:
    """Prepare the data once, train every contender for every seed in rotating order, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--acts", help="a data.cache folder or an [N, d] .npy file (default: build the lm's)")
    parser.add_argument("--lm", help="a finished +experiment=lm run folder, for building --acts")
    parser.add_argument("--rows", type=int, default=589824, help="rows to cache when building --acts")
    parser.add_argument("--heldout", type=int, default=65536)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--target-columns",
        type=int,
        help="transcoders: each row's last N columns are the target, the rest the input (without --acts: the lm "
        "preset's blocks.2 MLP input and output, N=128)",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=[*TOOLS, *(tool + SKIP for tool in TOOLS)],
        help=f"default: {' '.join(TOOLS)}; with --target-columns each also with a skip connection (runner{SKIP}...)",
    )
    parser.add_argument("--sparsify-python", default=str(ROOT / ".venv-sparsify" / "bin" / "python"))
    parser.add_argument("--saelens-python", default=str(ROOT / ".venv-saelens" / "bin" / "python"))
    parser.add_argument("--n-latents", type=int, default=2048)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, help="default: one epoch of the training rows")
    parser.add_argument("--dead-steps", type=int, default=128, help="a latent silent this many steps is dead")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="runner's precision=, SAELens's autocast"
    )
    parser.add_argument("--dir", default="outputs/bench-sae-peers")
    parser.add_argument(
        "--runner-model",
        default="sae_lm",
        help="runner's model option: sae_lm (the sae_lm preset's SAE), sae_topk (what `+experiment=sae "
        "data=activations_file` gets) or sae_file (`+experiment=sae_file`'s, whose lr 2e-3 goes in --runner-args)",
    )
    parser.add_argument("--runner-args", nargs="*", default=[], help="more overrides of runner's run (ablations)")
    parser.add_argument("--json")
    args = parser.parse_args()
    transcoder = args.target_columns is not None
    args.contenders = args.contenders or [*TOOLS, *((tool + SKIP for tool in TOOLS) if transcoder else ())]
    skips = [name for name in args.contenders if name.endswith(SKIP)]
    if skips and not transcoder:
        raise SystemExit(f"{skips}: a skip connection is a transcoder's; give --target-columns N")
    for tool in {name.removesuffix(SKIP) for name in args.contenders} & set(PEERS):
        if not Path(getattr(args, f"{tool}_python")).exists():
            raise SystemExit(
                f"no {tool} interpreter at {getattr(args, f'{tool}_python')}: make it with "
                f"benchmarks/peers/install.sh, give --{tool}-python, or leave {tool} out of --contenders"
            )
    out = Path(args.dir).resolve()
    acts = Path(args.acts).resolve() if args.acts else build_acts(args, out)
    data = write_data(acts, out / ("data-transcoder" if transcoder else "data"), args.seeds, args.heldout)
    width = int(np.load(data["files"]["heldout"], mmap_mode="r").shape[1])
    if transcoder and not 0 < args.target_columns < width:
        raise SystemExit(f"--target-columns {args.target_columns}: the rows have {width} columns; give fewer")
    steps = args.steps or data["rows"] // args.batch
    if steps * args.batch > data["rows"] or steps < 10:
        raise SystemExit(f"--steps {steps} x --batch {args.batch} needs 10 steps and at most {data['rows']} rows")
    results: dict[str, list[dict]] = {name: [] for name in args.contenders}
    for i, seed in enumerate(args.seeds):
        spec = {
            "train": str(data["files"][f"train{seed}"]),
            "heldout": str(data["files"]["heldout"]),
            **{"n_latents": args.n_latents, "k": args.k, "batch": args.batch, "lr": args.lr, "steps": steps},
            **{"lr_warmup_steps": max(1, round(0.01 * steps)), "warmup_steps": steps // 10, "seed": seed},
            **{"auxk_coeff": 1 / 32, "dead_steps": args.dead_steps, "threads": args.threads, "device": args.device},
            "precision": args.precision,
            "runner_model": args.runner_model,
            "runner_args": args.runner_args,
            "d_out": args.target_columns,
        }
        order = args.contenders[i % len(args.contenders) :] + args.contenders[: i % len(args.contenders)]
        for name in order:
            seed_dir = out / f"seed{seed}"
            seed_dir.mkdir(parents=True, exist_ok=True)
            results[name].append(run_one(name, spec, args, seed_dir))
            r = results[name][-1]
            print(
                f"seed {seed} {name}: FVE {r['score']['fve']:.4f} (own {r['own']['fve']:.4f}), "
                f"{r['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    print_tables(results, args, steps)
    write_json(args.json, {"device": args.device, "steps": steps, "args": vars(args), "results": results})


def print_tables(results: dict[str, list[dict]], args: argparse.Namespace, steps: int) -> None:
    """Quality and speed, medians over seeds; speed ratios paired per seed against runner of the same shape (with a
    skip connection or not)."""
    print(
        f"\n{machine()}, device {args.device} ({args.precision}), {args.threads} thread(s); {args.n_latents} latents, "
        f"k {args.k}, "
        f"batch {args.batch}, {steps} steps, seeds {args.seeds}"
        + (f"; transcoders, the rows' last {args.target_columns} columns the target" if args.target_columns else "")
        + "\n"
    )
    print(
        "| contender | held-out FVE per seed (float64) | own figure | L0 | never fire | samples/s | runner / it |"
        " to first step s | peak RSS MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        base = [r["samples_per_s"] for r in results.get("runner" + (SKIP if name.endswith(SKIP) else ""), [])]
        fves = " / ".join(f"{r['score']['fve']:.4f}" for r in runs)
        own = " / ".join(f"{r['own']['fve']:.4f}" for r in runs)
        rate = [r["samples_per_s"] for r in runs]
        ratio = statistics.median(b / x for b, x in zip(base, rate, strict=True)) if base else float("nan")
        print(
            f"| {name} | {fves} | {own} | {statistics.median(r['score']['l0'] for r in runs):.1f} | "
            f"{max(r['score']['dead'] for r in runs):.4f} | {statistics.median(rate):.0f} | {ratio:.2f} | "
            f"{statistics.median(r['to_first_step_s'] for r in runs):.1f} | "
            f"{statistics.median(r['own_peak_rss_mb'] for r in runs):.0f} |"
        )


if __name__ == "__main__":
    main()
