"""Cross-layer transcoder (CLT: Ameisen et al. 2025, "Circuit Tracing"): what attribution graphs are built from.

One encoder per layer reads that layer's MLP input; the latents of layer l write, through decoders of their own, to
the MLP outputs of layer l and of every later layer, and layer m's reconstruction is the sum of what layers 0..m write
to it. Each layer's coder is an ordinary transcoder of experiments/sae (any code type: TopK, BatchTopK, ReLU, JumpReLU,
Matryoshka) whose target is the concatenation of the MLP outputs it writes to, [y_l | ... | y_{L-1}]: its decoder row
for a latent is that latent's writes to every later layer (kept at unit norm together), and its code type, AuxK and
dead-latent clock work unchanged. The writes to later layers start at zero, so the CLT starts as L per-layer
transcoders and learns what crosses layers.

Data rows hold every layer's MLP input, then every layer's MLP output, [x_0 | ... | x_{L-1} | y_0 | ... | y_{L-1}]
(one forward of the frozen model hooked at all of them, stopped after the last). Each layer's input and output have a
scale of their own (E||x|| = sqrt(d)), kept here, not in the coders. The loss is the sum over layers of each layer's
normalised error (SSE / SST, as an SAE's recon_loss).

Memory: L encoders of d_in x n, and L (L + 1) / 2 decoder blocks of n x d_out, against L (d_in + d_out) n for
per-layer transcoders of the same width: (L + 1) / 2 times the decoder weights (benchmarks/clt.py prints the figures
for GPT-2 small and Llama-3-8B beside a measured step; tests/unit/test_clt.py checks the count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from experiments.sae.coders.base import SAE
from experiments.sae.coders.dead import dead_advice, faint_advice
from experiments.sae.coders.init import every_rank, geometric_median, unit_scale
from experiments.sae.coders.sparse import SparsePre
from experiments.sae.objectives import batch_errors, faint_share, split_statistics, unexplained
from runner import ConfigError, check_whole
from runner.config.trust import buildable


@buildable("model", coder="model")
class CrossLayerTranscoder(nn.Module):
    """L per-layer coders whose decoders write to their own and every later layer's target."""

    def __init__(
        self,
        coder: Callable[..., SAE] | None = None,
        layers: int | None = None,
        d_in: int | None = None,
        d_out: int | None = None,
        normalize_input: bool = True,
        geometric_median_init: bool = True,
    ) -> None:
        super().__init__()
        if coder is None:
            raise ConfigError("model.coder: give each layer's code type (an SAE config, e.g. the sae_lm preset's)")
        if layers is None or d_in is None or d_out is None:
            raise ConfigError(
                f"model.layers={layers}, d_in={d_in}, d_out={d_out}: a cross-layer transcoder reads every layer's MLP "
                "input and output: give source.module=[<input of each layer>] and source.target=[<output of each>]"
            )
        for name, value in (("layers", layers), ("d_in", d_in), ("d_out", d_out)):
            check_whole(value, f"model.{name}")
        self.layers, self.d_in, self.d_out = layers, d_in, d_out
        self.normalize_input, self.geometric_median_init = normalize_input, geometric_median_init
        # The scales and the first batch's medians are the CLT's: a coder sees normalised units only.
        self.coders = nn.ModuleList(
            coder(d_in=d_in, d_out=(layers - layer) * d_out, normalize_input=False, geometric_median_init=False)
            for layer in range(layers)
        )
        for one in self.coders:
            if one.encoder_init == "fit":
                raise ConfigError(
                    "model.coder.encoder_init=fit fits one transcoder's first reconstruction; a CLT's layers share "
                    "theirs: give unit or a norm (e.g. model.coder.encoder_init=0.5)"
                )
            if one.skip:
                raise ConfigError("model.coder.skip=true: a cross-layer transcoder has no skip connection; set false")
            with torch.no_grad():  # the writes to later layers start at zero: L per-layer transcoders at first
                one.W_dec[:, d_out:] = 0.0
        self.register_buffer("input_scale", torch.ones(layers))
        self.register_buffer("target_scale", torch.ones(layers))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self._init_checked = False

    # ---- data --------------------------------------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's input and target columns of a batch of raw rows."""
        rows = batch[0] if isinstance(batch, (tuple, list)) else batch
        width = self.layers * (self.d_in + self.d_out)
        if rows.shape[-1] != width:
            raise ConfigError(
                f"the data's rows have {rows.shape[-1]} columns, but a cross-layer transcoder of {self.layers} layers "
                f"(d_in={self.d_in}, d_out={self.d_out}) reads {width}: every layer's input, then every layer's output"
            )
        inputs = rows[..., : self.layers * self.d_in].split(self.d_in, dim=-1)
        return list(inputs), list(rows[..., self.layers * self.d_in :].split(self.d_out, dim=-1))

    @torch.no_grad()
    def initialize_from(self, rows: torch.Tensor) -> None:
        """Each layer's input and target scales, and its target's bias at the geometric median of the first batch."""
        inputs, targets = self.split(every_rank(rows, self).float())
        for layer, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            if self.normalize_input:
                self.input_scale[layer], self.target_scale[layer] = unit_scale(x), unit_scale(y)
            if self.geometric_median_init:  # the layer's own block of its coder's bias; the others start at 0
                self.coders[layer].b_dec[: self.d_out] = geometric_median(y * self.target_scale[layer])
                coder = self.coders[layer]  # its encoder's start centred on its input, as a transcoder's (base.py)
                coder.b_enc.sub_(geometric_median(x * self.input_scale[layer]) @ coder.W_enc)
        self.initialized.fill_(True)

    # ---- forward -----------------------------------------------------------------------------------------------
    def _writes(self, decoded: list[torch.Tensor]) -> list[torch.Tensor]:
        # layer m's reconstruction (normalised units): the sum of block m - i of every layer i <= m's decode
        return [
            sum(decoded[i][:, (m - i) * self.d_out : (m - i + 1) * self.d_out] for i in range(m + 1))
            for m in range(self.layers)
        ]

    def decoded(self, xn: torch.Tensor, layer: int, train: bool = False) -> tuple[Any, ...]:
        """Layer `layer`'s (pre-activations, values, indices, decode) of its normalised input."""
        coder = self.coders[layer]
        pre = SparsePre(xn, coder) if train and coder.sparse_backward else coder.pre_activations(xn)
        values, indices = coder.activate(pre)
        return pre, values, indices, coder.decode(values, indices)

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's predicted MLP output (raw units) from every layer's raw MLP input."""
        decoded = [self.decoded(x.float() * self.input_scale[i], i)[3] for i, x in enumerate(inputs)]
        return [y / self.target_scale[m] for m, y in enumerate(self._writes(decoded))]

    def splice_writes(self, reads: list[str], writes: list[str]) -> dict[str, Callable[[dict], torch.Tensor]]:
        """For a Splice (experiments/sae/sources/replacements.py): each layer's MLP output (`writes`, raw rows) from the
        captured raw rows of the MLP inputs (`reads`) that ran before it; a layer's codes are computed once per
        forward."""
        decoded: dict[int, torch.Tensor] = {}

        def write(m: int) -> Callable[[dict], torch.Tensor]:
            def fn(captured: dict[str, torch.Tensor]) -> torch.Tensor:
                if m == 0:  # a new forward: the last one's codes are stale
                    decoded.clear()
                for i in range(m + 1):
                    if i not in decoded:
                        decoded[i] = self.decoded(captured[reads[i]].float() * self.input_scale[i], i)[3]
                y = sum(decoded[i][:, (m - i) * self.d_out : (m - i + 1) * self.d_out] for i in range(m + 1))
                return y / self.target_scale[m]

            return fn

        return {name: write(m) for m, name in enumerate(writes)}

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """The sum over layers of each layer's SSE / SST, each coder's auxiliary terms, and per-layer metrics."""
        rows = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not self._init_checked:
            if not self.initialized:
                self.initialize_from(rows)
            self._init_checked = True
        inputs, targets = self.split(rows)
        xn = [x.float() * self.input_scale[i] for i, x in enumerate(inputs)]
        yn = [y.float() * self.target_scale[m] for m, y in enumerate(targets)]
        steps = [self.decoded(x, i, train=True) for i, x in enumerate(xn)]
        recon = self._writes([step[3] for step in steps])
        out: dict[str, torch.Tensor] = {}
        losses, terms = [], []
        for m in range(self.layers):
            sse, sst = batch_errors(recon[m], yn[m])
            losses.append(sse / sst)
            out[f"layer{m}/fve"] = (1 - sse / sst).detach()
        for i, (pre, values, indices, decode) in enumerate(steps):
            coder = self.coders[i]
            coder.track(values, indices)
            # what layer i's latents must explain: each later target less what the other layers write to it
            residual = torch.cat([yn[m] - recon[m] for m in range(i, self.layers)], dim=1) + decode
            aux = coder.aux_loss(residual, pre, values, indices, decode)
            terms += [aux.pop(k) for k in [k for k in aux if k.endswith("_term")]]
            out.update({f"layer{i}/{k}": v for k, v in aux.items()})
            out[f"layer{i}/l0"] = (values > 0).sum(1).float().mean()
        out["recon_loss"] = torch.stack(losses).sum()
        out["fve"] = 1 - torch.stack(losses).mean().detach()
        out["l0"] = torch.stack([out[f"layer{i}/l0"] for i in range(self.layers)]).mean()
        out["loss"] = out["recon_loss"] + sum(terms)
        out["silent_fraction"] = torch.stack([c.dead_mask().float().mean() for c in self.coders]).mean()
        return out

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Each coder's decoder norm and dead-latent clock."""
        for coder in self.coders:
            coder.after_optimizer_step()

    def logged(self, metrics: dict[str, float]) -> None:
        """Tell each coder the last logged row (whether AuxK runs on a GPU)."""
        for coder in self.coders:
            coder.logged(metrics)  # the CLT's row: its silent_fraction is the coders' mean

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load weights and buffers; each coder's dead latents follow (SAE.load_state_dict)."""
        result = super().load_state_dict(*args, **kwargs)
        with torch.no_grad():
            for coder in self.coders:
                coder.dead.copy_(coder.dead_mask())
        self._init_checked = False
        return result

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Per layer, in float64: the squared error, the target's moments, L0 and firing rates (objectives.py)."""
        inputs, targets = self.split(batch)
        codes = [self.decoded(x.float() * self.input_scale[i], i)[1:] for i, x in enumerate(inputs)]
        recon = self._writes([decode for _, _, decode in codes])
        out: dict[str, torch.Tensor] = {}
        for i, (values, indices, _) in enumerate(codes):
            target = targets[i].float() * self.target_scale[i]
            coder = self.coders[i]  # its decoder row: what a latent writes to this and every later layer
            stats = split_statistics(recon[i], target, values, indices, coder.n_latents, coder.W_dec.norm(dim=1))
            out.update({f"{key}_{i}": value for key, value in stats.items()})
        out["silent_fraction"] = torch.stack([c.dead_mask().double().mean() for c in self.coders]).mean()
        return out

    def advice(self, metrics: dict[str, float]) -> list[str]:
        """Said at the end of the run: more than 1% of the layers' latents never firing on the validation split, with
        what trains them back (the layers' coders share one config)."""
        latents, coder = sum(c.n_latents for c in self.coders), self.coders[0]
        dead = dead_advice(metrics, latents, coder.revive_hint("model.coder"), what="cross-layer transcoder")
        return dead + faint_advice(metrics, latents, coder.unit_norm_decoder, "model.coder")

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per layer FVE (SST about the split's mean) and L0; the loss as trained (their sum), the mean FVE and L0,
        the latents that never fired on the split (dead), those that fire but write almost nothing (faint) and those
        silent for `dead_window`."""
        losses = [unexplained(means, f"_{i}") for i in range(self.layers)]
        out = {f"layer{i}/fve": 1 - loss for i, loss in enumerate(losses)}
        out.update({f"layer{i}/l0": means[f"l0_{i}"] for i in range(self.layers)})
        out["loss"] = out["recon_loss"] = torch.stack(losses).sum()
        out["fve"] = 1 - torch.stack(losses).mean()
        out["l0"] = torch.stack([means[f"l0_{i}"] for i in range(self.layers)]).mean()
        out["silent_fraction"] = means["silent_fraction"]
        keys = ("firing_rate", "code_mass", "row_norm")
        every = {k: torch.cat([means[f"{k}_{i}"] for i in range(self.layers)]) for k in keys}
        out["dead_fraction"] = (every["firing_rate"] == 0).double().mean()
        out["faint_fraction"] = faint_share(every)  # against the median latent of every layer
        return out
