"""The recipe every SAE of experiments/sae shares (SAE): what a variant adds is its activation and its loss terms.

The recipe (each piece an option): inputs scaled so that E||x|| = sqrt(d), with the scale kept as a buffer so that
reconstructions come back in the original units; decoder rows (one direction per latent, `W_dec` [n_latents, d]) kept at
unit norm after every optimizer step, with the gradient component parallel to each row removed before the step; the
encoder initialised as the decoder's transpose (with `encoder_init=fit`, scaled to best reconstruct the first batch;
with a number, columns of that norm); the decoder bias initialised to the geometric median of the first training batch.
Latents that have not fired within `dead_window` (optimizer steps or samples) are silent: AuxK trains them, and
`silent_fraction` counts them. `dead_fraction` is the field's: latents that fire on none of the positions measured
(the validation split here; runner.sae_eval's and the feature pages' own positions there).

A transcoder (`d_out` set) reads one module's output and reconstructs another's: each data row holds the input's d_in
columns then the target's d_out columns, side by side (how a source model hooked at two modules gives them). Its
encoder reads the input uncentred (no b_dec: that lives in the target's space), the target gets a scale of its own,
and with `skip` a linear map from the input (W_skip, zero at start) is added to the reconstruction. Everything else,
every code type's activation and loss, is the SAE's with the target in place of the input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.sae.coders.dead import DeadLatents, dead_clock
from experiments.sae.coders.init import check_settings, every_rank, fit_encoder_scale, geometric_median, unit_scale
from experiments.sae.coders.kernels import check_choice
from experiments.sae.coders.sparse import Pre, SparsePre, bag
from experiments.sae.objectives import batch_errors, faint_share, split_statistics, unexplained
from runner import ConfigError


class SAE(DeadLatents, nn.Module):
    """Base class: encoder, decoder, recipe and dead-latent tracking. Subclasses choose the activation and the loss."""

    def __init__(
        self,
        d_in: int | None = 256,  # null in the configs: the data's width fills it (runner.build.decided_by_data)
        n_latents: int = 1024,
        dead_window: str = "200st",
        normalize_input: bool = True,
        unit_norm_decoder: bool = True,
        tied_init: bool = True,
        geometric_median_init: bool = True,
        sparse_decode: bool = True,
        b_enc_init: float = 0.0,
        encoder_init: str | float = "unit",
        d_out: int | None = None,
        skip: bool = False,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        self.kernels = check_choice(kernels)  # the sparse products' Triton kernels on CUDA (coders/kernels.py)
        norm = check_settings(d_in, n_latents, d_out, skip, b_enc_init, encoder_init)
        self.d_in, self.n_latents, self.encoder_init = d_in, n_latents, encoder_init
        self.transcoder, self.d_out, self.skip = d_out is not None, d_out or d_in, bool(skip)
        self.normalize_input, self.unit_norm_decoder = normalize_input, unit_norm_decoder
        self.geometric_median_init, self.sparse_decode = geometric_median_init, sparse_decode
        self.dead_unit, self.dead_window = dead_clock(dead_window)
        W_dec = F.normalize(torch.randn(n_latents, self.d_out), dim=1)
        self.W_dec = nn.Parameter(W_dec)
        # a transcoder's decoder lives in the target's space, not its encoder's: no tied start for it
        tied = tied_init and not self.transcoder
        W_enc = W_dec.t() if tied else F.normalize(torch.randn(d_in, n_latents), dim=0)
        # contiguous: a fused optimizer walks a parameter, its gradient and its state as flat memory; a transposed
        # W_enc beside the row-major state a checkpoint restores would mix up its entries (torch 2.13, CPU and CUDA)
        self.W_enc = nn.Parameter((W_enc * (norm or 1.0)).contiguous())
        self.b_enc = nn.Parameter(torch.full((n_latents,), float(b_enc_init)))  # < 0: ReLU codes start sparse
        self.b_dec = nn.Parameter(torch.zeros(self.d_out))
        self.register_buffer("input_scale", torch.ones(()))
        if self.transcoder:  # registered only here: an SAE's checkpoints keep their keys
            self.register_buffer("target_scale", torch.ones(()))
            self.register_buffer("input_bias", torch.zeros(d_in), persistent=False)  # its encoder centres by none
        if self.skip:
            self.W_skip = nn.Parameter(torch.zeros(d_in, self.d_out))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self._register_clock(n_latents)  # since_fired, fired, dead (coders/dead.py)
        self._init_checked = False  # the host's copy of `initialized` once read: it never turns false again
        self.auxk_active = False  # CUDA: whether AuxK runs, from the last log row (logged)
        self.sparse_backward = False  # TopK-style subclasses may turn it on: their codes pick from pre-activations
        self.sees_global_batch = False  # distributed=spread: this rank alone trains it, on every rank's rows
        if unit_norm_decoder:
            self.W_dec.register_hook(self._remove_parallel_grad)

    # ---- recipe ---------------------------------------------------------------------------------------------
    def _remove_parallel_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # Linear in grad, so it is exact under accumulation and loss scaling: applying it per micro-batch equals
        # applying it to the summed gradient.
        w = self.W_dec.detach()
        return grad - (grad * w).sum(1, keepdim=True) * w

    @torch.no_grad()
    def initialize_from(self, rows: torch.Tensor) -> None:
        """Data-dependent init from a sample of raw data rows: the input (and target) scale and the decoder bias.
        Under several processes, from every rank's sample (in rank order: the global batch, as one process would
        see it)."""
        x, y = (part.float() for part in self.split(every_rank(rows, self)))
        if self.normalize_input:
            self.input_scale.fill_(unit_scale(x))
            if self.transcoder:
                self.target_scale.fill_(unit_scale(y))
        xn, yn = x * self.input_scale, y * self.out_scale
        if self.geometric_median_init:
            self.b_dec.copy_(geometric_median(yn))
        if self.encoder_init == "fit":
            fit_encoder_scale(self, xn, yn)
        if self.transcoder and self.geometric_median_init:
            # A transcoder's encoder reads its input uncentred (b_dec is the target's), and an MLP input's mean is
            # large (norm ~0.4 of its spread on the lm preset's): every pre-activation starts with the mean's
            # projection, and the latents it pushes down never fire (5% of 2048 on blocks.2's MLP, benchmarks/
            # sae_peers.py). b_enc starts at minus the input's median through the encoder, as sparsify's transcoders
            # start theirs with the mean: 1.6%. A centre fixed for the whole run (an SAE's b_dec) cost 0.04 of FVE.
            self.b_enc.sub_(geometric_median(xn) @ self.W_enc)
        self.initialized.fill_(True)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Renormalise decoder rows and advance the dead-latent clock (called by the loop after each step)."""
        if self.unit_norm_decoder:
            self.W_dec.div_(torch.linalg.vector_norm(self.W_dec, dim=1, keepdim=True).clamp_min(1e-8))
        self._tick()

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load weights and buffers, then the dead latents they imply (the next AuxK step uses them)."""
        result = super().load_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.dead.copy_(self.dead_mask())
        self._init_checked = False  # a checkpoint saved before the first step holds initialized=False
        return result

    def latent_slices(self, latents: torch.Tensor) -> dict[nn.Parameter, tuple[Any, ...]]:
        """Where `latents` live in the parameters: what resampling re-initialises, with its optimizer state."""
        return {self.W_dec: (latents,), self.W_enc: (slice(None), latents), self.b_enc: (latents,)}

    @torch.no_grad()
    def restart_latents(self, latents: torch.Tensor) -> None:
        """Resampled `latents` start afresh: no encoder bias, not dead (their weights are the resampler's)."""
        self.b_enc[latents] = 0.0
        self.since_fired[latents] = 0

    # ---- forward --------------------------------------------------------------------------------------------
    @property
    def out_scale(self) -> torch.Tensor:
        """What the target is multiplied by inside (an SAE's target is its input: input_scale)."""
        return self.target_scale if self.transcoder else self.input_scale

    @property
    def pre_bias(self) -> torch.Tensor:
        """What the encoder subtracts from normalised inputs: an SAE's b_dec, a transcoder's zeros."""
        return self.input_bias if self.transcoder else self.b_dec

    def split(self, batch: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, target) of a batch of raw rows: an SAE's target is its input; a transcoder's rows hold the input's
        d_in columns, then the target's d_out."""
        rows = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not self.transcoder:
            return rows, rows
        if rows.shape[-1] != self.d_in + self.d_out:
            raise ConfigError(
                f"the data's rows have {rows.shape[-1]} columns, but a transcoder of model.d_in={self.d_in} and "
                f"model.d_out={self.d_out} reads {self.d_in + self.d_out} (input, then target): leave model.d_in and "
                "model.d_out null, the data decides them (source.target names the target module)"
            )
        return rows[..., : self.d_in], rows[..., self.d_in :]

    def skip_part(self, xn: torch.Tensor) -> torch.Tensor | float:
        """The skip connection's share of the reconstruction (normalised units), 0 without one."""
        return xn @ self.W_skip if self.skip else 0.0

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder pre-activations of normalised inputs."""
        # addmm: the bias added inside the product, not in a second pass over the [B, n_latents] result
        return torch.addmm(self.b_enc, x - self.pre_bias, self.W_enc)

    def activate(self, pre: Pre) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values [B, k], indices [B, k]) of the active latents per row, or (dense codes [B, n], None)."""
        raise NotImplementedError

    def decode(self, values: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        """Reconstruction (normalised units) from active values [B, k] at `indices`, or dense codes (indices None)."""
        if indices is None:
            return values @ self.W_dec + self.b_dec
        if self.sparse_decode:
            # Sums k decoder rows per sample instead of a dense [B, n] x [n, d] product (k << n).
            # the codes in the decoder's precision: under bf16 autocast they come from a bf16 product, and
            # embedding_bag (which autocast leaves alone) takes one dtype
            return bag(indices, values.to(self.W_dec.dtype), self.W_dec, self.kernels) + self.b_dec
        return self._dense(values, indices) @ self.W_dec + self.b_dec

    def _dense(self, values: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        if indices is None:
            return values
        dense = torch.zeros(values.shape[0], self.n_latents, dtype=values.dtype, device=values.device)
        return dense.scatter(1, indices, values)

    def codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The codes of raw inputs as `activate` gives them: (values [B, k], indices [B, k]) or (dense, None)."""
        return self.activate(self.pre_activations(x * self.input_scale))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense latent codes [B, n_latents] of raw inputs."""
        return self._dense(*self.codes(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction (a transcoder: the predicted target) of raw inputs, in their original units."""
        return self.reconstruct(x)[0]

    def reconstruct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(reconstruction in the original units, values, indices): forward and the codes it came from, at once."""
        values, indices = self.codes(x)
        return (self.decode(values, indices) + self.skip_part(x * self.input_scale)) / self.out_scale, values, indices

    def aux_loss(
        self, x: torch.Tensor, pre: Pre, values: torch.Tensor, indices: torch.Tensor | None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Extra loss terms, named '*_term' (added to the loss), and their metrics, from the normalised target less
        the skip connection's part (an SAE's: its inputs), the pre-activations, the codes (as `activate` gives them)
        and their reconstruction of it; none by default."""
        return {}

    def _normalised(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # (input, target) in the units the SAE works in; an SAE's target is the very same tensor
        x, y = self.split(batch)
        xn = x.float() * self.input_scale
        return xn, (y.float() * self.target_scale if self.transcoder else xn)

    def step(
        self, batch: torch.Tensor | tuple[torch.Tensor, ...], train: bool = True
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A step's loss and metrics on raw rows, and the prediction of the target it scored, in the target's own
        units (what splicing puts in the model: experiments/sae/end_to_end.Spliced trains through it)."""
        rows = batch[0] if isinstance(batch, (tuple, list)) else batch
        if train and not self._init_checked:  # `initialized` is read once, not every step (a GPU sync)
            if not self.initialized:
                self.initialize_from(rows)
            self._init_checked = True
        xn, yn = self._normalised(rows)
        # sparse_backward (TopK-style codes): gradients reach only the latents the codes and AuxK pick (sparse.py)
        pre = SparsePre(xn, self) if self.sparse_backward else self.pre_activations(xn)
        values, indices = self.activate(pre)
        recon = sparse_recon = self.decode(values, indices)
        target = yn
        if self.skip:  # what the latents must explain is the target less the skip connection's part
            linear = self.skip_part(xn)
            recon, target = sparse_recon + linear, yn - linear
        sse, sst = batch_errors(recon, yn)
        out = {
            "recon_loss": sse / sst,
            "fve": 1 - sse / sst,
            "nmse": sse / yn.pow(2).sum(1).mean(),
            "mse": sse / self.d_out / self.out_scale**2,  # per element, in the original units
            "l0": (values > 0).sum(1).float().mean(),
        }
        if train:
            self.track(values, indices)
            out.update(self.aux_loss(target, pre, values, indices, sparse_recon))
        out["loss"] = out["recon_loss"] + sum(out.pop(k) for k in [k for k in out if k.endswith("_term")])
        out["silent_fraction"] = self.dead_mask().float().mean()
        return out, recon / self.out_scale

    def training_step(self, batch) -> dict[str, torch.Tensor]:
        """Normalised reconstruction loss plus the variant's auxiliary terms, and metrics."""
        return self.step(batch, train=True)[0]

    def validation_step(self, batch) -> dict[str, torch.Tensor]:
        """Per-sample statistics in float64 that runner averages over the whole validation split (every rank's
        shard): the squared error, the inputs' first and second moments, L0; validation_summary makes the metrics."""
        xn, yn = self._normalised(batch)
        values, indices = self.activate(self.pre_activations(xn))
        recon = self.decode(values, indices) + self.skip_part(xn)
        stats = split_statistics(recon, yn, values, indices, self.n_latents, self.W_dec.norm(dim=1))
        return {**stats, "silent_fraction": self.dead_mask().double().mean()}

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The split's metrics from validation_step's means: FVE = 1 - SSE/SST with SST about the per-dimension mean
        of the whole split (not about zero, and not a mean of per-batch ratios), NMSE against E||x||^2, MSE per
        element in the inputs' own units, the fraction of latents that never fired on the split (dead), of those
        silent for the training's `dead_window` (silent) and of those that fire but write almost nothing (faint)."""
        unexplained_ = unexplained(means)
        # a subclass's own validation outputs pass through as their means
        own = ("sse", "x_mean", "x_sq", "l0", "silent_fraction", "firing_rate", "code_mass", "row_norm")
        others = {k: v for k, v in means.items() if k not in own}
        return {
            **others,
            "loss": unexplained_,
            "recon_loss": unexplained_,
            "fve": 1 - unexplained_,
            "nmse": means["sse"] / means["x_sq"],
            "mse": means["sse"] / self.d_out / self.out_scale.double() ** 2,
            "l0": means["l0"],
            "silent_fraction": means["silent_fraction"],
            # latents that fired on none of the split's inputs (tokens, for a language model's activations)
            "dead_fraction": (means["firing_rate"] == 0).double().mean(),
            "faint_fraction": faint_share(means),
        }
