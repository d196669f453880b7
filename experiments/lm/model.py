"""A decoder-only transformer as the field writes it: pre-norm RMSNorm, rotary positions, causal scaled-dot-product
attention, a SwiGLU MLP, tied embeddings, depth-scaled initialisation. `Block` is the unit that FSDP shards, compile
compiles and activation checkpointing recomputes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner import ConfigError, check_whole
from runner.config.trust import buildable

LN2 = math.log(2)


def rotary(seq_len: int, head_dim: int, base: float = 10_000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, [2, seq_len, head_dim / 2] (float32)."""
    freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rotary(x: torch.Tensor, rope: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's dims by the angles of positions start, start + 1, ...;
    x is [B, H, T, D]."""
    end = start + x.shape[-2]
    cos, sin = rope[0, start:end].to(x.dtype), rope[1, start:end].to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions (F.scaled_dot_product_attention picks the kernel)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]; with `cache`, x continues the positions it holds (generation)."""
        b, t, d = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, rope, start), apply_rotary(k, rope, start)
        if cache is not None:
            if start and t > 1:
                raise ValueError("a KV cache takes a prompt at its start, then one token at a time")
            k, v = cache.append(k, v)
        # one new token attends to every cached one: no mask
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class LayerCache:
    """One attention layer's keys and values of the positions generated so far, in buffers of the model's window."""

    def __init__(self, window: int) -> None:
        self.window, self.length = window, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' keys and values [B, H, T, D]; all of them so far."""
        if self.k is None:
            shape = (*k.shape[:2], self.window, k.shape[-1])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        end = self.length + k.shape[2]
        self.k[:, :, self.length : end], self.v[:, :, self.length : end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_up), then W_down: the gated MLP of Llama and most 2026 models."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., d_model]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): one transformer block (pre-norm)."""

    def __init__(self, d_model: int, n_head: int, mlp_hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]."""
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.mlp(self.mlp_norm(x))


@buildable("model")
class GPT(nn.Module):
    """Next-token prediction over `vocab_size` tokens with `n_layer` Blocks.

    Batches are {"tokens": [B, seq_len + 1] int64, "num_tokens": B * seq_len}: inputs are tokens[:, :-1], targets
    tokens[:, 1:]. Validation gives the loss in nats, bits per token, and bits per byte when `bytes_per_token` is known
    (1 for byte-level text). Perplexity is exp(val/loss): a mean of per-batch perplexities would overstate it.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 256,
        n_layer: int = 6,
        n_head: int = 4,
        d_model: int = 256,
        mlp_ratio: float = 8 / 3,
        bytes_per_token: float | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        sizes = {"vocab_size": vocab_size, "seq_len": seq_len, "n_layer": n_layer, "d_model": d_model, "n_head": n_head}
        for name, value in sizes.items():
            check_whole(value, f"model.{name}")
        for name, value in (("init_std", init_std), ("bytes_per_token", bytes_per_token)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"model.{name} must be a finite number > 0, got {value}")
        if not 0 < mlp_ratio <= 64:  # (a NaN fails too)
            raise ConfigError(f"model.mlp_ratio must be in (0, 64] (the MLP's width over d_model), got {mlp_ratio}")
        if d_model % n_head or (d_model // n_head) % 2:
            raise ConfigError(
                f"model.d_model={d_model} must be a multiple of model.n_head={n_head} with an even head size "
                f"(rotary positions rotate pairs of dims): e.g. model.n_head={_divisor_near(d_model, n_head)}"
            )
        self.vocab_size, self.seq_len, self.bytes_per_token = vocab_size, seq_len, bytes_per_token
        hidden = 64 * math.ceil(mlp_ratio * d_model / 64)  # a multiple of 64: fast matmuls
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one matrix reads and writes tokens
        self.register_buffer("rope", rotary(seq_len, d_model // n_head), persistent=False)
        self._init(init_std, n_layer)

    def _init(self, std: float, n_layer: int) -> None:
        # GPT-2's scheme: N(0, std) everywhere, and the projections that write into the residual stream scaled by
        # 1/sqrt(2 n_layer), so that the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.ndim == 2:
                scale = 1 / math.sqrt(2 * n_layer) if name.endswith(("attn.out.weight", "mlp.down.weight")) else 1
                nn.init.normal_(p, std=std * scale)

    def forward(self, idx: torch.Tensor, cache: list[LayerCache] | None = None) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, vocab_size]; with `cache` (one LayerCache per block), the ids continue
        the positions it holds."""
        if idx.shape[1] + (cache[0].length if cache else 0) > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than model.seq_len={self.seq_len}")
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope) if cache is None else block(x, self.rope, cache[i])
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """`tokens` [B, T] continued by `new_tokens` sampled ones (top-k, temperature): [B, T + new_tokens].

        With `use_cache`, each new token costs one position's forward (keys and values of the earlier ones are kept)
        while the sequence fits the window; past it the window slides, every position moves, and each token costs
        the window's forward, as without the cache. The tokens are the same either way (tests)."""
        cache: list[LayerCache] | None = None
        for _ in range(new_tokens):
            if use_cache and tokens.shape[1] <= self.seq_len:
                if cache is None:  # the prompt, all at once
                    cache = [LayerCache(self.seq_len) for _ in self.blocks]
                    logits = self(tokens, cache)[:, -1]
                else:
                    logits = self(tokens[:, -1:], cache)[:, -1]
            else:
                logits = self(tokens[:, -self.seq_len :])[:, -1]
            logits = logits.float() / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def training_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean next-token cross-entropy (nats) over the batch's tokens."""
        return {"loss": self._loss(batch)}

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss (nats), bits per token, and bits per byte when bytes_per_token is set."""
        loss = self._loss(batch)
        out = {"loss": loss, "bits_per_token": loss / LN2}
        if self.bytes_per_token:
            out["bits_per_byte"] = loss / LN2 / self.bytes_per_token
        return out

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x the parameters of matrix products (forward 2, backward 4: the blocks and the
        output head; the embedding lookup is free), plus attention's 12 x n_layer x d_model x seq_len (PaLM's appendix
        B, as nanoGPT counts; the causal mask's saving is not subtracted)."""
        n_layer, d_model = len(self.blocks), self.embed.embedding_dim
        matmul_params = sum(p.numel() for p in self.blocks.parameters() if p.ndim == 2) + self.head.weight.numel()
        return 6 * matmul_params + 12 * n_layer * d_model * self.seq_len


def _divisor_near(d_model: int, n_head: int) -> int:
    fits = [h for h in range(1, d_model + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]
    return min(fits, key=lambda h: abs(h - n_head))
