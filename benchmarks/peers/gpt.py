"""runner's lm GPT (experiments/lm/model.py) rewritten in plain torch, for the peers' virtualenvs, which have no runner,
Hydra or OmegaConf: the same modules under the same names (embed, blocks.N.attn_norm / attn.qkv / attn.out /
mlp_norm / mlp.gate_up / mlp.down, norm, head), the same arithmetic, and the forward a transformers causal LM has
(`model(input_ids).logits`, `base_model`, `device`, `dummy_inputs`), so that sparsify's Trainer hooks `blocks.2` of it
as runner hooks `blocks.2` of its own GPT. It loads a finished `+experiment=lm` run: its sizes from
.hydra/config.yaml (pyyaml), its weights from model.safetensors. tests/e2e/test_benchmarks.py checks that its logits
equal runner's GPT's on a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TARGET = "experiments.lm.model.GPT"  # the only model this rewrites
SIZES = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio")


def rotary(seq_len: int, head_dim: int, base: float = 10_000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, [2, seq_len, head_dim / 2] (float32): runner's, to the bit."""
    freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's dims of x [B, H, T, D] by positions 0..T-1's angles."""
    cos, sin = rope[0, : x.shape[-2]].to(x.dtype), rope[1, : x.shape[-2]].to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(apply_rotary(q, rope), apply_rotary(k, rope), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class Output:
    """What a transformers causal LM returns, as far as sparsify reads it."""

    logits: torch.Tensor


class GPT(nn.Module):
    """Token ids [B, T] -> Output(logits [B, T, vocab_size]), runner's lm GPT's forward."""

    def __init__(
        self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, d_model: int, mlp_ratio: float
    ) -> None:
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, seq_len
        hidden = 64 * math.ceil(mlp_ratio * d_model / 64)  # runner's: a multiple of 64
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied, as runner's
        self.register_buffer("rope", rotary(seq_len, d_model // n_head), persistent=False)

    @property
    def base_model(self) -> nn.Module:
        """Where sparsify looks its hook points up by name (a transformers model's inner transformer)."""
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """What sparsify's resolve_widths runs to learn the hook points' widths."""
        return {"input_ids": torch.zeros(1, 2, dtype=torch.long)}

    def forward(self, input_ids: torch.Tensor) -> Output:
        if input_ids.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens is longer than seq_len={self.seq_len}")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, self.rope)
        return Output(self.head(self.norm(x)))


def sizes(run_dir: str | Path) -> dict[str, float]:
    """The GPT's sizes from a finished lm run's .hydra/config.yaml (interpolations elsewhere in it are not read)."""
    import yaml

    model = yaml.safe_load((Path(run_dir) / ".hydra" / "config.yaml").read_text())["model"]
    if model.get("_target_") != TARGET:
        raise SystemExit(f"{run_dir} trained {model.get('_target_')}, not {TARGET}: give a +experiment=lm run")
    return {name: model[name] for name in SIZES}


def load(run_dir: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The lm run's GPT with its trained weights, frozen, in eval mode, on `device`."""
    from safetensors.torch import load_file

    model = GPT(**sizes(run_dir))
    model.load_state_dict(load_file(str(Path(run_dir) / "model.safetensors")))  # strict: every name matches
    return model.to(device).eval().requires_grad_(False)
