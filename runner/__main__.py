"""`python -m runner`: compose the config, build the run, fit, write the summary, tear down."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner import ConfigError
from runner.build import build, run_info
from runner.loggers import run_metadata, save_weights, write_json
from runner.loop import Run, fit


def summarize(run: Run, wall_time_s: float) -> dict[str, Any]:
    """What summary.json holds."""
    p = run.progress
    best = run.best
    return {
        "stop_reason": run.stop_reason,
        "progress": {k: getattr(p, k) for k in ("step", "micro_batch", "epoch", "samples", "tokens")},
        "metrics": run.metrics,
        "best": {"monitor": run.monitor, "value": best.value, "step": best.step} if best.value is not None else None,
        "nonfinite_steps": run.nonfinite_steps,
        "wall_time_s": wall_time_s,
        "samples_per_s": p.samples / wall_time_s if wall_time_s > 0 else 0.0,
    }


def _fail(error: Exception, code: int) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train one run; return the best value of `monitor` so that sweepers can optimize it."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run = build(cfg)
    except ConfigError as error:
        _fail(error, 2)
    if run.distributed.is_main:
        write_json(run_dir / "run.json", run_metadata(str(run.device), run.world_size))
    started, summary = time.perf_counter(), None
    try:
        for logger in run.loggers:
            logger.start(run_info(run, cfg))
        fit(run)
        summary = summarize(run, time.perf_counter() - started)
    except ConfigError as error:
        _fail(error, 2)
    except KeyboardInterrupt:
        run.stop_reason = "interrupted"
        summary = summarize(run, time.perf_counter() - started)
    finally:
        if summary is not None and run.distributed.is_main:
            save_weights(run.task, run_dir / "model.safetensors")
            write_json(run_dir / "summary.json", summary)
        for logger in run.loggers:
            logger.close(summary)
        run.distributed.close()
    if run.stop_reason == "interrupted":
        sys.exit(130)
    if run.stop_reason == "nonfinite":
        message = RuntimeError(
            f"stopped after {run.max_nonfinite_steps} optimizer steps in a row with a non-finite loss "
            "or gradient norm (trainer.max_nonfinite_steps). Lower the learning rate, enable "
            "trainer.gradient_clip_val, or check the data for NaN/inf."
        )
        if HydraConfig.get().mode != RunMode.MULTIRUN:  # in a sweep, one diverged trial must not end the others
            _fail(message, 3)
        print(f"error: {message}", file=sys.stderr)
        return float("nan")
    return run.best.value


if __name__ == "__main__":
    main()
