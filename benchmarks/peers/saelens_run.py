"""SAELens's own SAETrainer on an activation file (run by benchmarks/sae_peers.py in SAELens's virtualenv).

SAELens trains from any iterator of activation batches (`SAETrainer(cfg, sae, data_provider)`; its language-model
runner builds that iterator from a HookedTransformer). Here the iterator yields the file's rows in order, `batch` at a
time, after one extra copy of the first batch that the trainer reads to estimate the input scale
(`n_batches_for_norm_estimate=1`: the first batch, as runner's SAE estimates it), so training sees exactly the same
batches as the other contenders. Everything else is SAELens's TopKTrainingSAE and SAETrainer as its users run them:
decoder rows initialised at norm 0.1 with the encoder their transpose, b_dec zero, codes rescaled by the decoder norms
instead of a renorm, MSE loss, AuxK over dead latents, Adam, gradient clipping at 1.0; with precision bf16, its
trainer's autocast.

Transcoders (`d_out` in the job): SAELens 6.54 trains none. Its Transcoder and SkipTranscoder are inference classes (a
ReLU encoder, no training forward pass, no TrainingSAE counterpart), and its training runner hooks one point and
reconstructs it. So the transcoder here is SAELens's TopK training SAE given its Transcoder's shapes and its
SkipTranscoder's skip connection (TopKTranscoder below: W_enc [d_in, n] and W_dec [n, d_out] drawn independently as
Transcoder.initialize_weights draws them, then TrainingSAE's decoder rows at norm 0.1; no b_dec subtracted from the
input, as TranscoderConfig requires; W_skip [d_out, d_in] zero, added as x @ W_skip.T), with the target in place of
the input where the training forward pass reads it (MSE and the AuxK residual), trained by SAETrainer itself on rows
[x | y]. Its one activation scaler multiplies both halves by sqrt(d_in) / E||x|| of the first batch's inputs (the
expected_average_only_in estimate on the input hook), folded into the weights at the end as for an SAE (W_skip is
unchanged by it).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.driver import batches, job, own_fve, split, stamp_steps, write  # noqa: E402


def transcoder_class(d_out: int, skip: bool) -> type:
    """SAELens's TopKTrainingSAE with its Transcoder's shapes (input d_in, target d_out) and, with `skip`, its
    SkipTranscoder's skip connection; trained on rows [x | y]."""
    from dataclasses import replace

    from sae_lens import TopKTrainingSAE
    from sae_lens.saes.sae import TrainStepInput, TrainStepOutput
    from torch import nn

    class TopKTranscoder(TopKTrainingSAE):
        def __init__(self, cfg: object) -> None:
            super().__init__(cfg)
            if skip:  # SkipTranscoder's: [d_out, d_in], zero at the start
                self.W_skip = nn.Parameter(torch.zeros(d_out, self.cfg.d_in, dtype=self.dtype, device=self.device))

        def initialize_weights(self) -> None:
            # Transcoder.initialize_weights, then TrainingSAE's decoder norm (its `heuristic` init) and TopK's b_enc
            make = {"dtype": self.dtype, "device": self.device}
            self.b_dec = nn.Parameter(torch.zeros(d_out, **make))
            W_dec = nn.init.kaiming_uniform_(torch.empty(self.cfg.d_sae, d_out, **make))
            if self.cfg.decoder_init_norm is not None:
                W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True) * self.cfg.decoder_init_norm
            self.W_dec = nn.Parameter(W_dec)
            self.W_enc = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(self.cfg.d_in, self.cfg.d_sae, **make)))
            self.b_enc = nn.Parameter(torch.zeros(self.cfg.d_sae, **make))

        def skip_out(self, x: torch.Tensor) -> torch.Tensor | float:
            return x @ self.W_skip.T if skip else 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.skip_out(x)

        def training_forward_pass(self, step_input: TrainStepInput) -> TrainStepOutput:
            # TrainingSAE.training_forward_pass with the rows' target in place of its input
            x, y = step_input.sae_in[..., : self.cfg.d_in], step_input.sae_in[..., self.cfg.d_in :]
            feature_acts, hidden_pre = self.encode_with_hidden_pre(x)
            sae_out = self.decode(feature_acts) + self.skip_out(x)
            mse_loss = self.mse_loss_fn(sae_out, y).sum(dim=-1).mean()
            aux = self.calculate_aux_loss(
                step_input=replace(step_input, sae_in=y),
                feature_acts=feature_acts,
                hidden_pre=hidden_pre,
                sae_out=sae_out,
            )
            return TrainStepOutput(
                sae_in=y,
                sae_out=sae_out,
                feature_acts=feature_acts,
                hidden_pre=hidden_pre,
                loss=mse_loss + sum(aux.values()),
                losses={"mse_loss": mse_loss, **aux},
            )

    return TopKTranscoder


def main() -> None:
    spec = job()
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    torch.manual_seed(spec["seed"])
    d_out = spec.get("d_out")
    d = int(split(next(batches(spec["train"], 1)), spec)[0].shape[1])
    kind = transcoder_class(d_out, spec["skip"]) if d_out else TopKTrainingSAE
    sae = kind(
        TopKTrainingSAEConfig(
            d_in=d,
            d_sae=spec["n_latents"],
            k=spec["k"],
            aux_loss_coefficient=spec["auxk_coeff"],  # its MSE and AuxK are both unnormalised: the same ratio
            normalize_activations="expected_average_only_in",
            apply_b_dec_to_input=not d_out,  # a transcoder's b_dec lives in the target's space
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
    if d_out:  # the scaler's factor from the first batch's inputs (SAETrainer would read the whole packed rows)
        provider = batches(spec["train"], spec["batch"])
        trainer = SAETrainer(cfg, sae, provider)
        trainer.activation_scaler.estimate_scaling_factor(d, iter([split(first, spec)[0]]), 1)
    else:
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
            "center": torch.zeros(d) if d_out else sae.b_dec * sae.cfg.apply_b_dec_to_input,
            "scale": torch.ones(()),
        }
        if d_out and spec["skip"]:
            weights["W_skip"] = sae.W_skip.T
    write(spec, stamps, weights, own)


if __name__ == "__main__":
    main()
