"""The LM -> SAE pipeline: samples/s of an SAE trained on a GPT's live residual stream, the source's forward included,
runner's +experiment=sae_lm against a hand-written loop that does the same work.

    python benchmarks/sae_pipeline.py [--shape gpt2_small|lm] [--layer L] [--cycles 2] [--reps 3] [--device cuda]
        [--precision fp32|bf16] [--source-args KEY=VALUE ...] [--json out.json] [override ...]

The source is a GPT of `--shape` (gpt2_small: 12 layers, d 768, 12 heads, T 1024; lm: the preset's 6 x 128) with
random weights (its forward costs what a trained one's does), on windows of one standard-library package. Both
contenders train the sae_lm preset's SAE (extra arguments are Hydra overrides for both: model.n_latents=12288 ...) on
the residual stream after block `--layer` (default: the middle one), positions 1.. of each window, through a ring of
data.buffer_size activations on the device, half of it refilled by the source when half is served, then reshuffled.
The hand-written loop draws the source's windows from the same loader, runs the embedding and the blocks up to the
hooked one under no_grad, keeps its own ring, and steps the same SAE (same class and settings, Adam as the preset
builds it, the warmup-stable-decay schedule, the decoder renorm). Each contender is timed over whole refill cycles,
from the end of its first step to the end of its last, in one process, alternating; peak GPU memory beside.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name, peak_gpu_mb, synchronize  # noqa: E402
from benchmarks.sae_multi import _compose, make_source, step_clock  # noqa: E402

SHAPES = {"gpt2_small": ["model=gpt2_small"], "lm": []}


def settings(source: Path, layer: int, device: str, precision: str, extra: list[str], steps: int | None = None):
    """The composed sae_lm run both contenders follow (steps: its length; None to read the ring's size first)."""
    overrides = [
        *("+experiment=sae_lm", f"source.checkpoint={source}", f"source.layer={layer}", f"precision={precision}"),
        *("logger=none", "callbacks=none", "checkpoint=none", f"distributed.device={device}", *extra),
    ]
    if steps is not None:  # never validates or logs in between: the steps are measured
        overrides += [f"trainer.max_duration={steps}st", f"trainer.val_interval={steps + 1}st"]
        overrides += [f"trainer.log_interval={steps}st", f"run_dir={source.parent / 'runner-run'}"]
    return _compose(overrides)


def runner_contender(cfg, steps: int, device: str) -> dict:
    """runner's fit of the composed run; seconds from the end of step 1 to the end of the last."""
    from runner.build import build
    from runner.loop import fit

    run, clock = build(cfg), step_clock(steps, device)
    run.callbacks.append(clock)
    fit(run)  # it validates after the last step, the hand loop does not: the peak is read at that step
    return {"s": clock.stamps[1] - clock.stamps[0], "peak_gpu_mb": clock.peak_gpu_mb}


def hand_contender(cfg, source: Path, layer: int, steps: int, device: str) -> dict:
    """The same work by hand: the source's windows, its blocks up to `layer` under no_grad, a ring, the SAE step."""
    from hydra.utils import instantiate

    from runner.build import build_data
    from runner.load import load_trained
    from runner.progress import TrainingProgress
    from runner.schedulers import wsd

    dev = torch.device(device)
    gpt, source_cfg = load_trained(source)
    gpt.to(dev).eval()
    loader = build_data(source_cfg).train_loader()
    windows = iter(())

    @torch.no_grad()
    def fill(n: int) -> torch.Tensor:
        nonlocal windows
        parts = []
        while n > 0:
            batch = next(windows, None)
            if batch is None:  # the next epoch of the source's windows
                windows = iter(loader)
                continue
            x = gpt.embed(batch["tokens"][:, :-1].to(dev, non_blocking=True))
            for block in gpt.blocks[: layer + 1]:
                x = block(x, gpt.rope)
            rows = x[:, 1:].flatten(0, 1)[:n]  # positions 1..: the first is an outlier (source.skip_positions)
            n -= len(rows)
            parts.append(rows)
        return torch.cat(parts)

    capacity, batch = cfg.data.buffer_size, cfg.data.batch_size
    generator = torch.Generator().manual_seed(0)
    sae = instantiate(cfg.model, d_in=gpt.embed.embedding_dim).to(dev)
    optimizer = torch.optim.Adam(sae.parameters(), lr=cfg.optimizer.lr, fused=True)
    progress = TrainingProgress(f"{steps}st", batch_size=batch, batches_per_epoch=steps)
    schedule = wsd(optimizer, progress, warmup=cfg.scheduler.warmup, decay=cfg.scheduler.decay).scheduler
    autocast = torch.autocast(dev.type, torch.bfloat16, enabled=cfg.precision.get("dtype") == "bfloat16")
    ring, order, pos = fill(capacity), torch.randperm(capacity, generator=generator).to(dev), 0
    start = 0.0
    for step in range(1, steps + 1):
        if pos + batch > capacity // 2:  # half served: refill that half, reshuffle the whole ring
            ring = ring.index_put((order[:pos],), fill(pos))
            order, pos = torch.randperm(capacity, generator=generator).to(dev), 0
        x = ring[order[pos : pos + batch]]
        pos += batch
        with autocast:
            loss = sae.training_step(x)["loss"]
        loss.backward()
        optimizer.step()
        sae.after_optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step == 1:
            synchronize(device)
            start = time.perf_counter()
    synchronize(device)
    return {"s": time.perf_counter() - start, "peak_gpu_mb": peak_gpu_mb(device)}


def main() -> None:
    """Make the source, time both contenders `--reps` times alternating, print and write the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="gpt2_small")
    parser.add_argument("--layer", type=int, default=None, help="the hooked block (default: the middle one)")
    parser.add_argument("--cycles", type=int, default=2, help="refill cycles of the ring timed")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--source-args", nargs="*", default=[], help="overrides of the source GPT (+experiment=lm)")
    parser.add_argument("--json", help="write the figures here")
    args, extra = parser.parse_known_args()
    results: dict[str, list[dict]] = {"hand": [], "runner": []}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source"
        shape = [*SHAPES[args.shape], *args.source_args]
        make_source(source, args.device, *shape)
        n_layer = _compose(["+experiment=lm", *shape]).model.n_layer
        layer = n_layer // 2 if args.layer is None else args.layer
        data = settings(source, layer, args.device, args.precision, extra).data
        steps = 1 + args.cycles * (data.buffer_size // 2 // data.batch_size)
        cfg = settings(source, layer, args.device, args.precision, extra, steps)
        for rep in range(args.reps):
            for name in ("hand", "runner") if rep % 2 == 0 else ("runner", "hand"):
                if torch.device(args.device).type == "cuda":
                    gc.collect()  # the last contender's model, ring and optimizer sit in reference cycles: free them
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                torch.manual_seed(rep)
                timed = hand_contender(cfg, source, layer, steps, args.device) if name == "hand" else None
                timed = timed or runner_contender(cfg, steps, args.device)
                timed["samples_per_s"] = (steps - 1) * data.batch_size / timed["s"]
                results[name].append(timed)
    ratios = [r["samples_per_s"] / h["samples_per_s"] for r, h in zip(results["runner"], results["hand"], strict=True)]
    report = {
        "device": args.device,
        "device_name": device_name(args.device),
        "shape": args.shape,
        "layer": layer,
        "precision": args.precision,
        "steps_timed": steps - 1,
        "batch": data.batch_size,
        "buffer_size": data.buffer_size,
        "overrides": extra,
        **{
            f"{name}_samples_per_s": statistics.median(r["samples_per_s"] for r in runs)
            for name, runs in results.items()
        },
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "peak_gpu_mb": {name: max((r["peak_gpu_mb"] or 0) for r in runs) or None for name, runs in results.items()},
    }
    print(
        f"{report['device_name']}; source {args.shape}, hooked after block {layer}; {args.precision}; "
        f"{steps - 1} steps of {data.batch_size} timed, ring {data.buffer_size}"
    )
    for name in results:
        print(
            f"{name:>7}: {report[f'{name}_samples_per_s']:>10.0f} samples/s  peak GPU {report['peak_gpu_mb'][name]} MiB"
        )
    print(f"runner / hand = {report['ratio']:.3f} (each rep: {' '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
