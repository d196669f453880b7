"""Distributed checkpoints on CPU ranks: rank 0's host memory during a checkpoint, the time the step loop waits per
checkpoint and the resume time, checkpoint.format=files against dcp (synchronous and async), distributed=fsdp on gloo.

    python benchmarks/checkpoint_dcp.py [--ranks 2 4] [--width 256] [--layers 13] [--steps 20] [--interval 5]
                                        [--dir DIR] [--json out.json]

The model is the lm preset's GPT (experiments/lm: byte vocabulary, SwiGLU, tied embeddings) at --width x --layers
(default 256 x 13, 10.4M parameters: 8x the preset's 128 x 6), windows of 64 bytes, 4 windows per rank, AdamW: a
checkpoint holds 12 bytes a parameter (fp32 weights and two moments), 125 MB. Every contender is a fresh torchrun job
of `python -m runner +experiment=lm` (one thread per rank), a checkpoint every --interval steps:
  none       checkpoint=none: the training's own peak, the baseline the others add to
  files      checkpoint.format=files: every tensor gathered to rank 0, which snapshots it and writes the files
  dcp        checkpoint.format=dcp: each rank writes its own shards (torch.distributed.checkpoint)
  dcp_async  dcp with checkpoint.async=true: the loop goes on at once; the shards are copied to CPU memory in the
             background, and the next optimizer step waits for the copy
Figures, rank 0's: its peak RSS over the job (VmHWM, read at the end of training) less the baseline's, i.e. what
checkpointing adds to its peak (VmHWM cannot be reset, so every contender is its own job); the RSS sampled every
millisecond from a save's start until its files are sealed, less the RSS at its start; the loop's wait per checkpoint,
from summary.json's startup table (`checkpoints`: the saves and the wait for the last one at the end) and per save as
the median time in Checkpoint.save plus, with async, the next optimizer step's wait for the copy; the steps' own
time (summary.json's `training_s`: a background copy that slows them shows there); the resume (the `resume` phase of
a second launch, resume=auto, that loads the last checkpoint). The machine is shared and has 2 cores: 4 ranks
oversubscribe them, and timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, machine, torchrun, write_json  # noqa: E402
from runner.ckpt.callback import Checkpoint  # noqa: E402
from runner.run import Callback, Run  # noqa: E402

CONTENDERS = {
    "none": ["checkpoint=none", "+callbacks.peak._target_=benchmarks.checkpoint_dcp.Peak"],
    "files": ["checkpoint.format=files"],
    "dcp": ["checkpoint.format=dcp"],
    "dcp_async": ["checkpoint.format=dcp", "checkpoint.async=true"],
}


ENV: dict[str, str] = {}  # the jobs' extra environment (--malloc-arena-max)


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak so far (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _report(out: str, run: Run, **figures: Any) -> None:
    Path(out, f"probe-rank{run.strategy.rank}.json").write_text(json.dumps({"hwm_mb": rss_mb("VmHWM"), **figures}))


class Peak(Callback):
    """The baseline's probe: each rank's peak RSS at the end of training."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, run: Run) -> None:
        """Write this rank's VmHWM."""
        _report(self.out, run)


class Probe(Checkpoint):
    """The checkpoint callback, measured: each save's wait in the loop and the RSS it adds until its files are
    sealed (sampled every millisecond), and the rank's peak RSS at the end of training."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out, self.saves, self.open, self.peak = out, [], threading.Event(), 0.0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.open.wait()
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.001)

    def save(self, run: Run, monitor_value: float | None = None) -> Path:
        """Checkpoint.save, timed; the sampling window opens."""
        self.wait()  # the save before sealed first: its window is closed
        record = {"rss_before_mb": rss_mb()}
        self.saves.append(record)
        self.peak = record["rss_before_mb"]
        self.open.set()
        started = time.perf_counter()
        folder = super().save(run, monitor_value)
        record["wait_s"] = time.perf_counter() - started
        if self.thread is None and not run.strategy.is_main and self.format_of(run) != "dcp":
            self._close()  # files: the other ranks' part ends with the gather
        return folder

    def on_before_optimizer_step(self, run: Run) -> None:
        """The wait for an async save's background copy, added to that save's wait."""
        started = time.perf_counter()
        super().on_before_optimizer_step(run)
        if self.saves:
            self.saves[-1]["wait_s"] += time.perf_counter() - started

    def _finish(self, folder: Path, write: Any) -> None:
        super()._finish(folder, write)
        self._close()

    def _close(self) -> None:
        self.open.clear()
        if self.saves and "rise_mb" not in self.saves[-1]:
            self.saves[-1]["rise_mb"] = max(self.peak, rss_mb()) - self.saves[-1]["rss_before_mb"]

    def on_fit_end(self, run: Run) -> None:
        """Wait for the last save, then write this rank's figures."""
        super().on_fit_end(run)
        _report(self.out, run, saves=self.saves)


def overrides(width: int, layers: int, steps: int) -> list[str]:
    """The job's command line: the lm preset's GPT at width x layers on one stdlib package's sources."""
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"
    return [
        "+experiment=lm",
        f"data.paths=[{corpus}]",
        "data.val_every=2",
        "data.val_windows=16",
        f"model.d_model={width}",
        f"model.n_layer={layers}",
        "model.n_head=4",
        "model.seq_len=64",
        "data.batch_size=4",
        "callbacks=none",
        "logger=none",
        "distributed=fsdp",
        "distributed.units=[Block]",  # the tied embedding and head stay in the root group
        f"trainer.max_duration={steps}st",
        f"trainer.val_interval={steps}st",
    ]


def launch(ranks: int, args: list[str], run_dir: Path) -> dict[str, Any]:
    """One torchrun job; its summary.json and rank 0's probe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", **ENV}
    command = [*torchrun(ranks), "-m", "runner", *args, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    probe = json.loads((run_dir / "probe-rank0.json").read_text())
    return {"summary": summary, "probe": probe}


def phase(summary: dict[str, Any], name: str) -> tuple[float, int]:
    """(seconds, count) of a phase of summary.json's startup table."""
    value = summary["startup"]["phases"].get(name, 0.0)
    return (value["s"], value["count"]) if isinstance(value, dict) else (value, 1)


def contender(ranks: int, name: str, base: list[str], root: Path) -> dict[str, Any]:
    """A contender's job (and, with checkpoints, the launch that resumes its last one): rank 0's figures."""
    run_dir = root / f"{name}-{ranks}"
    key = "callbacks.peak" if name == "none" else "checkpoint"
    job = launch(ranks, [*base, *CONTENDERS[name], f"+{key}.out={run_dir}"], run_dir)
    row: dict[str, Any] = {"ranks": ranks, "format": name, "hwm_mb": job["probe"]["hwm_mb"]}
    # the steps' own time (no phase: checkpoints and validation apart): a background copy that slows them shows here
    row["training_s"] = job["summary"]["startup"]["training_s"]
    if name == "none":
        return row
    saves = job["probe"]["saves"]
    seconds, count = phase(job["summary"], "checkpoints")
    folder = max((run_dir / "checkpoints").glob("step-*"))
    row |= {
        "saves": len(saves),
        "wait_per_save_s": statistics.median(s["wait_s"] for s in saves),
        "checkpoints_phase_s": seconds,
        "checkpoints_phase_count": count,
        "rise_during_save_mb": max(s.get("rise_mb", 0.0) for s in saves),
        "checkpoint_mb": sum(f.stat().st_size for f in folder.iterdir()) / 2**20,
    }
    resumed = launch(ranks, [*base, *CONTENDERS[name], f"+checkpoint.out={run_dir}", "resume=auto"], run_dir)
    row["resume_s"] = phase(resumed["summary"], "resume")[0]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a markdown table, each checkpointing contender against its world's baseline and files."""
    lines = [
        "| ranks | format | rank-0 peak RSS MiB | + over no checkpoint | RSS rise in a save | wait per save s | "
        "`checkpoints` phase s (count) | steps s | resume s | checkpoint MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r["ranks"]: r["hwm_mb"] for r in rows if r["format"] == "none"}
    for r in rows:
        if r["format"] == "none":
            lines.append(f"| {r['ranks']} | none | {r['hwm_mb']:.0f} | - | - | - | - | {r['training_s']:.2f} | - | - |")
            continue
        r["added_mb"] = r["hwm_mb"] - base[r["ranks"]]
        lines.append(
            f"| {r['ranks']} | {r['format']} | {r['hwm_mb']:.0f} | {r['added_mb']:.0f} | "
            f"{r['rise_during_save_mb']:.0f} | {r['wait_per_save_s']:.3f} | {r['checkpoints_phase_s']:.2f} "
            f"({r['checkpoints_phase_count']}) | {r['training_s']:.2f} | {r['resume_s']:.2f} | "
            f"{r['checkpoint_mb']:.0f} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, per world size: dcp's added peak <= files' / world + 10%; async's wait <= 10% of sync's."""
    found = []
    for ranks in sorted({r["ranks"] for r in rows}):
        by = {r["format"]: r for r in rows if r["ranks"] == ranks}
        files, dcp, async_ = by["files"], by["dcp"], by["dcp_async"]
        for name, r in (("dcp", dcp), ("dcp_async", async_)):
            for what, value in (("added peak", r["added_mb"]), ("rise in a save", r["rise_during_save_mb"])):
                rel = files["added_mb"] if what == "added peak" else files["rise_during_save_mb"]
                bound = rel / ranks * 1.1
                found.append(
                    f"{ranks} ranks, {name}: {what} {value:.0f} MiB vs files' {rel:.0f} / {ranks} + 10% = {bound:.0f}"
                    f" -> {'met' if value <= bound else 'missed'}"
                )
        ratio = async_["wait_per_save_s"] / dcp["wait_per_save_s"]
        found.append(
            f"{ranks} ranks: async waits {ratio:.0%} of a synchronous dcp save -> "
            f"{'met' if ratio <= 0.1 else 'missed'} (target <= 10%)"
        )
    return found


def main() -> None:
    """Run every contender on every world size, print the table and the targets."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--device", choices=["cpu"], default="cpu", help="gloo on the CPU: the table is a CPU's")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--dir", help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--malloc-arena-max",
        type=int,
        help="MALLOC_ARENA_MAX for every job: glibc gives each thread that allocates an arena of its own, and what "
        "the save's threads (staging, DCP's writer, the seal) free stays in theirs",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.malloc_arena_max:
        ENV["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    base = overrides(args.width, args.layers, args.steps)
    probed = ["checkpoint._target_=benchmarks.checkpoint_dcp.Probe", f"checkpoint.interval={args.interval}st"]
    probed += ["checkpoint.keep_last=1"]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for ranks in args.ranks:
            for name in CONTENDERS:
                rows.append(contender(ranks, name, base if name == "none" else [*base, *probed], Path(root)))
                print(f"{ranks} ranks, {name}: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{machine()}; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"GPT {args.width} x {args.layers}, {args.steps} steps, a checkpoint every {args.interval}, fsdp on gloo")
    print(f"environment: {ENV or 'as given'}")
    print(table(rows))
    print("\n".join(targets(rows)))
    write_json(
        args.json, {"machine": machine(), "device": args.device, "env": ENV, "rows": rows, "targets": targets(rows)}
    )


if __name__ == "__main__":
    main()
