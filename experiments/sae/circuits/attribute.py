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

import warnings
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
    # what every backward pass shares: each layer's constant MLP output (all but the skip path's live term), error
    # vectors, and the active features (node order): their decoder rows as one sparse matrix that reads every layer's
    # MLP output gradient [L T d] at the outputs a feature writes, at its position; their activations
    constants: list[torch.Tensor]  # [T, d] per layer
    errors: list[torch.Tensor]  # [T, d] per layer
    reader: torch.Tensor  # [F, L T d], sparse (CSR)
    activations: torch.Tensor  # [F]


def _prompt(frozen: FrozenGPT, coders: CoderSet) -> tuple[_Prompt, torch.Tensor, torch.Tensor]:
    codes = [coders.codes(layer, frozen.mlp_inputs[layer]) for layer in range(coders.n_layers)]
    values = [v for v, _ in codes]
    rows = [coders.rows(layer, i) for layer, (_, i) in enumerate(codes)]
    with torch.no_grad():
        writes = coders.writes([v[None] for v in values], rows)
        constants = [frozen.mlp_outputs[m] - coders.skip(m, frozen.mlp_inputs[m]) for m in range(coders.n_layers)]
        errors = [constants[m] - writes[m][0] - coders.bias(m) for m in range(coders.n_layers)]
    columns, values, table, activations = [], [], [], []
    n_pos, d = frozen.n_pos, coders.d
    for layer, (v, indices) in enumerate(codes):
        pos, slot = (v != 0).nonzero(as_tuple=True)
        latent = indices[pos, slot]
        order = torch.argsort(pos * (int(indices.max()) + 1) + latent)
        pos, slot, latent = pos[order], slot[order], latent[order]
        written = torch.tensor(list(coders.writes_to(layer)), device=pos.device)  # [spans]
        starts = (written[None, :] * n_pos + pos[:, None]) * d  # [F_l, spans]: where each output's gradient is
        columns.append((starts[..., None] + torch.arange(d, device=pos.device)).reshape(len(pos), -1))
        values.append(rows[layer][pos, slot])
        table.append(torch.stack([torch.full_like(pos, layer), pos, latent], 1))
        activations.append(v[pos, slot])
    reader = _ragged_csr(columns, values, coders.n_layers * n_pos * d)
    return _Prompt(constants, errors, reader, torch.cat(activations)), torch.cat(table), torch.cat(activations)


def _ragged_csr(columns: list[torch.Tensor], values: list[torch.Tensor], width: int) -> torch.Tensor:
    # one CSR matrix of rows whose widths differ by layer (a CLT's early layers write to more outputs)
    counts = torch.cat([torch.full((len(c),), c.shape[1], dtype=torch.long, device=c.device) for c in columns])
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    flat_columns = torch.cat([c.flatten() for c in columns])
    flat_values = torch.cat([v.flatten() for v in values])
    with warnings.catch_warnings():  # torch calls its CSR support beta; what it is used for here is tested
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        size = (len(counts), width)
        return torch.sparse_csr_tensor(crow, flat_columns, flat_values, size=size, check_invariants=True)


def salient_logits(logits: torch.Tensor, max_logits: int, logit_mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, probabilities) of the most probable next tokens until their probabilities sum to `logit_mass`, at
    most `max_logits` (circuit-tracer's compute_salient_logits)."""
    probs = logits.float().softmax(-1)
    top, tokens = probs.topk(min(max_logits, len(probs)))
    cut = int(torch.searchsorted(top.cumsum(0), torch.tensor(logit_mass))) + 1
    return tokens[:cut], top[:cut]


def _backward(frozen: FrozenGPT, coders: CoderSet, prompt: _Prompt, targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # rows [B, F + L T + T] of targets (read layer [B]: n_layers is the final stream; position [B]; vector [B, d]).
    # Every MLP output is a constant plus a zero leaf: the gradient there is what a feature's decoder rows and an
    # error node's vector are read against, so the features need no copies of their own in the batch
    read, pos, vectors = targets
    b = len(pos)
    emb = frozen.embeddings.detach().expand(b, *frozen.embeddings.shape).clone().requires_grad_(True)
    leaves = [torch.zeros(b, *c.shape, dtype=c.dtype, device=c.device, requires_grad=True) for c in prompt.constants]
    ins, final = frozen.run(emb, lambda m, x: prompt.constants[m] + coders.skip(m, x) + leaves[m])
    picked = torch.stack([*ins, final])[read, torch.arange(b), pos]
    grads = torch.autograd.grad((picked * vectors).sum(), [emb, *leaves], allow_unused=True, materialize_grads=True)
    tokens = (grads[0] * emb.detach()).sum(-1)
    outputs = grads[1:]
    error_rows = [(g * e).sum(-1) for g, e in zip(outputs, prompt.errors, strict=True)]
    gradients = torch.stack(outputs, 1).reshape(b, -1).t().contiguous()  # [L T d, B]
    feature_rows = (prompt.reader @ gradients).t() * prompt.activations
    return torch.cat([feature_rows, *error_rows, tokens], 1)


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
