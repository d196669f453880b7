"""SAELens's own synthetic-data trainer on SynthSAEBench's world (run by benchmarks/synth_bench.py in SAELens's
virtualenv): `python saelens_synth.py JOB.json`.

This is SAELens's SyntheticSAERunner as its SynthSAEBench page runs it (a SyntheticModelConfig, a training config of
the architecture, SAETrainer with Adam, gradient clipping at 1.0 and its dead-latent window), with two changes so that
it trains on runner's very samples: the world is built from the same settings and seed (SAELens's generator and
runner's are bit for bit the same on the CPU), and each training batch is drawn after seeding the global generator
with the seed runner draws that batch from (`seeds` in the job, one per step), where SyntheticSAERunner would draw
every batch from one running stream. The first and last batches are written back so the caller can check that both
tools trained on the same data. The final SAE is saved by SAELens's own save_inference_model (its cfg.json and
sae_weights.safetensors: BatchTopK and Matryoshka as JumpReLU, at their learned thresholds), which runner's scorer
reads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def world(c: dict[str, Any]) -> Any:
    """SAELens's SyntheticModelConfig of runner's data.splits settings `c` (world_seed is the model's seed)."""
    from sae_lens.synthetic import (
        FoldedNormalMagnitudeConfig,
        HierarchyConfig,
        LinearMagnitudeConfig,
        ZipfianFiringProbabilityConfig,
    )
    from sae_lens.synthetic.synthetic_model import (
        LowRankCorrelationConfig,
        OrthogonalizationConfig,
        SyntheticModelConfig,
    )

    branching = c["branching"] if isinstance(c["branching"], int) else tuple(c["branching"])
    hierarchy = None
    if c["roots"] > 0:
        hierarchy = HierarchyConfig(
            total_root_nodes=c["roots"],
            branching_factor=branching,
            max_depth=c["depth"],
            mutually_exclusive_portion=c["mutually_exclusive"],
            compensate_probabilities=c["compensate"],
        )
    ortho = OrthogonalizationConfig(num_steps=c["ortho_steps"], lr=c["ortho_lr"]) if c["ortho_steps"] > 0 else None
    return SyntheticModelConfig(
        num_features=c["num_features"],
        hidden_dim=c["d"],
        firing_probability=ZipfianFiringProbabilityConfig(
            exponent=c["zipf_exponent"], max_prob=c["max_prob"], min_prob=c["min_prob"]
        ),
        hierarchy=hierarchy,
        orthogonalization=ortho,
        correlation=LowRankCorrelationConfig(rank=c["rank"], correlation_scale=c["correlation_scale"]),
        std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=c["std_magnitude"][0], std=c["std_magnitude"][1]),
        mean_firing_magnitudes=LinearMagnitudeConfig(start=c["mean_magnitude"][0], end=c["mean_magnitude"][1]),
        bias=c["bias"],
        seed=c["world_seed"],
    )


def sae_config(job: dict[str, Any]) -> Any:
    """SAELens's training config of the job's architecture; everything not named here is SAELens's default."""
    import sae_lens

    d, n, arch = job["world"]["d"], job["n_latents"], job["arch"]
    if arch == "topk":
        return sae_lens.TopKTrainingSAEConfig(d_in=d, d_sae=n, k=job["k"])
    if arch == "batchtopk":
        return sae_lens.BatchTopKTrainingSAEConfig(d_in=d, d_sae=n, k=job["k"])
    if arch == "matryoshka":
        # the published benchmark's runs train with the per-level aux loss (SAELens's default is off)
        return sae_lens.MatryoshkaBatchTopKTrainingSAEConfig(
            d_in=d, d_sae=n, k=job["k"], matryoshka_widths=list(job["widths"]), use_matryoshka_aux_loss=True
        )
    if arch == "jumprelu":
        # Gemma Scope 2's quadratic penalty around a target L0: SAELens's built-in way to ask for an L0. The
        # thresholds start at 0.5 with decoder rows at norm 0.5, the published benchmark's JumpReLU runs' start: from
        # SAELens's defaults (0.01, 0.1) on raw activations nearly every latent fires (L0 ~800 at step 100) and Adam
        # moves a threshold by about lr a step, too slowly for a short run. The coefficient does not change that pace
        # (1 and 10 both leave L0 at 44 after 256 steps, thresholds 0.5 -> 1.1): more steps or a higher start do
        return sae_lens.JumpReLUTrainingSAEConfig(
            d_in=d,
            d_sae=n,
            jumprelu_sparsity_loss_mode="quadratic",
            target_l0=job["k"],
            l0_coefficient=job["coeff"],
            jumprelu_init_threshold=0.5,
            decoder_init_norm=0.5,
        )
    if arch == "relu":
        return sae_lens.StandardTrainingSAEConfig(d_in=d, d_sae=n, l1_coefficient=job["coeff"])
    raise SystemExit(f"unknown architecture {arch!r}")


def main() -> None:
    """Train one SAE as the job says and write its folder, the checked batches and the seconds."""
    torch.set_num_threads(1)
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    from sae_lens import LoggingConfig
    from sae_lens.synthetic import synthetic_sae_runner as runner_module
    from sae_lens.synthetic.synthetic_model import SyntheticModel
    from sae_lens.synthetic.training import SyntheticActivationIterator

    seeds, kept = job["seeds"], {}

    class SameBatches(SyntheticActivationIterator):
        """SAELens's iterator, each batch drawn from the seed runner draws that batch from."""

        step = 0

        def next_batch(self) -> torch.Tensor:
            if self.step >= len(seeds):
                raise RuntimeError(f"SAELens asked for batch {self.step + 1} of {len(seeds)}")
            torch.manual_seed(seeds[self.step])
            batch = super().next_batch()
            if self.step in (0, len(seeds) - 1):
                kept[f"batch_{self.step}"] = batch.clone()
            self.step += 1
            return batch

    runner_module.SyntheticActivationIterator = SameBatches  # the one change to SyntheticSAERunner's loop
    model_cfg = world(job["world"])
    model = SyntheticModel(model_cfg)
    torch.manual_seed(job["seed"])  # the SAE's initial weights
    steps = len(seeds)
    cfg = runner_module.SyntheticSAERunnerConfig(
        synthetic_model=model_cfg,
        sae=sae_config(job),
        training_samples=steps * job["batch"],
        batch_size=job["batch"],
        lr=job["lr"],
        lr_warm_up_steps=job["warmup"],
        lr_decay_steps=job["decay"],
        device="cpu",
        checkpoint_path=None,
        output_path=str(out),
        eval_samples=0,
        run_final_eval=False,
        logger=LoggingConfig(log_to_wandb=False),
    )
    start = time.perf_counter()
    runner_module.SyntheticSAERunner(cfg, override_synthetic_model=model).run()
    seconds = time.perf_counter() - start
    from safetensors.torch import save_file

    save_file(kept, str(out / "batches.safetensors"))
    (out / "timing.json").write_text(json.dumps({"train_s": seconds, "steps": steps}))


if __name__ == "__main__":
    main()
