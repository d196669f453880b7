"""A prompt's frozen transformers model (a GPT2LMHeadModel, LlamaForCausalLM or GPTNeoXForCausalLM: hf_blocks.py's
LAYOUTS), with frozen.py's interface and circuit-tracer's definitions (circuit_tracer/replacement_model/
replacement_model_transformerlens.py, attribution/context_transformerlens.py): every norm's denominator (a LayerNorm's
1 / sqrt(var + eps), an RMSNorm's 1 / sqrt(mean(x^2) + eps)) and every attention pattern is fixed at its value on the
prompt; a LayerNorm's centring stays (it is linear), so what follows the token embeddings is affine in them.

The token nodes are the token embeddings alone (circuit-tracer's hook_embed, W_E[token]). GPT-2's position
embeddings, the norms' biases, the attention's value and output biases and the coders' decoder biases are constants,
no nodes, as circuit-tracer's frozen parameters are (rotary positions live in the frozen patterns). The first
`constant_positions` positions' MLP outputs are held at their values on the prompt (circuit-tracer's zero_positions,
position 0: the BOS it prepends, which computes the same on every prompt), but for a skip transcoder's linear path
(`skip`, CoderSet.skip), which circuit-tracer keeps there: neither a feature nor an error node there has an edge. The
coders should skip those positions (CoderSet skip_positions), as load.py makes them.

Every step is computed in the model's dtype, where transformers computes a LlamaRMSNorm and its eager attention's
softmax in float32 whatever the dtype: in float32, the dtype load.py loads a model in, the frozen model gives
transformers' logits to float32 rounding; in float64 it is exact, where transformers' rounds those two steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from experiments.sae.circuits.frozen import FrozenGPT, Mlp
from experiments.sae.circuits.hf_blocks import LAYOUTS, Layout
from runner import ConfigError


def check_model(model: nn.Module, what: str = "the source model") -> Layout:
    """The layout of `model`, or a ConfigError unless it is one of the transformers architectures read here."""
    layout = LAYOUTS.get(type(model).__name__)
    if layout is None:
        named = [f"{name} ({row.what})" for name, row in LAYOUTS.items()]
        known = ", ".join(named[:-1]) + f" or {named[-1]}"
        raise ConfigError(
            f"{what} is a {type(model).__name__}: attribution graphs read runner's GPT (experiments/lm) or a "
            f"transformers {known}; other architectures are not written yet"
        )
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ConfigError(f"{what}'s output embedding has a bias: its logits are no unembedding alone")
    return layout


def model_window(model: nn.Module) -> int:
    """How many positions the transformers `model` reads (its config's n_positions or max_position_embeddings)."""
    return int(getattr(model.config, check_model(model).window))


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
            f"{window} positions: give a shorter prompt"
        )
    return torch.tensor(ids)


def _norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # the norm with its denominator fixed (`scale`): a LayerNorm's centring, a linear map, stays
    if isinstance(norm, nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    x = x * scale * norm.weight
    return x if getattr(norm, "bias", None) is None else x + norm.bias


def _scale(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # a LayerNorm's 1 / sqrt(var + eps), else (Llama's RMSNorm) 1 / sqrt(mean(x^2) + eps)
    if isinstance(norm, nn.LayerNorm):
        return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


class FrozenHF:
    """`model` (one of LAYOUTS) run on `tokens` [T] once (no gradients), recording what the affine model freezes;
    the first `constant_positions` MLP outputs are the prompt's, moved by `skip(layer, input)` alone."""

    def __init__(
        self, model: nn.Module, tokens: torch.Tensor, constant_positions: int = 1, skip: Mlp | None = None
    ) -> None:
        self.layout = layout = check_model(model)
        positions = model_window(model)
        if not 0 < len(tokens) <= positions:
            raise ConfigError(
                f"the prompt has {len(tokens)} tokens; the model reads 1 to {positions} ({layout.window})"
            )
        if constant_positions < 0:
            raise ConfigError(f"constant_positions={constant_positions}: give 0 or more")
        base = getattr(model, layout.base)
        self.model, self.tokens, self.constant_positions = model, tokens, constant_positions
        self.skip = skip or (lambda _layer, _m: 0.0)
        self.blocks: Sequence[nn.Module] = list(getattr(base, layout.blocks))
        self.final_norm = getattr(base, layout.final_norm)
        self.n_layers, self.n_pos = len(self.blocks), len(tokens)
        self.unembed = model.get_output_embeddings().weight.detach()
        self.scales: list[torch.Tensor] = []  # per layer: the attention's then the MLP's norm's [1, T, 1]; the final's
        self.patterns: list[torch.Tensor] = []  # per layer: [1, H, T, T]
        self.mlp_outputs: list[torch.Tensor] = []  # per layer: the true MLP output [T, d]
        with torch.no_grad():
            self.embeddings = getattr(base, layout.embed)(tokens)  # the token nodes' vectors
            ids = torch.arange(len(tokens), device=tokens.device)
            # rotary's cos and sin as the model's own module gives them, or learned position embeddings, a constant
            self.rotary = base.rotary_emb(self.embeddings[None], ids[None]) if layout.rotary else None
            self.positions = 0.0 if layout.rotary else base.wpe(ids)
            ins, final = self.run(self.embeddings[None], self._true_mlp, record=True)
            self.mlp_inputs = [m[0] for m in ins]
            self.logits = (final @ self.unembed.t())[0]

    def _true_mlp(self, layer: int, m: torch.Tensor) -> torch.Tensor:
        out = self.blocks[layer].mlp(m)
        self.mlp_outputs.append(out[0])
        return out

    def _normed(self, norm: nn.Module, x: torch.Tensor, index: int, record: bool) -> torch.Tensor:
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
        layout, ins = self.layout, []
        x = x + self.positions
        for layer, block in enumerate(self.blocks):
            attn = getattr(block, layout.attn)
            h = self._normed(getattr(block, layout.attn_norm), x, 2 * layer, record)
            if record:
                self.patterns.append(layout.pattern(attn, h, self.rotary))
            a = layout.attend(attn, h, self.patterns[layer])
            parallel = getattr(block, "use_parallel_residual", False)  # GPT-NeoX's MLP reads the block's input
            if not parallel:
                x = x + a
            m = self._normed(getattr(block, layout.mlp_norm), x, 2 * layer + 1, record)
            ins.append(m)
            out = mlp(layer, m)
            out = out if record else self._held(layer, m, out)
            x = out + a + x if parallel else x + out  # transformers' order of the parallel sum
        return ins, self._normed(self.final_norm, x, 2 * self.n_layers, record)


def freeze(model: nn.Module, tokens: torch.Tensor, coders: Any, transformers: bool) -> FrozenGPT | FrozenHF:
    """The prompt `tokens` on `model` frozen as every graph of runner's freezes it (a FrozenGPT or a FrozenHF): a
    transformers model's first positions (its BOS), which `coders` (a CoderSet) skip, held at the prompt's values but
    for a skip transcoder's linear path."""
    if not transformers:
        return FrozenGPT(model, tokens)
    return FrozenHF(model, tokens, coders.skip_positions, coders.skip)
