"""The replacement model's MLPs: a cross-layer transcoder (experiments/sae/coders/clt.py), or one transcoder per layer
(a skip transcoder's linear path included), read the same way. Layer i's features read layer i's MLP input; their
decoders write to layer i's output (a transcoder) or to every layer from i on (a CLT): layer l's replacement MLP
output is the sum over layers i <= l of what i's features write to l, the coders' biases, a skip transcoder's
W_skip term, and the error node (true output less all that: constant).

A feature's activation is in raw units, as circuit-tracer's folder holds it (formats/common.py raw_unit_weights):
runner's code divided by the scale of the output its layer writes first. A coder read from a run and the same coder
read from its export then give the same graph, edge for edge: the scale moves between a feature's activation and its
decoder rows (and its pre-activation, as a target), which the edges out of it do not see and the edges into it do."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runner import ConfigError


class Layer:
    """One layer's coder as the graph reads it: its encoder, the scales of its input and of the outputs it writes to,
    its decoder rows and bias over those outputs side by side, its skip map (or None)."""

    def __init__(self, coder: nn.Module, in_scale: torch.Tensor, out_scales: torch.Tensor, skip: bool) -> None:
        self.coder, self.in_scale, self.out_scales = coder, in_scale.detach(), out_scales.detach()
        self.skip = coder.W_skip.detach() if skip else None


class CoderSet:
    """The coders of every layer, `skip_positions` (the first positions the coders were not trained on: no features
    there, the MLP output all error)."""

    def __init__(self, layers: Sequence[Layer], skip_positions: int = 0) -> None:
        self.layers, self.skip_positions = list(layers), skip_positions
        self.n_layers = len(self.layers)
        self.d = self.layers[0].coder.W_dec.shape[1] // len(self.layers[0].out_scales)

    @classmethod
    def of_clt(cls, clt: nn.Module, skip_positions: int = 0) -> CoderSet:
        """A cross-layer transcoder's layers: layer i writes to i .. L-1 (target_scale of each)."""
        layers = [
            Layer(coder, clt.input_scale[i], clt.target_scale[i:], skip=False) for i, coder in enumerate(clt.coders)
        ]
        return cls(layers, skip_positions)

    @classmethod
    def of_transcoders(cls, coders: Sequence[nn.Module], skip_positions: int = 0) -> CoderSet:
        """One transcoder per layer, first to last."""
        for i, coder in enumerate(coders):
            if not getattr(coder, "transcoder", False):
                raise ConfigError(f"layer {i}'s coder is an SAE, not a transcoder: it predicts no MLP's output")
        layers = [Layer(c, c.input_scale.reshape(()), c.target_scale.reshape(1), bool(c.skip)) for c in coders]
        return cls(layers, skip_positions)

    def writes_to(self, layer: int) -> range:
        """The layers whose MLP outputs `layer`'s features write to."""
        return range(layer, layer + len(self.layers[layer].out_scales))

    @torch.no_grad()
    def codes(self, layer: int, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [T, k] in raw units, latents [T, k]) of layer `layer`'s features on its MLP input `m` [T, d] (raw
        units), k the most active at one position past the skipped ones; zeros where fewer are active, and at the
        skipped positions."""
        one = self.layers[layer]
        one.coder.eval()
        values, indices = one.coder.activate(one.coder.pre_activations(m * one.in_scale))
        values = values / one.out_scales[0]
        values[: self.skip_positions] = 0
        if indices is None:  # dense codes (ReLU, JumpReLU): the active ones of each position, padded
            k = max(int((values != 0).sum(1).max()), 1)
            values, indices = values.topk(k, dim=1)
        return values, indices

    def rows(self, layer: int, indices: torch.Tensor) -> torch.Tensor:
        """Decoder rows of `indices` [T, k] in the raw units of each output written to: [T, k, spans * d]."""
        one = self.layers[layer]
        scales = one.out_scales.repeat_interleave(self.d)
        return one.coder.W_dec.detach()[indices] * (one.out_scales[0] / scales)

    def bias(self, layer: int) -> torch.Tensor:
        """The constant every layer i <= `layer` writes to `layer`'s output (its decoder bias) [d], raw units."""
        total = 0.0
        for i in range(layer + 1):
            if layer in self.writes_to(i):
                one, span = self.layers[i], layer - i
                total = total + one.coder.b_dec.detach()[span * self.d : (span + 1) * self.d] / one.out_scales[span]
        return total

    def skip(self, layer: int, m: torch.Tensor) -> torch.Tensor | float:
        """A skip transcoder's linear term of MLP input `m` [..., d] (raw units), 0 without one."""
        one = self.layers[layer]
        if one.skip is None:
            return 0.0
        return (m * one.in_scale) @ one.skip / one.out_scales[0]

    def encoder(self, layer: int, latents: torch.Tensor) -> torch.Tensor:
        """[n, d]: the vectors whose dot product with the raw MLP input gives `latents`' pre-activations, less their
        encoder bias (a transcoder's encoder reads its input uncentred)."""
        one = self.layers[layer]
        return one.coder.W_enc.detach()[:, latents].t() * (one.in_scale / one.out_scales[0])

    def writes(self, values: list[torch.Tensor], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's MLP output from its features: `values` [B, T, k] and `rows` [T, k, spans * d] of every layer;
        [B, T, d] each (without biases, skips and errors)."""
        decoded = [torch.einsum("btk,tkd->btd", v, r) for v, r in zip(values, rows, strict=True)]
        d = self.d
        return [
            sum(decoded[i][..., (m - i) * d : (m - i + 1) * d] for i in range(m + 1) if m in self.writes_to(i))
            for m in range(self.n_layers)
        ]
