"""The direct effects of a prompt's replacement model (circuit-tracer's circuit_tracer/attribution/attribute*.py).

Nodes, in this order: the active features (layer, position, latent, activation; sorted so), one error node per
(layer, position) layer-major, one token embedding per position, and the top logits of the last position (by
probability, until their mass reaches `logit_mass`, at most `max_logits`). A target is an active feature's
pre-activation (its encoder's read of its layer's MLP input, less the encoder bias) or a logit less the mean logit
(circuit-tracer's demeaned unembedding column). Its row of the adjacency matrix (rows: targets, columns: sources) is
one backward pass through the frozen linear model (frozen.py) in which every feature's activation is a constant input:
a source feature's edge is its activation times the target's gradient with respect to it (what its decoder rows
carry), an error node's and a token's the dot product of its vector with the gradient there. `batch_size` targets
share a pass: the model is run on that many copies of the prompt, each copy's gradient flowing from its own target
alone, so the rows do not depend on the batch size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.sae.circuits.coders import CoderSet
from experiments.sae.circuits.frozen import FrozenGPT
from runner import ConfigError


@dataclass
class Graph:
    """An unpruned attribution graph (node order: features, errors, tokens, logits)."""

    tokens: list[int]
    n_layers: int
    features: torch.Tensor  # [F, 3] (layer, position, latent)
    activations: torch.Tensor  # [F]
    logit_tokens: torch.Tensor  # [K]
    logit_probabilities: torch.Tensor  # [K]: the weights influence is measured with
    adjacency: torch.Tensor  # [N, N], N = F + n_layers * T + T + K; row: target, column: source
    error_norms: torch.Tensor  # [n_layers, T]: each error node's vector's norm

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    @property
    def n_features(self) -> int:
        return len(self.features)


@dataclass
class _Prompt:
    # what every backward pass shares: each layer's codes, decoder rows and error vectors, and where features sit
    values: list[torch.Tensor]  # [T, k] per layer
    rows: list[torch.Tensor]  # [T, k, spans * d] per layer
    errors: list[torch.Tensor]  # [T, d] per layer
    slots: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (positions, slots) of its active features, node order


def _prompt(frozen: FrozenGPT, coders: CoderSet) -> tuple[_Prompt, torch.Tensor, torch.Tensor]:
    codes = [coders.codes(layer, frozen.mlp_inputs[layer]) for layer in range(coders.n_layers)]
    values = [v for v, _ in codes]
    rows = [coders.rows(layer, i) for layer, (_, i) in enumerate(codes)]
    with torch.no_grad():
        writes = coders.writes([v[None] for v in values], rows)
        errors = [
            frozen.mlp_outputs[m] - writes[m][0] - coders.skip(m, frozen.mlp_inputs[m]) - coders.bias(m)
            for m in range(coders.n_layers)
        ]
    slots, table, activations = [], [], []
    for layer, (v, indices) in enumerate(codes):
        pos, slot = (v != 0).nonzero(as_tuple=True)
        latent = indices[pos, slot]
        order = torch.argsort(pos * (int(indices.max()) + 1) + latent)
        pos, slot, latent = pos[order], slot[order], latent[order]
        slots.append((pos, slot))
        table.append(torch.stack([torch.full_like(pos, layer), pos, latent], 1))
        activations.append(v[pos, slot])
    return _Prompt(values, rows, errors, slots), torch.cat(table), torch.cat(activations)


def salient_logits(logits: torch.Tensor, max_logits: int, logit_mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, probabilities) of the most probable next tokens until their probabilities sum to `logit_mass`, at
    most `max_logits` (circuit-tracer's compute_salient_logits)."""
    probs = logits.float().softmax(-1)
    top, tokens = probs.topk(min(max_logits, len(probs)))
    cut = int(torch.searchsorted(top.cumsum(0), torch.tensor(logit_mass))) + 1
    return tokens[:cut], top[:cut]


def _backward(frozen: FrozenGPT, coders: CoderSet, prompt: _Prompt, targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # rows [B, F + L T + T] of targets (read layer [B]: n_layers is the final stream; position [B]; vector [B, d])
    read, pos, vectors = targets
    b = len(pos)
    copies = lambda t: t.detach().expand(b, *t.shape).clone().requires_grad_(True)  # noqa: E731
    emb, errors, values = (
        copies(frozen.embeddings),
        [copies(e) for e in prompt.errors],
        [copies(v) for v in prompt.values],
    )
    writes = coders.writes(values, prompt.rows)
    biases = [coders.bias(m) for m in range(coders.n_layers)]
    ins, final = frozen.run(emb, lambda m, x: writes[m] + coders.skip(m, x) + biases[m] + errors[m])
    picked = torch.stack([*ins, final])[read, torch.arange(b), pos]
    grads = torch.autograd.grad(
        (picked * vectors).sum(), [emb, *errors, *values], allow_unused=True, materialize_grads=True
    )
    tokens = (grads[0] * emb.detach()).sum(-1)
    error_rows = [(g * e.detach()).sum(-1) for g, e in zip(grads[1 : 1 + coders.n_layers], errors, strict=True)]
    feature_rows = []
    for g, v, (p, s) in zip(grads[1 + coders.n_layers :], values, prompt.slots, strict=True):
        feature_rows.append((g * v.detach())[:, p, s])
    return torch.cat([*feature_rows, *error_rows, tokens], 1)


def attribute(
    frozen: FrozenGPT, coders: CoderSet, max_logits: int = 10, logit_mass: float = 0.95, batch_size: int = 64
) -> Graph:
    """The prompt's unpruned graph: every active feature's and every salient logit's row of direct effects."""
    if coders.n_layers != frozen.n_layers:
        raise ConfigError(
            f"the coders replace {coders.n_layers} MLPs, the model has {frozen.n_layers}: the replacement model "
            "replaces every one"
        )
    prompt, features, activations = _prompt(frozen, coders)
    logit_tokens, probabilities = salient_logits(frozen.logits[-1], max_logits, logit_mass)
    n_f, n_pos, n_layers = len(features), frozen.n_pos, frozen.n_layers
    encoders = [coders.encoder(m, features[features[:, 0] == m, 2]) for m in range(n_layers)]
    unembed = frozen.unembed
    vectors = torch.cat([*encoders, unembed[logit_tokens] - unembed.mean(0)])
    read = torch.cat([features[:, 0], torch.full_like(logit_tokens, n_layers)])
    pos = torch.cat([features[:, 1], torch.full_like(logit_tokens, n_pos - 1)])
    n_sources = n_f + (n_layers + 1) * n_pos
    size = n_sources + len(logit_tokens)
    adjacency = torch.zeros(size, size, dtype=vectors.dtype)
    target_rows = torch.cat([torch.arange(n_f), torch.arange(n_sources, size)])
    for start in range(0, len(read), batch_size):
        chunk = slice(start, start + batch_size)
        rows = _backward(frozen, coders, prompt, (read[chunk], pos[chunk], vectors[chunk]))
        adjacency[target_rows[chunk], :n_sources] = rows.detach().to(adjacency.dtype).cpu()
    norms = torch.stack([e.norm(dim=-1) for e in prompt.errors]).cpu()
    tokens = frozen.tokens.tolist()
    return Graph(
        tokens, n_layers, features.cpu(), activations.cpu(), logit_tokens.cpu(), probabilities.cpu(), adjacency, norms
    )
