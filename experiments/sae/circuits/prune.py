"""Influence, pruning and the graph's scores, as circuit-tracer defines them (circuit_tracer/graph.py:
normalize_matrix, compute_influence, find_threshold, prune_graph, compute_graph_scores).

A node's influence is its total effect on the logits through the graph's paths: with A the adjacency matrix's
absolute values, each row scaled to sum to 1 (a target's inputs as fractions), and w the logit probabilities on the
logit nodes, influence = w (A + A^2 + ...) = w ((I - A)^-1 - I), summed here term by term until it vanishes (the graph
has no cycle). circuit-tracer's normalize_matrix divides in stages against overflow; for finite rows it is
|A| / max(row sum, 1e-10), which this computes directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.sae.circuits.attribute import Graph


def normalized(adjacency: torch.Tensor) -> torch.Tensor:
    """|A| with each row divided by its sum (at least 1e-10)."""
    magnitude = adjacency.abs()
    return magnitude / magnitude.sum(1, keepdim=True).clamp_min(1e-10)


def influence(matrix: torch.Tensor, weights: torch.Tensor, max_iter: int = 1000) -> torch.Tensor:
    """weights (A + A^2 + ...) for a normalised matrix A of a graph without cycles."""
    current = weights @ matrix
    total = current.clone()
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ matrix
        total += current
    raise RuntimeError(f"the influence did not vanish after {max_iter} steps: the graph has a cycle")


def threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The smallest score among the largest ones that together hold `fraction` of the total (the last score when
    fraction reaches the total: everything; the largest when fraction is 0)."""
    ordered = scores.sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum()
    index = min(int(torch.searchsorted(cumulative, torch.tensor(fraction, dtype=cumulative.dtype))), len(ordered) - 1)
    return ordered[index]


def logit_weights(graph: Graph) -> torch.Tensor:
    """The logit probabilities on the logit nodes (the last ones), 0 elsewhere."""
    weights = torch.zeros(len(graph.adjacency), dtype=graph.adjacency.dtype)
    weights[-len(graph.logit_tokens) :] = graph.logit_probabilities.to(weights.dtype)
    return weights


@dataclass
class Pruned:
    """Which nodes and edges stay, and every node's influence (unpruned graph)."""

    nodes: torch.Tensor  # [N] bool
    edges: torch.Tensor  # [N, N] bool
    influence: torch.Tensor  # [N]


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's prune_graph: keep the nodes of most influence (`node_threshold` of the total), tokens and
    logits always; of the edges among them, those of most influence (`edge_threshold` of the total, an edge's score
    being its normalised weight times its target's influence plus logit weight); then, until nothing changes, drop
    the feature and error nodes with no kept outgoing edge, the features with no kept incoming one, and their edges.
    Thresholds 1 keep every node and edge (a zero-weight edge too: its score, 0, is the smallest); thresholds 0 keep
    the nodes and the edge of the largest score alone, so no feature survives (it has no kept incoming edge): the
    tokens, the logits, and at most the top error node."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value}: give a fraction from 0 to 1")
    fixed = graph.n_pos + len(graph.logit_tokens)  # tokens and logits, the last nodes
    weights = logit_weights(graph)
    node_influence = influence(normalized(graph.adjacency), weights)
    nodes = node_influence >= threshold(node_influence, node_threshold)
    nodes[-fixed:] = True
    kept = graph.adjacency.clone()
    kept[~nodes] = 0
    kept[:, ~nodes] = 0
    kept = normalized(kept)
    scores = kept * (influence(kept, weights) + weights)[:, None]
    edges = scores >= threshold(scores.flatten(), edge_threshold)
    del kept, scores
    n_features = graph.n_features
    while True:
        before = nodes.clone()
        edges[~nodes] = False
        edges[:, ~nodes] = False
        nodes[:-fixed] &= edges[:, :-fixed].any(0)  # feature and error nodes: an outgoing edge
        nodes[:n_features] &= edges[:n_features].any(1)  # features: an incoming edge
        if torch.equal(nodes, before):
            return Pruned(nodes, edges, node_influence)


def scores(graph: Graph) -> tuple[float, float]:
    """(replacement score, completeness score) of the unpruned graph (circuit-tracer's compute_graph_scores): the
    share of the tokens' and error nodes' influence that is the tokens'; and the influence-weighted mean, over every
    node (its influence plus its logit weight), of the fraction of its normalised inputs that come from no error
    node."""
    n_f, n_errors = graph.n_features, graph.n_layers * graph.n_pos
    weights = logit_weights(graph)
    matrix = normalized(graph.adjacency)
    node_influence = influence(matrix, weights)
    tokens = node_influence[n_f + n_errors : n_f + n_errors + graph.n_pos].sum()
    errors = node_influence[n_f : n_f + n_errors].sum()
    replacement = tokens / (tokens + errors)
    not_error = 1 - matrix[:, n_f : n_f + n_errors].sum(1)
    output = node_influence + weights
    completeness = (not_error * output).sum() / output.sum()
    return float(replacement), float(completeness)
