"""graph.json: a pruned attribution graph as data (nodes, edges, scores, the prompt's tokens, what it came from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.sae.circuits.attribute import Graph
from experiments.sae.circuits.prune import Pruned
from runner.rundir.files import write_atomic


def _node(graph: Graph, i: int) -> dict[str, Any]:
    n_f, n_pos, n_layers = graph.n_features, graph.n_pos, graph.n_layers
    if i < n_f:
        layer, pos, latent = graph.features[i].tolist()
        return {
            "kind": "feature",
            "layer": layer,
            "pos": pos,
            "latent": latent,
            "activation": float(graph.activations[i]),
        }
    i -= n_f
    if i < n_layers * n_pos:
        layer, pos = divmod(i, n_pos)
        return {"kind": "error", "layer": layer, "pos": pos, "norm": float(graph.error_norms[layer, pos])}
    i -= n_layers * n_pos
    if i < n_pos:
        return {"kind": "token", "pos": i, "token": graph.tokens[i]}
    i -= n_pos
    return {
        "kind": "logit",
        "pos": n_pos - 1,
        "token": int(graph.logit_tokens[i]),
        "probability": float(graph.logit_probabilities[i]),
    }


def graph_data(graph: Graph, pruned: Pruned, scores: tuple[float, float], meta: dict[str, Any]) -> dict[str, Any]:
    """The pruned graph as JSON-ready data: kept nodes (ids 0..), kept nonzero edges (source, target, weight)."""
    kept = pruned.nodes.nonzero().flatten().tolist()
    ids = {node: n for n, node in enumerate(kept)}
    nodes = [{"id": ids[i], **_node(graph, i), "influence": float(pruned.influence[i])} for i in kept]
    edges = pruned.edges & (graph.adjacency != 0)
    edges[~pruned.nodes] = False
    edges[:, ~pruned.nodes] = False
    targets, sources = edges.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources]
    return {
        **meta,
        "tokens": graph.tokens,
        "n_layers": graph.n_layers,
        "scores": {"replacement": scores[0], "completeness": scores[1]},
        "unpruned": {
            "features": graph.n_features,
            "nodes": len(graph.adjacency),
            "edges": int((graph.adjacency != 0).sum()),
        },
        "nodes": nodes,
        "edges": [
            {"source": ids[s], "target": ids[t], "weight": w}
            for s, t, w in zip(sources.tolist(), targets.tolist(), weights.tolist(), strict=True)
        ],
    }


def write_graph(path: Path, data: dict[str, Any]) -> Path:
    """`data` as compact JSON at `path`, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, separators=(",", ":")).encode())
