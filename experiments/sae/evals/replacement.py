"""The replacement evaluation (runner.sae_eval evals=[replacement]): how much of a source GPT's next-token prediction
its replacement model explains, over held-out prompts. The coders are a cross-layer transcoder's run or one
transcoder's run per block (experiments/sae/circuits/load.py); each prompt is the first `prompt_tokens` tokens of one
of the source's held-out windows (the validation split core reads first, never its training windows); its unpruned
attribution graph (circuits/attribute.py, runner.attribute's settings) gives circuit-tracer's two scores
(circuits/prune.py): the replacement score, the share of the logits' influence reaching the tokens rather than the
error nodes, and the completeness score, the influence-weighted share of the nodes' inputs that come from no error
node. Both are 1 for coders that reproduce every MLP exactly. Coders that decode nothing (every MLP output all error)
do not score 0: the tokens still reach the logits along the residual stream and through attention, and the
replacement score is then their share of each logit's direct inputs (weighted by its probability), the completeness
(1 + that) / 2, since the tokens and error nodes have no inputs and count as complete themselves
(tests/unit/test_replacement_eval.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.sae.circuits.attribute import attribute
from experiments.sae.circuits.coders import CoderSet
from experiments.sae.circuits.frozen_hf import freeze, model_window
from experiments.sae.circuits.load import load_coders
from experiments.sae.circuits.prune import scores
from experiments.sae.sources.source import SourceModel
from runner import ConfigError

Progress = Callable[[int, int | None], None] | None


@dataclass
class Circuits:
    """What the replacement evaluation reads: the source GPT (runner's, or transformers' with its tokenizer), its
    coders, what they came from (load_coders's meta), and the graphs' settings (runner.attribute's defaults)."""

    gpt: nn.Module
    coders: CoderSet
    meta: dict[str, Any]
    tokenizer: Any = None
    prompts: int = 16
    prompt_tokens: int = 32
    max_logits: int = 10
    logit_mass: float = 0.95
    batch_size: int = 64

    def describe(self) -> dict[str, Any]:
        """eval.json's `coder`: the kind of coder set, its runs, its widths, its source."""
        layers = self.coders.layers
        clt = len(self.coders.writes_to(0)) > 1  # a CLT's first layer writes to every later one
        return {
            "class": "cross-layer transcoder" if clt else "transcoder per block",
            "runs": self.meta["coder"],
            "layers": self.coders.n_layers,
            "latent_class": type(layers[0].coder).__name__,
            "n_latents": sum(int(one.coder.n_latents) for one in layers),
            "n_latents_per_layer": [int(one.coder.n_latents) for one in layers],
            "source": str(self.meta["model"]),
            "skip_positions": self.meta["skip_positions"],
        }


def load_circuits(
    paths: Sequence[Path], trusted: Sequence[str], device: str, prompts: int = 16, prompt_tokens: int = 32
) -> Circuits:
    """The coder set of the run folders `paths` (a CLT's, or one transcoder's per block) on `device`, or why not."""
    loaded = load_coders(paths, trusted, device)
    model = loaded.model
    window = getattr(model, "seq_len", None) or (model_window(model) if loaded.tokenizer is not None else None)
    if window is not None and prompt_tokens > window:
        raise ConfigError(
            f"prompt_tokens={prompt_tokens}: the source model reads at most {window} tokens at once; give "
            f"prompt_tokens={window} or fewer"
        )
    return Circuits(model, loaded.coders, loaded.meta, loaded.tokenizer, prompts, prompt_tokens)


def held_out_prompts(source: SourceModel, count: int, length: int) -> torch.Tensor:
    """[n, length]: the first `length` tokens of each of the source's first `count` held-out windows (n <= count)."""
    prompts: list[torch.Tensor] = []
    for batch in source.data.val_loader() or ():
        prompts += list(batch["tokens"][:, :length])
        if len(prompts) >= count:
            break
    if not prompts:
        raise ConfigError(
            f"{source.checkpoint}'s data gives no held-out windows to take prompts from: the replacement evaluation "
            "reads its validation split (data.val_windows, data.val_every of that run)"
        )
    if prompts[0].shape[0] < length:
        raise ConfigError(
            f"prompt_tokens={length}: the source's held-out windows hold {prompts[0].shape[0]} tokens; give fewer"
        )
    return torch.stack(prompts[:count])


def _spread(values: list[float]) -> dict[str, float]:
    # the population's standard deviation: the spread of these prompts' scores, not an estimate of another sample's
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }


def graph_scores(circuits: Circuits, prompts: torch.Tensor, progress: Progress = None) -> dict[str, Any]:
    """Each prompt's unpruned graph's (replacement, completeness) scores, their mean and spread, what was read."""
    started, per_prompt = time.perf_counter(), []
    device = circuits.coders.layers[0].coder.W_dec.device
    for i, prompt in enumerate(prompts):
        frozen = freeze(circuits.gpt, prompt.to(device), circuits.coders, transformers=circuits.tokenizer is not None)
        graph = attribute(frozen, circuits.coders, circuits.max_logits, circuits.logit_mass, circuits.batch_size)
        replacement, completeness = scores(graph)
        per_prompt.append(
            {
                "replacement": replacement,
                "completeness": completeness,
                "features": graph.n_features,
                "logits": len(graph.logit_tokens),
            }
        )
        if progress is not None:
            progress(i + 1, len(prompts))
    column = lambda key: [p[key] for p in per_prompt]  # noqa: E731
    return {
        "replacement_score": _spread(column("replacement")),
        "completeness_score": _spread(column("completeness")),
        "read": {
            "prompts": len(per_prompt),
            "prompt_tokens": int(prompts.shape[1]),
            "features_mean": statistics.fmean(column("features")),
            "logits_mean": statistics.fmean(column("logits")),
            "max_logits": circuits.max_logits,
            "logit_mass": circuits.logit_mass,
            "seconds": round(time.perf_counter() - started, 2),
        },
        "per_prompt": per_prompt,
    }


def replacement(circuits: Circuits, source: SourceModel, progress: Progress = None) -> dict[str, Any]:
    """The replacement and completeness scores of `circuits` over the source's held-out prompts, and notes."""
    prompts = held_out_prompts(source, circuits.prompts, circuits.prompt_tokens)
    result = graph_scores(circuits, prompts, progress)
    notes = [
        "replacement score: the share of the logits' influence that reaches the prompt's tokens rather than the error "
        "nodes (what the coders fail to predict); completeness: the influence-weighted share of every node's inputs "
        "that come from no error node. Both are circuit-tracer's, of the unpruned graph; 1 is a replacement model "
        "that explains everything."
    ]
    if len(prompts) < circuits.prompts:
        notes.append(
            f"the source's held-out split holds {len(prompts)} windows: {len(prompts)} prompts, not {circuits.prompts}"
        )
    return {**result, "notes": notes}
