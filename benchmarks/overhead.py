"""Per-step overhead: a hand-written loop, runner and PyTorch Lightning training the same model the same way.

    python benchmarks/overhead.py [--device cpu|cuda] [--reps 5] [--steps 2000] [--sizes tiny mlp] [--json out.json]

Contenders, each in a fresh process (one thread), repetitions interleaved so that machine noise hits all alike:
  hand             a minimal hand-written loop
  runner           python -m runner, no loggers or callbacks
  lightning        a minimal Lightning Trainer (no logger, checkpointing, progress bar or model summary)
  runner_usual     runner with its usual loggers and callbacks: the live console bar, metrics.jsonl, and the
                   checkpoint callback every quarter of the run
  lightning_usual  Lightning with its usual ones: progress bar, a logger, per-step self.log, model summary, and a
                   ModelCheckpoint every quarter of the run
  runner_plain     (on request) runner_usual off a terminal: the console's plain progress lines, one per log call
  hand_default     (on request) the hand loop with torch's default AdamW (no `fused` argument: a for-loop over the
                   tensors on the CPU, foreach on CUDA): what a loop written without that argument gets
  hand_graphs      (on request, CUDA) the hand loop with its MLP compiled in mode reduce-overhead: CUDA graphs
  runner_graphs    (on request, CUDA) runner with the same: compile=blocks compile.units=[Sequential]
                   compile.mode=reduce-overhead (the optimizer step stays eager in both)
All train benchmarks.common.Net with AdamW, a per-step cosine schedule and clipping at 1.0 on the same batches, on
--device (default: cuda when present). Every contender but hand_default gets fused AdamW (runner's default on CUDA and
the CPU); on CUDA every contender gets pinned batches copied without blocking, the hand loop reads nothing from the
GPU until the end, and the clock is read after torch.cuda.synchronize() at a few steps only (common.Stamps).
Reports the steady-state time per step (after --warmup steps), ratios to `hand` (median of the per-repetition
ratios), peak RSS (and peak GPU memory on CUDA), the final losses, which hand, runner and lightning must agree on
to 5 decimal places, and what a step launches: its device operations (aten ops, forward, backward and optimizer;
views not counted) and on CUDA its host-device syncs, counted over the last 5 warm-up steps (common.OpCount). A
contender slower than hand by more than its extra operations explain spends the difference on the host.
Lightning is optional (pip install -e ".[bench]"); without it the Lightning contenders are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    CLIP,
    SIZES,
    WEIGHT_DECAY,
    Net,
    Stamps,
    cosine_factor,
    default_device,
    device_name,
    final_loss,
    fused,
    loader,
    machine,
    median_gpu_mb,
    mib,
    param_groups,
    runner_command,
    spawn,
    summary,
    write_json,
)

CONTENDERS = (
    "hand",
    "runner",
    "lightning",
    "runner_usual",
    "lightning_usual",
    "runner_plain",
    "hand_default",
    "hand_graphs",
    "runner_graphs",
)
DEFAULT = CONTENDERS[:5]  # runner_plain on request: --contenders hand runner runner_usual runner_plain
GRAPHS = ("hand_graphs", "runner_graphs")  # CUDA graphs: on a GPU only
# the MLP (Net.net, a Sequential) compiled with CUDA graphs, as a user asks runner for it
RUNNER_GRAPHS = [
    "compile=blocks",
    "compile.units=[Sequential]",
    "compile.mode=reduce-overhead",
    "bench.count_ops=false",
]


def hand(
    size: str, steps: int, warmup: int, out: str, device: str, graphs: bool = False, torch_default: bool = False
) -> None:
    """The loop a researcher writes by hand (on a GPU: no read from it until the end); `graphs`: its MLP compiled
    in mode reduce-overhead (CUDA graphs for the forward and backward); `torch_default`: AdamW without `fused`."""
    from runner.data import to_device

    device = torch.device(device)
    model, data = Net(size).to(device), loader(size, device)
    if graphs:
        model.net.compile(mode="reduce-overhead")
    kernel = {} if torch_default else {"fused": fused(device)}
    opt = torch.optim.AdamW(param_groups(model), lr=SIZES[size][3], weight_decay=WEIGHT_DECAY, **kernel)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: cosine_factor(t, steps))
    # a dispatch mode would send the compiled graphs back to dynamo: no operation count for them
    stamps, step, epoch = Stamps(warmup, steps, device, count_ops=not graphs), 0, 0
    while step < steps:
        data.batch_sampler.set_epoch(epoch)
        for batch in data:
            loss = model.training_step(to_device(batch, device))["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            stamps.step(step)
            if step == steps:
                break
        epoch += 1
    stamps.write(out, final_loss=final_loss(model, size))


def lightning(size: str, steps: int, warmup: int, out: str, usual: bool, run_dir: str, device: str) -> None:
    """The same training as a LightningModule: a bare Trainer, or one with its usual bar, logger and summary."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net(size)

        def training_step(self, batch, batch_idx):
            loss = self.model.training_step(batch)["loss"]
            if usual:
                self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(
                param_groups(self.model), lr=SIZES[size][3], weight_decay=WEIGHT_DECAY, fused=fused(device)
            )
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: cosine_factor(t, steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    stamps = Stamps(warmup, steps, device)

    class Timer(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            stamps.step(trainer.global_step)

    bare = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    saver = pl.callbacks.ModelCheckpoint(dirpath=f"{run_dir}/checkpoints", every_n_train_steps=steps // 4)
    where = torch.device(device)
    trainer = pl.Trainer(
        accelerator=where.type,
        devices=[where.index or 0] if where.type == "cuda" else 1,
        max_steps=steps,
        gradient_clip_val=CLIP,
        callbacks=[Timer(), saver] if usual else [Timer()],
        default_root_dir=run_dir,
        num_sanity_val_steps=0,
        **({} if usual else bare),
    )
    module = Module()
    trainer.fit(module, train_dataloaders=loader(size, device))
    stamps.write(out, final_loss=final_loss(module.model, size))


def worker(args: argparse.Namespace) -> None:
    """Run one contender in this process (the parent starts one process per measurement)."""
    if args.worker.startswith("hand"):
        graphs, torch_default = args.worker == "hand_graphs", args.worker == "hand_default"
        hand(args.size, args.steps, args.warmup, args.out, args.device, graphs, torch_default)
    else:
        usual = args.worker == "lightning_usual"
        lightning(args.size, args.steps, args.warmup, args.out, usual, args.run_dir, args.device)


def measure(contender: str, size: str, steps: int, warmup: int, tmp: Path, device: str) -> dict:
    """One fresh process of `contender`; returns its figures."""
    command, out = contender_command(contender, size, steps, warmup, tmp, device)
    # TTY_COMPATIBLE: rich draws its live bar as in a terminal, so runner_usual pays for it like a user does.
    tty = "0" if contender == "runner_plain" else "1"
    return spawn(command, out, env={"TTY_COMPATIBLE": tty}, log=tmp / f"{contender}.log")


def contender_command(contender: str, size: str, steps: int, warmup: int, tmp: Path, device: str) -> tuple[list, Path]:
    """The command line of one process of `contender`, and the JSON file it writes its figures to."""
    # a folder of its own each time: runner refuses to start a new run in a folder that holds one
    out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{contender}-")) / "figures.json"
    run_dir = out.parent / "run"
    if contender.startswith("runner"):
        usual = ["logger=default", "callbacks=none", "checkpoint=default", f"checkpoint.interval={steps // 4}st"]
        # runner_plain: the console off a terminal (CI, SLURM logs) at its worst, a plain line at every log call
        extra = {"runner_usual": usual, "runner_plain": [*usual, "logger.console.every_s=0"]}.get(contender, [])
        extra = RUNNER_GRAPHS if contender == "runner_graphs" else extra
        command = runner_command(size, steps, warmup, out, run_dir, *extra, device=device)
    else:
        command = [
            sys.executable,
            __file__,
            "--worker",
            contender,
            "--size",
            size,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--out",
            str(out),
            "--run-dir",
            str(run_dir),
            "--device",
            device,
        ]
    return command, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps on tiny (mlp: a tenth, at least 60)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the clock starts (default: a tenth)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--contenders", nargs="+", default=list(DEFAULT), choices=CONTENDERS)
    parser.add_argument("--json")
    parser.add_argument(
        "--worker",
        choices=["hand", "hand_default", "hand_graphs", "lightning", "lightning_usual"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--size", "--out", "--run-dir", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        worker_args = argparse.ArgumentParser()
        for name in ("--worker", "--size", "--out", "--run-dir", "--device"):
            worker_args.add_argument(name)
        worker_args.add_argument("--steps", type=int)
        worker_args.add_argument("--warmup", type=int)
        return worker(worker_args.parse_args())

    contenders = list(args.contenders)
    if "hand" not in contenders:
        parser.error("--contenders needs hand: every ratio is to it")
    if importlib.util.find_spec("lightning") is None:
        print("lightning is not installed (pip install -e '.[bench]'): skipping its contenders", file=sys.stderr)
        contenders = [c for c in contenders if not c.startswith("lightning")]
    if torch.device(args.device).type != "cuda" and set(GRAPHS) & set(contenders):
        print(f"CUDA graphs need a GPU: skipping {', '.join(GRAPHS)} on {args.device}", file=sys.stderr)
        contenders = [c for c in contenders if c not in GRAPHS]
    results = {"machine": machine(), "device": device_name(args.device), "sizes": {}}
    for size in args.sizes:
        steps = args.steps if size == "tiny" else max(60, args.steps // 10)
        warmup = args.warmup if args.warmup is not None else max(1, steps // 10)
        runs: dict[str, list[dict]] = {c: [] for c in contenders}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                # Rotate the order each repetition so no contender always runs first (or just after another).
                for contender in contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]:
                    runs[contender].append(measure(contender, size, steps, warmup, Path(tmp), args.device))
                    print(
                        f"{size} rep {rep + 1}/{args.reps} {contender}: "
                        f"{runs[contender][-1]['per_step_s'] * 1e6:.1f} us/step",
                        file=sys.stderr,
                    )
        results["sizes"][size] = table(runs, steps, warmup)
    report(results)
    write_json(args.json, results)


def table(runs: dict[str, list[dict]], steps: int, warmup: int) -> dict:
    """Per contender: per-step time, ratio to hand (paired by repetition), peak RSS, final loss."""
    rows = {}
    for contender, reps in runs.items():
        ratios = [r["per_step_s"] / h["per_step_s"] for r, h in zip(reps, runs["hand"], strict=True)]
        rows[contender] = {
            "us_per_step": summary([r["per_step_s"] * 1e6 for r in reps]),
            "ratio_to_hand": summary(ratios),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in reps),
            "peak_gpu_mb": median_gpu_mb(reps),
            "final_loss": reps[-1]["final_loss"],
            # what one step launches (Stamps' OpCount over warm-up steps): the same in every repetition
            "ops_per_step": reps[-1].get("ops_per_step"),
            "syncs_per_step": reps[-1].get("syncs_per_step"),
        }
    exact = [c for c in ("hand", "runner", "lightning") if c in rows]
    losses = [rows[c]["final_loss"] for c in exact]
    return {
        "steps": steps,
        "warmup": warmup,
        "reps": len(runs["hand"]),
        "contenders": rows,
        "final_loss_max_diff": max(losses) - min(losses),
        "losses_agree": max(losses) - min(losses) < 1e-5,
        # compiled kernels round otherwise than eager ones: the graphed contenders' distance from the eager hand loop
        **{f"{c}_loss_diff": abs(rows[c]["final_loss"] - rows["hand"]["final_loss"]) for c in GRAPHS if c in rows},
    }


def report(results: dict) -> None:
    """Print the tables."""
    print(f"# overhead on {results['device']} ({results['machine']})")
    for size, r in results["sizes"].items():
        print(f"\n{size}: {r['steps']} steps ({r['warmup']} warm-up), {r['reps']} fresh processes each")
        head = f"{'contender':<16} {'us/step':>16} {'x hand':>14} {'RSS MiB':>8} {'GPU MiB':>8} {'final loss':>11}"
        print(f"{head} {'ops/step':>8} {'syncs/step':>10}")
        for name, row in r["contenders"].items():
            t, x = row["us_per_step"], row["ratio_to_hand"]
            ops, syncs = (row[k] for k in ("ops_per_step", "syncs_per_step"))
            print(
                f"{name:<16} {t['median']:>9.1f} ±{t['spread']:<5.0f} {x['median']:>7.3f} ±{x['spread']:<5.3f}"
                f" {row['peak_rss_mb']:>8.0f} {mib(row['peak_gpu_mb']):>8} {row['final_loss']:>11.6f}"
                f" {'-' if ops is None else f'{ops:.1f}':>8} {'-' if syncs is None else f'{syncs:.1f}':>10}"
            )
        verdict = "agree" if r["losses_agree"] else "DISAGREE"
        print(f"final losses of hand/runner/lightning {verdict} (max difference {r['final_loss_max_diff']:.2e})")


if __name__ == "__main__":
    main()
