"""Where a short SAE run's time goes: `+experiment=sae_lm` against a hand-written loop of the same job.

    python benchmarks/startup_sae.py --lm LM_RUN [--steps 300] [--reps 3] [--threads 2] [--layer 2] [--json out.json]
        [--lm-args model.n_layer=2 ...]

Contenders, each a fresh process, repetitions interleaved (the order rotates), on the CPU:
  hand         a hand-written script: load the GPT of --lm, hook the residual stream after block 2 (positions from the
               second on), fill a shuffling ring of 65536 rows, train the preset's TopK SAE (2048 latents, k 32; its own
               training_step, AuxK off as no log row reports dead latents) with fused Adam at 1e-3 and the preset's
               warmup-stable-decay schedule, refilling half the ring when half is served; then once, at the end, the
               FVE on the source's validation rows and the spliced model's loss and KL over its validation windows
  runner       python -m runner +experiment=sae_lm source.checkpoint=LM trainer.max_duration=STEPSst, as typed:
               four validations with the splice, checkpoints with them, the console and metrics.jsonl
  runner_once  the same with trainer.val_interval=1dur: one validation, at the end, as the hand loop's
Reports each one's process wall time, the training steps' time (the first step apart) and their share of the wall time,
and runner's largest phases (summary.json's `startup`, runner/timeline.py). Without --lm it trains the lm preset's
GPT first (python -m runner +experiment=lm, ~4.5 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, spawn, summary, write_json  # noqa: E402

CONTENDERS = ("hand", "runner", "runner_once")
RING, BATCH = 65536, 1024


def hand(lm: str, steps: int, out: str, layer: int) -> None:
    """The hand-written loop; writes its phases to `out`."""
    launched = time.perf_counter() - _process_age_s()  # spawned by Popen, not exec'd by a shell: its own start
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from runner.build import build_data
    from runner.load import load_trained

    gpt, cfg = load_trained(lm)
    gpt.eval().requires_grad_(False)
    text = build_data(cfg)
    block = gpt.get_submodule(f"blocks.{layer}")

    class Done(Exception):
        pass

    def rows(batch: dict) -> torch.Tensor:
        captured = []

        def grab(_module: object, _inputs: object, output: torch.Tensor) -> None:
            captured.append(output[:, 1:].reshape(-1, output.shape[-1]))
            raise Done

        handle = block.register_forward_hook(grab)
        try:
            with torch.no_grad():
                gpt.validation_step(batch)
        except Done:
            pass
        finally:
            handle.remove()
        return captured[0]

    def endless() -> object:
        loader = text.train_loader()
        while True:  # epoch after epoch, as the ring's refills need
            yield from loader

    windows = endless()

    def fill(n: int) -> torch.Tensor:
        parts, have = [], 0
        while have < n:
            parts.append(rows(next(windows)))
            have += len(parts[-1])
        return torch.cat(parts)[:n]

    conf = Path(__file__).resolve().parents[1] / "experiments" / "sae" / "conf"
    width = rows(next(iter(text.val_loader()))).shape[-1]
    with initialize_config_dir(str(conf / "model"), version_base="1.3"):
        sae = instantiate(compose("sae_lm"), d_in=width)
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-3, fused=True)
    warm, cool = max(1, round(0.01 * steps)), round(0.2 * steps)
    factor = lambda t: min((t + 1) / warm, 1.0, (steps - t) / cool if cool else 1.0)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    built = time.perf_counter()
    ring, generator = fill(RING), torch.Generator().manual_seed(0)
    order, pos = torch.randperm(RING, generator=generator), 0
    filled = time.perf_counter()
    for step in range(steps):
        if pos + BATCH > RING // 2:  # half served: refill what was served and reshuffle the whole ring
            ring[order[:pos]] = fill(pos)
            order, pos = torch.randperm(RING, generator=generator), 0
        batch, pos = ring[order[pos : pos + BATCH]], pos + BATCH
        loss = sae.training_step(batch)["loss"]
        loss.backward()
        optimizer.step()
        sae.after_optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step == 0:
            first = time.perf_counter()
    trained = time.perf_counter()
    sae.eval()
    with torch.no_grad():
        val = torch.cat([rows(b) for b in text.val_loader()])
        error = sum(float((sae(part) - part).square().sum()) for part in val.split(8192))
        fve = 1 - error / float((val - val.mean(0)).square().sum())
        ce = kl = count = 0.0
        for batch in text.val_loader():
            clean = gpt.validation_step(batch)["loss"]
            handle = block.register_forward_hook(
                lambda _m, _i, o: torch.cat([o[:, :1], sae(o[:, 1:].reshape(-1, o.shape[-1])).view_as(o[:, 1:])], 1)
            )
            try:
                spliced = gpt.validation_step(batch)["loss"]
            finally:
                handle.remove()
            ce, kl, count = ce + float(spliced), kl + float(spliced - clean), count + 1
    done = time.perf_counter()
    Path(out).write_text(
        json.dumps(
            {
                "startup": {
                    "wall_s": done - launched,
                    "training_s": trained - first,
                    "phases": {
                        "imports and model": built - launched,
                        "buffer fill": filled - built,
                        "first step": first - filled,
                        "final evaluation": done - trained,
                    },
                },
                "metrics": {"val/fve": fve, "val/ce_spliced": ce / count, "ce_spliced_minus_clean": kl / count},
            }
        )
    )


def _process_age_s() -> float:
    # seconds since this process started (Linux's /proc): the interpreter and every import counted
    with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
        started_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
        return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


def measure(contender: str, lm: str, args: argparse.Namespace, tmp: Path) -> dict:
    """One fresh process of `contender`; its wall time and its startup table."""
    steps, threads = args.steps, args.threads
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{contender}-")) / "run"
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if contender == "hand":
        out = run_dir.parent / "hand.json"
        command = [sys.executable, __file__, "--worker", "--lm", lm, "--steps", str(steps), "--out", str(out)]
        command += ["--layer", str(args.layer)]
    else:
        out = run_dir / "summary.json"
        once = ["trainer.val_interval=1dur"] if contender == "runner_once" else []
        command = [sys.executable, "-m", "runner", "+experiment=sae_lm", f"source.checkpoint={lm}"]
        command += [f"trainer.max_duration={steps}st", f"run_dir={run_dir}", f"threads={threads}", *once]
        command += [f"source.layer={args.layer}"]
    return spawn(command, out, env=env, log=run_dir.parent / "log.txt")


def train_lm(tmp: Path, overrides: list[str]) -> str:
    """The lm preset's GPT (with `overrides`), trained here when --lm is not given."""
    run_dir = tmp / "lm"
    command = [sys.executable, "-m", "runner", "+experiment=lm", "logger=none", f"run_dir={run_dir}", *overrides]
    subprocess.run(command, check=True)
    return str(run_dir)


def report(results: dict) -> None:
    """Print the table."""
    print(f"# a {results['steps']}-step sae_lm run ({results['machine']}), {results['reps']} fresh processes each")
    print(f"{'contender':<12} {'process s':>14} {'steps s':>14} {'steps share':>12}  largest phases (median s)")
    for name, row in results["contenders"].items():
        w, t, f = row["wall_s"], row["training_s"], row["training_share"]
        phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phases"][:4])
        print(
            f"{name:<12} {w['median']:>7.1f} ±{w['spread']:<5.1f} {t['median']:>7.1f} ±{t['spread']:<5.1f}"
            f" {f['median']:>11.0%}  {phases}"
        )
    hand, once = results["contenders"]["hand"], results["contenders"]["runner_once"]
    print(f"runner_once / hand, process wall time: {once['wall_s']['median'] / hand['wall_s']['median']:.2f}x")


def _phase_seconds(value: float | dict) -> float:
    return value["s"] if isinstance(value, dict) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm", help="a finished +experiment=lm run folder (default: train one)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer", type=int, default=2, help="the block whose output the SAE reads (source.layer)")
    parser.add_argument("--device", choices=["cpu"], default="cpu", help="the CPU only: the table is a CPU's")
    parser.add_argument("--lm-args", nargs="*", default=[], help="overrides of the GPT trained without --lm")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return hand(args.lm, args.steps, args.out, args.layer)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        lm = args.lm or train_lm(tmp, args.lm_args)
        for rep in range(args.reps):
            for contender in CONTENDERS[rep % 3 :] + CONTENDERS[: rep % 3]:
                runs[contender].append(measure(contender, lm, args, tmp))
    results = {"machine": machine(), "device": args.device, "steps": args.steps, "reps": args.reps, "contenders": {}}
    for contender, reps in runs.items():
        phases: dict[str, list[float]] = {}
        for r in reps:
            for name, value in r["startup"]["phases"].items():
                phases.setdefault(name, []).append(_phase_seconds(value))
        medians = sorted(((k, summary(v)["median"]) for k, v in phases.items()), key=lambda kv: -kv[1])
        results["contenders"][contender] = {
            "wall_s": summary([r["wall_s"] for r in reps]),
            "training_s": summary([r["startup"]["training_s"] for r in reps]),
            "training_share": summary([r["startup"]["training_s"] / r["wall_s"] for r in reps]),
            "phases": medians,
            "metrics": {k: summary([r["metrics"][k] for r in reps]) for k in ("val/fve", "val/ce_spliced")},
        }
    report(results)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
