"""The transformers architectures attribution graphs read (frozen_hf.py), one row of LAYOUTS each: where a model keeps
its embeddings, blocks, norms and unembedding, and its attention computed as transformers' eager attention computes it
(its own rotary module's cos and sin, grouped-query heads repeated, head_dim ** -0.5, the causal mask), split in two:
the pattern, measured once on the prompt, and the attention with that pattern fixed, affine in its input.

GPT-2: LayerNorm, learned positions, Conv1D projections. Llama: RMSNorm, rotary, grouped-query attention, a gated MLP
(replaced as a whole, so its gate is no concern here). GPT-NeoX (Pythia): LayerNorm, partial rotary (the first
rotary dims of each head turn, the rest pass), fused per-head q k v, and attention and MLP in parallel from the block's
input where config.use_parallel_residual says so."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [1, T, rotary dims] from the model's rotary_emb


@dataclass(frozen=True)
class Layout:
    """Where one architecture keeps what the frozen model reads, and its attention with a fixed pattern."""

    base: str  # the attribute of the ...ForCausalLM holding the embeddings, the blocks and the final norm
    embed: str
    blocks: str
    attn_norm: str
    attn: str
    mlp_norm: str  # the MLP's input norm: a run hooks it (and `mlp`), as circuit-tracer's mlp.hook_in
    final_norm: str
    window: str  # the config's number of positions
    rotary: bool  # positions by the base's rotary_emb; else by its learned wpe, a constant of the graph
    pattern: Callable[[nn.Module, torch.Tensor, Rotary | None], torch.Tensor]
    attend: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    what: str  # its shape, in a refusal

    def hooks(self) -> tuple[str, str]:
        """The patterns of block N's MLP input and output modules, as runner's sources name them."""
        block = re.escape(f"{self.base}.{self.blocks}.") + r"(\d+)\."
        return block + re.escape(self.mlp_norm), block + "mlp"


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    # transformers adds the dtype's minimum where the causal mask closes: a weight of exactly 0, as -inf gives
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, -1, head_dim).transpose(1, 2)


def _merge(y: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = y.shape
    return y.transpose(1, 2).reshape(b, t, -1)


def _rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb on q or k [B, H, T, head_dim]: the first cos.shape[-1] dims turn by
    # rotate_half (all of them but in GPT-NeoX's partial rotary), the rest pass
    cos, sin = (r.unsqueeze(1) for r in rotary)
    d = cos.shape[-1]
    turned, rest = x[..., :d], x[..., d:]
    half = torch.cat((-turned[..., d // 2 :], turned[..., : d // 2]), -1)
    return torch.cat([turned * cos + half * sin, rest], -1)


def _gpt2_pattern(attn: nn.Module, h: torch.Tensor, _rotary: Rotary | None) -> torch.Tensor:
    # q k^T scaled by 1 / sqrt(head_dim) and 1 / (layer + 1) as GPT-2's config says, [1, H, T, T]
    d = h.shape[-1]
    q, k, _ = attn.c_attn(h).split(d, dim=-1)
    hd = d // attn.num_heads
    scale = hd**-0.5 if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= attn.layer_idx + 1
    return _causal_softmax(_heads(q, hd) @ _heads(k, hd).transpose(-1, -2) * scale)


def _gpt2_attend(attn: nn.Module, h: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1]
    v = h @ attn.c_attn.weight[:, 2 * d :] + attn.c_attn.bias[2 * d :]  # Conv1D: x @ W + b, W [in, out]
    return attn.c_proj(_merge(pattern @ _heads(v, d // attn.num_heads)))


def _llama_pattern(attn: nn.Module, h: torch.Tensor, rotary: Rotary | None) -> torch.Tensor:
    q = _rotate(_heads(attn.q_proj(h), attn.head_dim), rotary)
    k = _rotate(_heads(attn.k_proj(h), attn.head_dim), rotary)
    k = k.repeat_interleave(attn.num_key_value_groups, 1)  # repeat_kv: each key head serves its group of queries
    return _causal_softmax(q @ k.transpose(2, 3) * attn.scaling)


def _llama_attend(attn: nn.Module, h: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    v = _heads(attn.v_proj(h), attn.head_dim).repeat_interleave(attn.num_key_value_groups, 1)
    return attn.o_proj(_merge(pattern @ v))


def _neox_part(attn: nn.Module, h: torch.Tensor, part: int) -> torch.Tensor:
    # query_key_value's rows are per head [q_h, k_h, v_h]: one part of every head, [B, H, T, head_size]
    size, layer = attn.head_size, attn.query_key_value
    weight = layer.weight.view(-1, 3, size, h.shape[-1])[:, part].reshape(-1, h.shape[-1])
    bias = None if layer.bias is None else layer.bias.view(-1, 3, size)[:, part].reshape(-1)
    return _heads(F.linear(h, weight, bias), size)


def _neox_pattern(attn: nn.Module, h: torch.Tensor, rotary: Rotary | None) -> torch.Tensor:
    q, k = _rotate(_neox_part(attn, h, 0), rotary), _rotate(_neox_part(attn, h, 1), rotary)
    return _causal_softmax(q @ k.transpose(2, 3) * attn.scaling)


def _neox_attend(attn: nn.Module, h: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    return attn.dense(_merge(pattern @ _neox_part(attn, h, 2)))


LAYOUTS = {
    "GPT2LMHeadModel": Layout(
        "transformer", "wte", "h", "ln_1", "attn", "ln_2", "ln_f", "n_positions", False,
        _gpt2_pattern, _gpt2_attend, "LayerNorm, learned positions",
    ),
    "LlamaForCausalLM": Layout(
        "model", "embed_tokens", "layers", "input_layernorm", "self_attn", "post_attention_layernorm", "norm",
        "max_position_embeddings", True, _llama_pattern, _llama_attend, "RMSNorm, rotary, gated MLP",
    ),
    "GPTNeoXForCausalLM": Layout(
        "gpt_neox", "embed_in", "layers", "input_layernorm", "attention", "post_attention_layernorm",
        "final_layer_norm", "max_position_embeddings", True, _neox_pattern, _neox_attend,
        "Pythia: LayerNorm, partial rotary, parallel residual",
    ),
}  # fmt: skip
