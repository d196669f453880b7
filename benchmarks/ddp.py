"""DDP: 2 ranks against 1 process at the same global batch, with and without gradient accumulation: gloo ranks on the
CPU, or NCCL ranks on 2 GPUs.

    python benchmarks/ddp.py [--device cpu|cuda] [--reps 5] [--steps 200] [--accumulate 4] [--json out.json]
    python benchmarks/ddp.py --smoke          # a few steps, one repetition (tests: a subset, --contenders)
    python benchmarks/ddp.py --contenders ddp # a contender and its one-process baseline only

Contenders, each a fresh job (one process, or torchrun with 2 processes), one thread per process
(OMP_NUM_THREADS=1: 2 ranks use 2 cores, the single process 1 core), the order rotating each repetition:
  single              python -m runner, batch B                                   (B = 256 on the MLP)
  ddp                 torchrun --nproc_per_node=2 -m runner distributed=ddp, 2 ranks x B/2
  single_acc4         python -m runner, B/4 x accumulate 4
  ddp_acc4            runner, 2 ranks x B/8 x accumulate 4 (runner's DDP does no_sync on non-closing micro-batches)
  hand_single ...     the same five ways through a hand-written loop (torch DistributedDataParallel under torchrun):
  hand_ddp_acc4       with no_sync, and
  hand_ddp_acc4_sync  syncing every micro-batch (the reference numbers the DDP issue quotes)
Every contender trains benchmarks.common.Net on the same global batches (runner's GlobalBatchSampler lays out each
optimizer step's samples independently of how they are split over ranks and micro-batches) with AdamW, a per-step
cosine schedule and clipping at 1.0. Reported per optimizer step: the median over processes of rank 0's steady-state
time (common.Stamps), the ratio to the single process with the same accumulation (paired per repetition), the
cost of accumulation, runner against the hand-written loop; startup (launch to the end of step 1, torchrun against
one process) and, from the hand-written DDP jobs, the process-group setup and the DistributedDataParallel wrap alone;
each rank's peak RSS and the final losses (the 2-rank runner and the hand-written DDP loop must agree).

--device (default: cuda when present): on CUDA every process trains on its own GPU (LOCAL_RANK; runner with
distributed.device=auto, which picks it) with NCCL, pinned batches copied without blocking and fused AdamW (runner's
default there), the clock read after torch.cuda.synchronize() at a few steps only, and each rank's peak GPU memory
reported; it needs 2 GPUs and exits with code 2 when there are fewer. On CUDA NCCL forms its communicator at the first
collective, so the hand-written jobs' DDP wrap time includes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    machine,
    median_gpu_mb,
    mib,
    param_groups,
    runner_command,
    spawn,
    splits,
    summary,
    torchrun,
    write_json,
)
from benchmarks.timer import rank_path  # noqa: E402

# name: (runner or hand, processes, accumulates, syncs every micro-batch)
CONTENDERS = {
    "single": ("runner", 1, False, False),
    "ddp": ("runner", 2, False, False),
    "single_acc": ("runner", 1, True, False),
    "ddp_acc": ("runner", 2, True, False),
    "hand_single": ("hand", 1, False, False),
    "hand_ddp": ("hand", 2, False, False),
    "hand_single_acc": ("hand", 1, True, False),
    "hand_ddp_acc": ("hand", 2, True, False),
    "hand_ddp_acc_sync": ("hand", 2, True, True),
}
# each contender's time is divided by that of the single process with the same loop and accumulation
BASELINE = {
    name: ("hand_" if spec[0] == "hand" else "") + "single" + ("_acc" if spec[2] else "")
    for name, spec in CONTENDERS.items()
}
# the final losses that must agree closely: the same global batches, the same gradient all-reduce (no_sync)
LOSS_TOLERANCE = 1e-4
# ... and those that split the same global batches differently (ranks, micro-batches, syncing every micro-batch): the
# same training in another float32 summation order, whose rounding AdamW carries along (2.3e-4 after 200 steps on the
# MLP, from 2.307 before training).
SPLIT_TOLERANCE = 1e-3


def hand(size: str, steps: int, warmup: int, accumulate: int, sync_every: bool, out: str, device: str) -> None:
    """The DDP loop a researcher writes by hand (one process when not under torchrun): rank 0 writes `out`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from runner.data import DataModule, to_device

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = device == "cuda"
    where = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")  # one GPU per process
    if cuda:
        torch.cuda.set_device(where)
    timings: dict[str, float] = {}
    if world > 1:
        started = time.perf_counter()
        dist.init_process_group("nccl" if cuda else "gloo")  # includes waiting for the other rank to arrive
        timings["pg_init_s"] = time.perf_counter() - started
    model = Net(size).to(where)
    micro = SIZES[size][1] // (world * accumulate)
    data = DataModule(splits(size), batch_size=micro, seed=0).train_loader(rank, world, where, accumulate)
    opt = torch.optim.AdamW(param_groups(model), lr=SIZES[size][3], weight_decay=WEIGHT_DECAY, fused=fused(where))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: cosine_factor(t, steps))
    net: torch.nn.Module = model.net
    if world > 1:
        # both ranks at the wrap: time the construction (it broadcasts rank 0's weights), not a wait
        dist.barrier(**({"device_ids": [where.index]} if cuda else {}))
        started = time.perf_counter()
        net = DistributedDataParallel(model.net, device_ids=[where.index] if cuda else None)
        timings["wrap_s"] = time.perf_counter() - started
    stamps, step, epoch, micro_batches = Stamps(warmup, steps, where), 0, 0, 0
    while step < steps:
        data.batch_sampler.set_epoch(epoch)
        for batch in data:
            x, y = to_device(batch, where)
            micro_batches += 1
            closes = micro_batches % accumulate == 0  # an epoch is a whole number of windows here
            skip_sync = world > 1 and not closes and not sync_every
            with net.no_sync() if skip_sync else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(net(x), y)
                (loss / accumulate if accumulate > 1 else loss).backward()
            if not closes:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            stamps.step(step)
            if step == steps:
                break
        epoch += 1
    stamps.write(
        rank_path(out, rank),
        final_loss=final_loss(model, size),
        rank=rank,
        world_size=world,
        rank_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **timings,
    )
    if world > 1:
        dist.destroy_process_group()


def layout(name: str, size: str, accumulate: int) -> tuple[int, int, int]:
    """(processes, micro-batch per process, accumulation) of a contender: the global batch is always SIZES[size][1]."""
    _, ranks, accumulates, _ = CONTENDERS[name]
    acc = accumulate if accumulates else 1
    return ranks, SIZES[size][1] // (ranks * acc), acc


def measure(name: str, size: str, steps: int, warmup: int, accumulate: int, tmp: Path, device: str) -> dict[str, Any]:
    """One fresh job of `name`; rank 0's figures, with the other ranks' under 'other_ranks'."""
    family, _, _, sync_every = CONTENDERS[name]
    ranks, micro, acc = layout(name, size, accumulate)
    out = tmp / f"{name}.json"
    for rank in range(1, ranks):
        rank_path(out, rank).unlink(missing_ok=True)
    if family == "runner":
        ddp = ["distributed=ddp"] if ranks > 1 else []
        overrides = [*ddp, f"trainer.accumulate_grad_batches={acc}"]
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{name}-run-")) / "run"  # a new run needs a new folder
        command = runner_command(
            size, steps, warmup, out, run_dir, *overrides, ranks=ranks, batch_size=micro, device=device
        )
    else:
        launcher = torchrun(ranks) if ranks > 1 else [sys.executable]
        command = [
            *launcher,
            str(Path(__file__).resolve()),
            *("--worker", "hand", "--size", size, "--steps", str(steps), "--warmup", str(warmup)),
            *("--accumulate", str(acc), "--out", str(out), "--device", device),
            *(["--sync-every"] if sync_every else []),
        ]
    result = spawn(command, out, log=tmp / f"{name}.log")
    result["other_ranks"] = [json.loads(rank_path(out, rank).read_text()) for rank in range(1, ranks)]
    return result


def paired(runs: dict[str, list[dict]], a: str, b: str, key: str = "per_step_s") -> dict[str, float]:
    """a / b per repetition: median and half the spread."""
    return summary([x[key] / y[key] for x, y in zip(runs[a], runs[b], strict=True)])


def analyse(runs: dict[str, list[dict]], size: str, accumulate: int) -> dict[str, Any]:
    """The table's rows and the derived figures (every ratio paired by repetition)."""
    rows = {}
    for name, reps in runs.items():
        ranks, micro, acc = layout(name, size, accumulate)
        rows[name] = {
            "layout": f"{ranks} x {micro} x {acc}",
            "ms_per_step": summary([r["per_step_s"] * 1e3 for r in reps]),
            "baseline": BASELINE[name],
            "ratio_to_baseline": paired(runs, name, BASELINE[name]),
            "to_first_step_s": summary([r["to_first_step_s"] for r in reps]),
            "wall_s": summary([r["wall_s"] for r in reps]),
            "rank_peak_rss_mb": statistics.median(r["rank_peak_rss_mb"] for r in reps),
            "rank_peak_gpu_mb": median_gpu_mb(reps),  # rank 0's; None on the CPU
            "final_loss": reps[-1]["final_loss"],
            # DDP keeps the ranks' weights equal: every rank ends on the same loss
            "ranks_agree": all(o["final_loss"] == r["final_loss"] for r in reps for o in r["other_ranks"]),
        }
    pairs = [
        # the figures: DDP against one process at the same global batch
        ("ddp", "single"),
        ("ddp_acc", "single_acc"),
        ("hand_ddp", "hand_single"),
        ("hand_ddp_acc", "hand_single_acc"),
        ("hand_ddp_acc_sync", "hand_single_acc"),
        # what accumulation costs per optimizer step (smaller micro-batches, more of them), one process and DDP
        ("single_acc", "single"),
        ("ddp_acc", "ddp"),
        ("hand_single_acc", "hand_single"),
        ("hand_ddp_acc", "hand_ddp"),
        ("hand_ddp_acc_sync", "hand_ddp"),
        ("hand_ddp_acc_sync", "hand_ddp_acc"),
        # runner against the hand-written loop, configuration by configuration
        *((name, f"hand_{name}") for name in ("single", "ddp", "single_acc", "ddp_acc")),
    ]
    # --contenders runs a subset: the figures of the pairs it holds
    ratios = {f"{a} / {b}": paired(runs, a, b) for a, b in pairs if a in runs and b in runs}
    if {"ddp_acc", "single_acc", "ddp", "single"} <= set(runs):
        # What DDP adds to accumulation beyond what accumulation costs one process: (ddp_acc/single_acc) / (ddp/single)
        ratios["ddp accumulation extra"] = summary(
            [
                (da["per_step_s"] / sa["per_step_s"]) / (d["per_step_s"] / s["per_step_s"])
                for da, sa, d, s in zip(runs["ddp_acc"], runs["single_acc"], runs["ddp"], runs["single"], strict=True)
            ]
        )
    hand_ddp = [r for name in runs if name.startswith("hand_ddp") for r in runs[name]]
    startup = {
        f"{d} - {s} s": summary(
            [x["to_first_step_s"] - y["to_first_step_s"] for x, y in zip(runs[d], runs[s], strict=True)]
        )
        for d, s in (("ddp", "single"), ("hand_ddp", "hand_single"))
        if d in runs and s in runs
    }
    if hand_ddp:  # rank 0's figures from every hand-written DDP job
        startup["process group s"] = summary([r["pg_init_s"] for r in hand_ddp])
        startup["DDP wrap s"] = summary([r["wrap_s"] for r in hand_ddp])
    losses = {name: row["final_loss"] for name, row in rows.items()}
    # runner against the hand-written loop with the same layout: the same arithmetic
    same = [name for name in ("single", "ddp", "single_acc", "ddp_acc") if name in losses and f"hand_{name}" in losses]
    ddp_pair = [abs(losses[name] - losses[f"hand_{name}"]) for name in same] or [0.0]
    return {
        "contenders": rows,
        "ratios": ratios,
        "startup": startup,
        "final_loss_max_diff": max(losses.values()) - min(losses.values()),
        "runner_hand_ddp_loss_diff": max(ddp_pair),
        "losses_agree": max(ddp_pair) < LOSS_TOLERANCE
        and max(losses.values()) - min(losses.values()) < SPLIT_TOLERANCE,
        "ranks_agree": all(row["ranks_agree"] for row in rows.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), choices=["cpu", "cuda"], help="default: cuda if present")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per process")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the clock starts (default: a tenth)")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--size", default="mlp", choices=list(SIZES))
    parser.add_argument("--smoke", action="store_true", help="12 steps, 2 of warm-up, one repetition")
    parser.add_argument(
        "--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS), help="each with its baseline"
    )
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=["hand"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--sync-every", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return hand(args.size, args.steps, args.warmup, args.accumulate, args.sync_every, args.out, args.device)
    if args.device == "cuda" and (torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available()):
        # NCCL cannot put two ranks on one GPU: say so in one line rather than fail inside torchrun
        print(
            f"ddp.py --device cuda needs 2 GPUs with NCCL; this machine has {torch.cuda.device_count()} GPU(s)"
            f"{'' if torch.distributed.is_nccl_available() else ' and no NCCL'} (use --device cpu for gloo ranks)",
            file=sys.stderr,
        )
        sys.exit(2)
    if args.smoke:
        args.reps, args.steps, args.warmup = 1, 12, 2
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    if SIZES[args.size][1] % (2 * args.accumulate):
        parser.error(f"the batch of {args.size} ({SIZES[args.size][1]}) must split into 2 ranks x {args.accumulate}")

    names = list(dict.fromkeys([*args.contenders, *(BASELINE[name] for name in args.contenders)]))
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            # Rotate the order each repetition so no contender always runs first (or just after another).
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                runs[name].append(measure(name, args.size, args.steps, warmup, args.accumulate, Path(tmp), args.device))
                print(
                    f"rep {rep + 1}/{args.reps} {name}: {runs[name][-1]['per_step_s'] * 1e3:.1f} ms/step",
                    file=sys.stderr,
                )
    results = {
        "machine": machine(),
        "device": device_name(args.device),
        "size": args.size,
        "global_batch": SIZES[args.size][1],
        "accumulate": args.accumulate,
        "steps": args.steps,
        "warmup": warmup,
        "reps": args.reps,
        "threads_per_process": 1,
        "initial_loss": final_loss(Net(args.size), args.size),  # the loss before training, for comparison
        **analyse(runs, args.size, args.accumulate),
    }
    report(results)
    write_json(args.json, results)
    if not (results["losses_agree"] and results["ranks_agree"]) or not all(
        math.isfinite(row["ms_per_step"]["median"]) for row in results["contenders"].values()
    ):
        sys.exit("the contenders disagree on the final loss (or a rank on its weights): see the table")


def report(results: dict[str, Any]) -> None:
    """Print the tables."""
    acc = results["accumulate"]
    print(f"# ddp on {results['device']} ({results['machine']})")
    print(
        f"\n{results['size']}: global batch {results['global_batch']}, {results['steps']} optimizer steps "
        f"({results['warmup']} warm-up), {results['reps']} fresh jobs each, one thread per process; "
        f"layout = processes x micro-batch x accumulation; _acc = accumulation x{acc}"
    )
    print(
        f"{'contender':<18} {'layout':>11} {'ms/step':>14} {'x single (same acc)':>20} {'to 1st step s':>14}"
        f" {'RSS MiB/rank':>13} {'GPU MiB/rank':>13} {'final loss':>11}"
    )
    for name, row in results["contenders"].items():
        t, x, f = row["ms_per_step"], row["ratio_to_baseline"], row["to_first_step_s"]
        print(
            f"{name:<18} {row['layout']:>11} {t['median']:>7.1f} ±{t['spread']:<5.1f} {x['median']:>12.3f} "
            f"±{x['spread']:<6.3f} {f['median']:>6.2f} ±{f['spread']:<5.2f} {row['rank_peak_rss_mb']:>13.0f}"
            f" {mib(row['rank_peak_gpu_mb']):>13} {row['final_loss']:>11.6f}"
        )
    print("\npaired ratios per optimizer step (median ± half-spread):")
    for key, value in results["ratios"].items():
        print(f"  {key:<38} {value['median']:.3f} ± {value['spread']:.3f}")
    print("startup (launch to the end of step 1; hand-written DDP jobs: rank 0's setup):")
    for key, value in results["startup"].items():
        print(f"  {key:<38} {value['median']:+.3f} ± {value['spread']:.3f}")
    verdict = "agree" if results["losses_agree"] else "DISAGREE"
    print(
        f"final losses {verdict} (runner vs hand, same layout {results['runner_hand_ddp_loss_diff']:.2e}, tolerance "
        f"{LOSS_TOLERANCE:g}; all contenders {results['final_loss_max_diff']:.2e}, tolerance {SPLIT_TOLERANCE:g}; "
        f"before training {results['initial_loss']:.6f}); ranks end on equal weights: "
        f"{results['ranks_agree']}"
    )


if __name__ == "__main__":
    main()
