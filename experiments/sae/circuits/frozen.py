"""A prompt's frozen model: runner's GPT (experiments/lm/model.py) with its attention patterns and RMSNorm
denominators fixed at their values on the prompt, so that what follows a token embedding is linear in it, and every
MLP left to the caller (`mlp(layer, input)`: the replacement's coders and error nodes).

Another architecture (a transformers model) gives the same four things: `embeddings` [T, d], `mlp_inputs` and
`mlp_outputs` (each layer's, on the prompt), `run(x, mlp)` (the linear model from the embeddings) and `unembed`
[V, d]."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from experiments.lm.model import GPT, apply_rotary
from runner import ConfigError

Mlp = Callable[[int, torch.Tensor], torch.Tensor]


def _denominator(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # 1 / RMS(x) as nn.RMSNorm computes it (eps None: the dtype's machine epsilon)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _weight(norm: nn.RMSNorm) -> torch.Tensor | float:
    return norm.weight if norm.weight is not None else 1.0


class FrozenGPT:
    """`model` run on `tokens` [T] once (no gradients), recording what the linear model freezes."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor) -> None:
        if not isinstance(model, GPT):
            raise ConfigError(
                f"attribution graphs read runner's GPT (experiments/lm); the source model is a {type(model).__name__}"
            )
        if not 0 < len(tokens) <= model.seq_len:
            raise ConfigError(f"the prompt has {len(tokens)} tokens; the model reads 1 to {model.seq_len}")
        self.model, self.tokens = model, tokens
        self.n_layers, self.n_pos = len(model.blocks), len(tokens)
        self.unembed = model.head.weight.detach()
        self.scales: list[torch.Tensor] = []  # per layer: attention's then the MLP's 1 / RMS, [1, T, 1] each
        self.patterns: list[torch.Tensor] = []  # per layer: [1, H, T, T]
        self.mlp_outputs: list[torch.Tensor] = []  # per layer: the true MLP output [T, d]
        with torch.no_grad():
            self.embeddings = model.embed(tokens)
            ins, final = self.run(self.embeddings[None], self._true_mlp, record=True)
            self.mlp_inputs = [m[0] for m in ins]
            self.logits = (final @ self.unembed.t())[0]

    def _true_mlp(self, layer: int, m: torch.Tensor) -> torch.Tensor:
        out = self.model.blocks[layer].mlp(m)
        self.mlp_outputs.append(out[0])
        return out

    def run(self, x: torch.Tensor, mlp: Mlp, record: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """From embeddings `x` [B, T, d]: every layer's MLP input [B, T, d] and the final normed stream [B, T, d]
        (logits = final @ unembed.T), with `mlp(layer, input)` for each MLP's output; linear in x and in what mlp
        adds, the patterns and denominators being the prompt's (`record`: measured on this run, the true one)."""
        ins = []
        for layer, block in enumerate(self.model.blocks):
            if record:
                self.scales.append(_denominator(block.attn_norm, x))
            h = x * self.scales[2 * layer] * _weight(block.attn_norm)
            if record:
                self.patterns.append(_pattern(block.attn, h, self.model.rope))
            x = x + _attend(block.attn, h, self.patterns[layer])
            if record:
                self.scales.append(_denominator(block.mlp_norm, x))
            m = x * self.scales[2 * layer + 1] * _weight(block.mlp_norm)
            ins.append(m)
            x = x + mlp(layer, m)
        if record:
            self.scales.append(_denominator(self.model.norm, x))
        return ins, x * self.scales[-1] * _weight(self.model.norm)


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def _pattern(attn: nn.Module, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # the softmax of causal scaled dot products, as F.scaled_dot_product_attention takes it, [1, H, T, T]
    d = h.shape[-1]
    q, k, _ = attn.qkv(h).split(d, dim=-1)
    q, k = apply_rotary(_heads(q, attn.n_head), rope), apply_rotary(_heads(k, attn.n_head), rope)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // attn.n_head)
    t = h.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1)


def _attend(attn: nn.Module, h: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    # attention with a fixed pattern: linear in h (its values, then the output projection)
    b, t, d = h.shape
    v = h @ attn.qkv.weight[2 * d :].t()
    y = pattern @ _heads(v, attn.n_head)
    return attn.out(y.transpose(1, 2).reshape(b, t, d))
