"""SAELens's own SAETrainer on an activation file (run by benchmarks/sae_peers.py in SAELens's virtualenv).

SAELens trains from any iterator of activation batches (`SAETrainer(cfg, sae, data_provider)`; its language-model
runner builds that iterator from a HookedTransformer). Here the iterator yields the file's rows in order, `batch` at a
time, after one extra copy of the first batch that the trainer reads to estimate the input scale
(`n_batches_for_norm_estimate=1`: the first batch, as runner's SAE estimates it), so training sees exactly the same
batches as the other contenders. Everything else is SAELens's TopKTrainingSAE and SAETrainer as its users run them:
decoder rows initialised at norm 0.1 with the encoder their transpose, b_dec zero, codes rescaled by the decoder norms
instead of a renorm, MSE loss, AuxK over dead latents, Adam, gradient clipping at 1.0; with precision bf16, its
trainer's autocast.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.driver import batches, job, own_fve, stamp_steps, write  # noqa: E402


def main() -> None:
    spec = job()
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    torch.manual_seed(spec["seed"])
    d = int(next(batches(spec["train"], 1)).shape[1])
    sae = TopKTrainingSAE(
        TopKTrainingSAEConfig(
            d_in=d,
            d_sae=spec["n_latents"],
            k=spec["k"],
            aux_loss_coefficient=spec["auxk_coeff"],  # its MSE and AuxK are both unnormalised: the same ratio
            normalize_activations="expected_average_only_in",
            dtype="float32",
            device=spec["device"],
        )
    )
    lr, warm, steps = spec["lr"], spec["lr_warmup_steps"], spec["steps"]
    cfg = SAETrainerConfig(
        total_training_samples=steps * spec["batch"],
        train_batch_size_samples=spec["batch"],
        lr=lr,
        lr_end=lr,  # the constant stage's LR, from which the decay starts
        lr_scheduler_name="constant",
        lr_warm_up_steps=warm,
        lr_decay_steps=steps - warm,
        dead_feature_window=spec["dead_steps"],
        feature_sampling_window=steps,
        n_batches_for_norm_estimate=1,
        device=spec["device"],
        autocast=spec["precision"] == "bf16",
    )
    first = next(batches(spec["train"], spec["batch"]))
    provider = itertools.chain([first], batches(spec["train"], spec["batch"]))
    trainer = SAETrainer(cfg, sae, provider)
    stamps = stamp_steps(trainer.optimizer, spec)
    trainer.fit()  # folds the input scale into the weights at the end
    sae.eval()
    own = {
        "fve": own_fve(lambda x: sae(x.to(sae.device)).float().cpu(), spec),
        "tool": "sae_lens",
        "dead": int(trainer.dead_neurons.sum()),
    }
    with torch.no_grad():
        norm = sae.W_dec.norm(dim=-1) if sae.cfg.rescale_acts_by_decoder_norm else torch.ones(sae.cfg.d_sae)
        weights = {
            "W_enc": sae.W_enc * norm,  # codes scaled by the decoder norms, decoded by the unit-norm rows
            "b_enc": sae.b_enc * norm,
            "W_dec": sae.W_dec / norm[:, None],
            "b_dec": sae.b_dec,
            "center": sae.b_dec * sae.cfg.apply_b_dec_to_input,
            "scale": torch.ones(()),
        }
    write(spec, stamps, weights, own)


if __name__ == "__main__":
    main()
