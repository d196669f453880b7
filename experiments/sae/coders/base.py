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

from experiments.sae.coders.kernels import check_choice
from experiments.sae.coders.sparse import Pre, SparsePre, bag
from experiments.sae.objectives import batch_errors, split_statistics, unexplained
from runner import ConfigError, check_whole
from runner.progress import parse_duration


def geometric_median(points: torch.Tensor, iterations: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """Weiszfeld's algorithm: the point minimising the sum of Euclidean distances to `points` [N, d]."""
    median = points.mean(0)
    for _ in range(iterations):
        weights = 1.0 / torch.linalg.vector_norm(points - median, dim=1).clamp_min(1e-8)
        new = (weights[:, None] * points).sum(0) / weights.sum()
        if torch.linalg.vector_norm(new - median) <= tol * torch.linalg.vector_norm(median).clamp_min(1e-8):
            return new
        median = new
    return median


def ranks_share(sae: nn.Module) -> bool:
    """Whether other ranks train copies of `sae` on other rows of each batch (DDP, FSDP), not this rank alone on
    every rank's rows (distributed=spread: `sees_global_batch`)."""
    return (
        not getattr(sae, "sees_global_batch", False)
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def every_rank(rows: torch.Tensor, sae: nn.Module) -> torch.Tensor:
    """Every rank's `rows` in rank order (the global batch, as one process would see it) where ranks share `sae`."""
    if not ranks_share(sae):
        return rows
    # once per run (a data-dependent init): the ranks' first batches, whatever their sizes, through pickling
    samples: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(samples, rows.detach().cpu())
    return torch.cat(samples).to(rows.device)


def _unit_scale(x: torch.Tensor) -> torch.Tensor:
    # the factor that makes E||x|| = sqrt(width)
    return x.shape[1] ** 0.5 / torch.linalg.vector_norm(x, dim=1).mean().clamp_min(1e-8)


class SAE(nn.Module):
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
        if isinstance(d_in, bool) or not isinstance(d_in, int) or d_in < 1:
            raise ConfigError(
                f"model.d_in={d_in}: the SAE's input width is unknown (its data gives none). Several hooked modules "
                "(source.module=[...]) need model=sae_multi, which makes an SAE for each"
            )
        check_whole(n_latents, "model.n_latents")
        if d_out is not None:
            check_whole(d_out, "model.d_out")
        if skip not in (True, False) or (skip and d_out is None):
            raise ConfigError(
                f"model.skip={skip!r}: a skip connection maps a transcoder's input to its target; it needs a target "
                "(source.target=<module>, or data with d_out), and true or false"
            )
        if not abs(b_enc_init) <= torch.finfo(torch.float32).max:  # a float32 parameter (a NaN fails too)
            raise ConfigError(f"model.b_enc_init must be a finite number, got {b_enc_init}: e.g. model.b_enc_init=0.0")
        norm = encoder_init if isinstance(encoder_init, (int, float)) and not isinstance(encoder_init, bool) else None
        if encoder_init not in ("unit", "fit") and not (norm is not None and 0 < norm < float("inf")):
            raise ConfigError(
                f"model.encoder_init={encoder_init!r}: give unit, fit or the encoder columns' starting norm (e.g. 0.5)"
            )
        self.d_in, self.n_latents, self.encoder_init = d_in, n_latents, encoder_init
        self.transcoder, self.d_out, self.skip = d_out is not None, d_out or d_in, bool(skip)
        self.normalize_input, self.unit_norm_decoder = normalize_input, unit_norm_decoder
        self.geometric_median_init, self.sparse_decode = geometric_median_init, sparse_decode
        window = parse_duration(dead_window)
        if window.unit not in ("st", "sa", "tok"):
            raise ConfigError(f"model.dead_window={dead_window}: give it in optimizer steps (st) or samples (sa)")
        self.dead_unit, self.dead_window = ("st" if window.unit == "st" else "sa"), window.value
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
        # Per latent: steps (or samples) since it last fired, and the running counters that measure it.
        self.register_buffer("since_fired", torch.zeros(n_latents))
        self.register_buffer("fired", torch.zeros(n_latents, dtype=torch.bool))  # within the current step
        # Dead latents as of the last optimizer step, kept on the device: AuxK reads them with no host read.
        self.register_buffer("dead", torch.zeros(n_latents, dtype=torch.bool), persistent=False)
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
            self.input_scale.fill_(_unit_scale(x))
            if self.transcoder:
                self.target_scale.fill_(_unit_scale(y))
        xn, yn = x * self.input_scale, y * self.out_scale
        if self.geometric_median_init:
            self.b_dec.copy_(geometric_median(yn))
        if self.encoder_init == "fit":
            self._fit_encoder_scale(xn, yn)
        if self.transcoder and self.geometric_median_init:
            # A transcoder's encoder reads its input uncentred (b_dec is the target's), and an MLP input's mean is
            # large (norm ~0.4 of its spread on the lm preset's): every pre-activation starts with the mean's
            # projection, and the latents it pushes down never fire (5% of 2048 on blocks.2's MLP, benchmarks/
            # sae_peers.py). b_enc starts at minus the input's median through the encoder, as sparsify's transcoders
            # start theirs with the mean: 1.6%. A centre fixed for the whole run (an SAE's b_dec) cost 0.04 of FVE.
            self.b_enc.sub_(geometric_median(xn) @ self.W_enc)
        self.initialized.fill_(True)

    @torch.no_grad()
    def _fit_encoder_scale(self, xn: torch.Tensor, yn: torch.Tensor) -> None:
        # Unit-norm encoder columns start the codes, hence the reconstruction, several times too large: on a GPT's
        # residual stream (128 -> 2048, k 32) Adam then spends the run shrinking them (held-out FVE 0.946; sparsify's
        # nn.Linear init, columns of norm ~0.58, gave 0.970). Scaled by the least-squares factor that best
        # reconstructs the first batch instead: 0.974, for any width and k. With b_enc = 0, top-k codes pick the same
        # latents at any scale and scale with it, so the reconstruction is linear in the factor.
        kept = {name: buffer.clone() for name, buffer in self.named_buffers()}  # BatchTopK's threshold: untouched
        recon = self.decode(*self.activate(self.pre_activations(xn))) - self.b_dec
        fit = (recon * (yn - self.b_dec)).sum() / recon.pow(2).sum().clamp_min(1e-12)
        self.W_enc.mul_(torch.where(fit > 0, fit, 1.0))
        for name, buffer in self.named_buffers():
            buffer.copy_(kept[name])

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Renormalise decoder rows and advance the dead-latent clock (called by the loop after each step)."""
        if self.unit_norm_decoder:
            self.W_dec.div_(torch.linalg.vector_norm(self.W_dec, dim=1, keepdim=True).clamp_min(1e-8))
        if self.dead_unit == "st":
            self.since_fired.add_(1).masked_fill_(self.fired, 0)
            self.fired.zero_()
        self.dead.copy_(self.dead_mask())

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load weights and buffers, then the dead latents they imply (the next AuxK step uses them)."""
        result = super().load_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.dead.copy_(self.dead_mask())
        self._init_checked = False  # a checkpoint saved before the first step holds initialized=False
        return result

    def logged(self, metrics: dict[str, float], prefix: str = "") -> None:
        """Told the run's last logged row (runner's loop does, after each row): on CUDA AuxK runs while that row saw
        dead latents, and no step reads the device to decide it (on the CPU each step counts them: no wait there).
        `prefix`: this SAE's metric prefix in a family (model=sae_multi)."""
        self.auxk_active = metrics.get(f"train/{prefix}silent_fraction", 0.0) > 0

    @property
    def n_dead(self) -> int:
        """How many latents AuxK treats as dead this step (a host read: for tests and reports, not the step)."""
        return int(self.dead.sum())

    def _track(self, codes_fired: torch.Tensor, batch: int) -> None:
        # codes_fired: [n_latents] bool, latents that fired anywhere in this micro-batch
        rows: int | torch.Tensor = batch
        if ranks_share(self):
            # Every rank's rows: a latent fired if it fired on any rank, and the window counts all ranks' rows (one
            # small all-reduce queued on the device). Otherwise DDP, which broadcasts buffers from rank 0 at each
            # forward, would leave rank 0's data alone deciding which latents are dead.
            both = torch.cat([codes_fired.float(), codes_fired.new_full((1,), batch, dtype=torch.float32)])
            torch.distributed.all_reduce(both)
            codes_fired, rows = both[:-1] > 0, both[-1]
        if self.dead_unit == "st":
            self.fired |= codes_fired
        else:
            self.since_fired.add_(rows).masked_fill_(codes_fired, 0)

    def track(self, values: torch.Tensor, indices: torch.Tensor | None) -> None:
        """Count which latents fired in a training micro-batch's codes (as `activate` gives them)."""
        fired = values.detach() > 0
        if indices is None:
            self._track(fired.any(0), values.shape[0])
        else:  # no host sync: scatter the per-row hits into a per-latent count
            hits = torch.zeros(self.n_latents, device=values.device).index_add_(
                0, indices.flatten(), fired.flatten().float()
            )
            self._track(hits > 0, values.shape[0])

    def dead_mask(self) -> torch.Tensor:
        """Latents that have not fired within dead_window."""
        return self.since_fired >= self.dead_window

    @classmethod
    def load_from_disk(cls, path: Any, **options: Any) -> SAE:
        """The SAE of a runner run, or of a SAELens or sparsify folder, as those tools spell it (runner.api.load_sae:
        `name=` one of a family, `hook=` one of a sparsify run's); refused if it is not a `cls`."""
        from runner.api import load_sae

        sae = load_sae(path, **options)
        if not isinstance(sae, cls):
            raise ConfigError(f"{path} holds a {type(sae).__name__}, not a {cls.__name__}: load it with SAE")
        return sae

    def export(self, fmt: str, out: Any, cfg: Any, module: str | None = None, summary: dict | None = None) -> list[Any]:
        """Write this SAE in another tool's folder layout (experiments/sae/formats.py) for runner.export; `cfg` is
        the run's config: its data's source (the hooked module, a transcoder's target, the source model) names the
        export's metadata; `module`, the one this SAE reads where the source hooks several; `summary`, the run's
        summary.json (a repository's model card quotes its metrics). The folders written."""
        from experiments.sae.formats import export, hub_card, sae_id
        from runner.outdir import within

        # the run as trained has `source`; as load_trained rebuilds it, its data holds what `source` gave it
        source = cfg.get("source") or cfg.get("data") or {}
        names = {key: value if isinstance(value := source.get(key), str) else None for key in ("module", "target")}
        model, hook = source.get("checkpoint"), module or names["module"]
        args = (hook, str(model) if model else None, names["target"])
        if fmt == "hf":  # a repository: the SAELens folder named by its hook point, and the model card
            folder = export(self, "saelens", within(out, sae_id(hook)), *args)
            hub_card(out, {folder: ""}, cfg, summary)
            return [out]
        return [export(self, fmt, out, *args)]

    def features(self, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
        """Write this SAE's feature pages to `out` for runner.features (experiments/sae/pages/dashboard.py);
        the pages."""
        from experiments.sae.pages.dashboard import write

        return write([("", self)], cfg, run_dir, out, **options)

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
        stats = split_statistics(recon, yn, values, indices, self.n_latents)
        return {**stats, "silent_fraction": self.dead_mask().double().mean()}

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The split's metrics from validation_step's means: FVE = 1 - SSE/SST with SST about the per-dimension mean
        of the whole split (not about zero, and not a mean of per-batch ratios), NMSE against E||x||^2, MSE per
        element in the inputs' own units, the fraction of latents that never fired on the split (dead) and of those
        silent for the training's `dead_window` (silent)."""
        unexplained_ = unexplained(means)
        # a subclass's own validation outputs pass through as their means
        own = ("sse", "x_mean", "x_sq", "l0", "silent_fraction", "firing_rate")
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
        }
