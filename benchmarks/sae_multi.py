"""Several SAEs from one activation pass: +experiment=sae_lm training four SAEs (model=sae_multi) against one, on the
live residual stream of a GPT, in one process.

    python benchmarks/sae_multi.py [--n-layer 12] [--layer 11] [--cycles 3] [--reps 3] [--device cpu|cuda]
                                   [--json out.json] [override ...]

The source is a GPT of `--n-layer` blocks (d_model 128, seq_len 128: the lm experiment's width) with random weights:
its forward costs what a trained one's does. Both contenders train from the same ring of activations
(data.buffer_size 65,536, batch 1024: the source fills half the ring every 32 steps) over `--cycles` whole refill
cycles, timed from the end of the first step (the set-up, the ring's first fill and compile-free warm-up excluded) to
the end of the last; `one` is the sae_lm preset's TopK SAE (2048 latents, k=32), `four` is model=sae_multi with
ks=[16,32,64,128] on the same base. Prints the wall time of each, their ratio (the issue's bound: <= 1.5 when the
source's forward dominates) and the share of `one`'s time spent in the source's forward. Extra arguments are Hydra
overrides for both contenders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name, peak_gpu_mb, synchronize  # noqa: E402

CONTENDERS = {
    "one": [],
    "four": ["model=sae_multi", "model.ks=[16,32,64,128]"],
}


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from runner.config import resolvers

    resolvers.register()
    with initialize_config_module("runner.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


def make_source(folder: Path, device: str, *model: str) -> None:
    """A finished-run folder (model.safetensors, .hydra/config.yaml) of a randomly initialised GPT (`model`: overrides
    of +experiment=lm's, e.g. model.n_layer=12), on a small corpus (one package of the standard library: the windows
    are inputs, their text does not matter here)."""
    from omegaconf import OmegaConf

    from runner.build import build
    from runner.ckpt.weights import save_weights

    corpus = Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"
    cfg = _compose(
        [
            "+experiment=lm",
            *model,
            f"data.paths=[{corpus}]",
            f"data.cache_dir={folder / 'cache'}",
            "data.val_every=2",
            "data.val_windows=16",  # the SAEs' final validation reads these: it is not timed
            f"run_dir={folder}",
            "logger=none",
            "callbacks=none",
            "checkpoint=none",
            f"distributed.device={device}",
        ]
    )
    run = build(cfg)
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    save_weights(run.task, folder / "model.safetensors")
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")


def step_clock(last: int, device: str):
    """A runner callback that reads the clock (after the device's work) at the end of step 1 and of step `last`:
    its `stamps`; and the peak GPU memory at `last` (`peak_gpu_mb`)."""
    from runner.run import Callback

    class Clock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.peak_gpu_mb: float | None = None  # at the last step: training's, not the validation's after it

        def on_optimizer_step(self, run) -> None:
            if run.progress.step in (1, last):
                synchronize(device)
                self.stamps.append(time.perf_counter())
            if run.progress.step == last:
                self.peak_gpu_mb = peak_gpu_mb(device)

    return Clock()


def time_one(name: str, source: Path, layer: int, cycles: int, device: str, extra: list[str]) -> dict:
    """Train one contender for `cycles` refill cycles after a first step; its wall time and the source's share."""
    from experiments.sae.sources.source import SourceModel
    from runner.build import build
    from runner.loop import fit

    base = ["+experiment=sae_lm", f"source.checkpoint={source}", f"source.layer={layer}", *CONTENDERS[name]]
    data = _compose([*base, *extra]).data
    refill = data.buffer_size // 2 // data.batch_size  # steps between two refills of the ring
    steps = 1 + cycles * refill
    cfg = _compose(
        [
            *base,
            f"trainer.max_duration={steps}st",
            f"trainer.val_interval={steps + 1}st",  # never validates: the step is measured
            f"trainer.log_interval={steps}st",
            "logger=none",
            "callbacks=none",
            "checkpoint=none",
            f"run_dir={source.parent / name}",
            f"distributed.device={device}",
            *extra,
        ]
    )
    run = build(cfg)
    clock = step_clock(steps, device)
    stamps = clock.stamps
    forward = {"s": 0.0}
    activations = SourceModel.activations

    def timed(self, batch):
        synchronize(device)
        start = time.perf_counter()
        out = activations(self, batch)
        synchronize(device)
        if len(stamps) == 1:  # inside the timed steps: not the ring's first fill, nor the final validation
            forward["s"] += time.perf_counter() - start
        return out

    run.callbacks.append(clock)
    SourceModel.activations = timed
    try:
        fit(run)
    finally:
        SourceModel.activations = activations
    wall = stamps[1] - stamps[0]
    return {"wall_s": wall, "source_share": forward["s"] / wall, "steps": steps - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-layer", type=int, default=12, help="the source GPT's blocks")
    parser.add_argument("--layer", type=int, default=None, help="the hooked block (default: the last)")
    parser.add_argument("--cycles", type=int, default=3, help="refill cycles of the ring timed (32 steps each)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--json", help="write the figures here")
    args, extra = parser.parse_known_args()
    layer = args.n_layer - 1 if args.layer is None else args.layer
    results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source"
        make_source(source, args.device, f"model.n_layer={args.n_layer}")
        for rep in range(args.reps):
            for name in CONTENDERS if rep % 2 == 0 else reversed(list(CONTENDERS)):  # alternate who goes first
                results[name].append(time_one(name, source, layer, args.cycles, args.device, extra))
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    one = [r["wall_s"] for r in results["one"]]
    four = [r["wall_s"] for r in results["four"]]
    ratios = [b / a for a, b in zip(one, four, strict=True)]
    share = statistics.median(r["source_share"] for r in results["one"])
    report = {
        "device": args.device,
        "device_name": device_name(args.device),
        "n_layer": args.n_layer,
        "layer": layer,
        "steps_timed": results["one"][0]["steps"],
        "one_s": statistics.median(one),
        "four_s": statistics.median(four),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "source_share_of_one": share,
        "overrides": extra,
    }
    print(f"device {report['device_name']}; source GPT {args.n_layer} blocks, hooked after block {layer}")
    print(f"{'contender':>10} {'median s':>10} {'runs s':>30}")
    for name, times in (("one SAE", one), ("four SAEs", four)):
        print(f"{name:>10} {statistics.median(times):>10.2f} {' '.join(f'{t:.2f}' for t in times):>30}")
    print(f"four / one = {report['ratio']:.3f} (each rep: {' '.join(f'{r:.3f}' for r in ratios)})")
    print(f"the source's forward: {share:.0%} of one SAE's wall time")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
