"""A prompt's frozen transformers GPT-2 (GPT2LMHeadModel: LayerNorm, learned positions, tied unembedding), with
frozen.py's interface and circuit-tracer's definitions (circuit_tracer/replacement_model/
replacement_model_transformerlens.py, attribution/context_transformerlens.py): every LayerNorm's 1 / sqrt(var + eps)
and every attention pattern is fixed at its value on the prompt; the centring stays (it is linear), so what follows
the token embeddings is affine in them.

The token nodes are the token embeddings alone (circuit-tracer's hook_embed, W_E[token]). The position embeddings,
the LayerNorms' biases, the attention's value and output biases and the coders' decoder biases are constants, no
nodes, as circuit-tracer's frozen parameters are. The first `constant_positions` positions' MLP outputs are held at
their values on the prompt (circuit-tracer's zero_positions, position 0: the BOS it prepends, which computes the same
on every prompt), but for a skip transcoder's linear path (`skip`, CoderSet.skip), which circuit-tracer keeps there:
neither a feature nor an error node there has an edge. The coders should skip those positions (CoderSet
skip_positions), as load.py makes them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from experiments.sae.circuits.frozen import Mlp
from runner import ConfigError

ARCHITECTURE = "GPT2LMHeadModel"


def check_gpt2(model: nn.Module, what: str = "the source model") -> None:
    """A ConfigError unless `model` is a transformers GPT-2, the one architecture of transformers' read here."""
    if type(model).__name__ != ARCHITECTURE:
        raise ConfigError(
            f"{what} is a {type(model).__name__}: attribution graphs read runner's GPT (experiments/lm) or a "
            f"transformers {ARCHITECTURE} (LayerNorm, learned positions); other architectures are not written yet"
        )
    if getattr(model.lm_head, "bias", None) is not None:
        raise ConfigError(f"{what}'s lm_head has a bias, which GPT-2's has not: its logits are no unembedding alone")


def prompt_tokens(tokenizer: Any, prompt: str, window: int) -> torch.Tensor:
    """`prompt`'s ids by the model's tokenizer, after a special token where it does not start with one (circuit-
    tracer's ensure_tokenized: BOS, else PAD, EOS or another special token), refused past `window` positions."""
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    special = list(tokenizer.all_special_ids)
    if not ids or ids[0] not in special:
        first = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, *special]
        ids = [i for i in first if i is not None][:1] + ids
    if len(ids) > window:
        raise ConfigError(
            f"the prompt is {len(ids)} tokens (its first special token included), longer than the model's window of "
            f"{window} positions (n_positions): give a shorter prompt"
        )
    return torch.tensor(ids)


def _norm(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # LayerNorm with its 1 / sqrt(var + eps) fixed (`scale`): the centring, a linear map, stays
    return (x - x.mean(-1, keepdim=True)) * scale * norm.weight + norm.bias


def _scale(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def _pattern(attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
    # GPT-2's causal softmax of q k^T, scaled by 1 / sqrt(head_dim) and 1 / (layer + 1) as its config says, [1, H, T, T]
    d, n_head = h.shape[-1], attn.num_heads
    q, k, _ = attn.c_attn(h).split(d, dim=-1)
    scale = (d // n_head) ** -0.5 if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= attn.layer_idx + 1
    scores = _heads(q, n_head) @ _heads(k, n_head).transpose(-1, -2) * scale
    t = h.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1)


def _attend(attn: nn.Module, h: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    # attention with a fixed pattern: affine in h (its values with their bias, then the output projection)
    b, t, d = h.shape
    v = h @ attn.c_attn.weight[:, 2 * d :] + attn.c_attn.bias[2 * d :]  # Conv1D: x @ W + b, W [in, out]
    y = pattern @ _heads(v, attn.num_heads)
    return attn.c_proj(y.transpose(1, 2).reshape(b, t, d))


class FrozenHF:
    """`model` (a GPT2LMHeadModel) run on `tokens` [T] once (no gradients), recording what the affine model freezes;
    the first `constant_positions` MLP outputs are the prompt's, moved by `skip(layer, input)` alone."""

    def __init__(
        self, model: nn.Module, tokens: torch.Tensor, constant_positions: int = 1, skip: Mlp | None = None
    ) -> None:
        check_gpt2(model)
        window = int(model.config.n_positions)
        if not 0 < len(tokens) <= window:
            raise ConfigError(f"the prompt has {len(tokens)} tokens; the model reads 1 to {window} (n_positions)")
        if constant_positions < 0:
            raise ConfigError(f"constant_positions={constant_positions}: give 0 or more")
        base = model.transformer
        self.model, self.tokens, self.constant_positions = model, tokens, constant_positions
        self.skip = skip or (lambda _layer, _m: 0.0)
        self.blocks: Sequence[nn.Module] = list(base.h)
        self.n_layers, self.n_pos = len(self.blocks), len(tokens)
        self.unembed = model.lm_head.weight.detach()
        self.scales: list[torch.Tensor] = []  # per layer: ln_1's then ln_2's 1 / sqrt(var + eps) [1, T, 1]; ln_f's
        self.patterns: list[torch.Tensor] = []  # per layer: [1, H, T, T]
        self.mlp_outputs: list[torch.Tensor] = []  # per layer: the true MLP output [T, d]
        with torch.no_grad():
            self.embeddings = base.wte(tokens)  # the token nodes' vectors
            self.positions = base.wpe(torch.arange(len(tokens), device=tokens.device))  # a constant
            ins, final = self.run(self.embeddings[None], self._true_mlp, record=True)
            self.mlp_inputs = [m[0] for m in ins]
            self.logits = (final @ self.unembed.t())[0]

    def _true_mlp(self, layer: int, m: torch.Tensor) -> torch.Tensor:
        out = self.blocks[layer].mlp(m)
        self.mlp_outputs.append(out[0])
        return out

    def _normed(self, norm: nn.LayerNorm, x: torch.Tensor, index: int, record: bool) -> torch.Tensor:
        if record:
            self.scales.append(_scale(norm, x))
        return _norm(norm, x, self.scales[index])

    def _held(self, layer: int, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # the constant positions' MLP outputs are the prompt's, whatever the replacement writes there, moved by the
        # skip path's change alone
        p = min(self.constant_positions, m.shape[1])
        if p == 0:
            return out
        moved = self.skip(layer, m[:, :p]) - self.skip(layer, self.mlp_inputs[layer][:p])
        held = (self.mlp_outputs[layer][:p] + moved).expand(m.shape[0], -1, -1)
        return torch.cat([held, out.expand_as(m)[:, p:]], 1)

    def run(self, x: torch.Tensor, mlp: Mlp, record: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """From token embeddings `x` [B, T, d]: every layer's MLP input [B, T, d] and the final normed stream [B, T, d]
        (logits = final @ unembed.T), with `mlp(layer, input)` for each MLP's output past the constant positions;
        affine in x and in what mlp adds, the patterns and denominators being the prompt's (`record`: measured on
        this run, the true one)."""
        x = x + self.positions
        ins = []
        for layer, block in enumerate(self.blocks):
            h = self._normed(block.ln_1, x, 2 * layer, record)
            if record:
                self.patterns.append(_pattern(block.attn, h))
            x = x + _attend(block.attn, h, self.patterns[layer])
            m = self._normed(block.ln_2, x, 2 * layer + 1, record)
            ins.append(m)
            out = mlp(layer, m)
            x = x + (out if record else self._held(layer, m, out))
        return ins, self._normed(self.model.transformer.ln_f, x, 2 * self.n_layers, record)
