"""The core evaluation of an SAE (or transcoder) on its source model's text, with the definitions of SAELens's
`run_evals` (sae_lens/evals.py, 6.x) and SAEBench core's latent counts, over the positions that give rows (a
transformers model's special tokens and a runner GPT's first `skip_positions` are left out, as SAELens leaves out
special tokens):

- reconstruction: explained variance 1 - E||y - y'||^2 / (E||y||^2 - ||E y||^2), pooled over every position (SAELens's
  `explained_variance`); mse = E||y - y'||^2 (summed over the width, as SAELens; `mse_per_element` divides by it);
  cossim = E cos(y, y'). y is what the coder predicts (an SAE's input, a transcoder's target).
- shrinkage: E||y||, E||y'||, E(||y'|| / ||y||) and the relative reconstruction bias E||y'||^2 / E(y . y') per batch
  of windows, averaged over batches (SAELens; Eq. 10 of arXiv 2404.16014): 1 is unbiased, < 1 shrinks.
- sparsity: L0 and L1 of the codes per position; each latent's density (the fraction of positions it fires on), the
  fractions that never fire (dead), fire yet write almost nothing (faint: objectives.faint_share, where the coder has
  one decoder row per latent) or fire on over 1% and 10% of positions (dense, SAEBench core), a histogram of
  log10 density.
- downstream: the next-token loss (CE) of the clean model, with the coder spliced in, and with the replaced module's
  output zero- or mean-ablated (the mean is over the first rows read); KL(clean || other) per position; the scores
  (CE_abl - CE_sae) / (CE_abl - CE_clean) and (KL_abl - KL_sae) / KL_abl, NaN with a note where the ablation costs
  too little to divide by. The splice and both ablations replace the same positions, those that give rows, and keep
  the model's own stream elsewhere: a score compares what the coder rebuilds with destroying exactly that, so a coder
  that outputs zeros scores 0 against zero ablation. SAELens's `run_evals` zero-ablates every position, special tokens
  too, while it splices only the others: its scores on a model with special tokens (or position 0 left out) are
  higher than the coder earns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.sae.metrics import loss_recovered
from experiments.sae.objectives import faint_share
from experiments.sae.sources.source import SourceModel, Splice
from runner.data import to_device

DENSE = (0.01, 0.1)  # SAEBench core's dense-latent thresholds: firing on more than 1% and 10% of positions
HISTOGRAM = torch.linspace(-8, 0, 33)  # log10 density bins; a latent that never fires is counted apart


def windows(source: SourceModel, tokens: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """The source's held-out windows, then its training windows, until `tokens` positions that give rows are read:
    (the batch, [windows, positions] True where a position gives a row)."""
    seen = 0
    for loader in (source.data.val_loader(), source.data.train_loader()):
        for batch in loader or ():
            if seen >= tokens:
                return
            mask = source.row_mask(batch)
            seen += int(mask.sum())
            yield batch, mask


def per_token(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, clean: torch.Tensor | None) -> tuple:
    """(next-token losses, KL(clean || these logits) or None) at the masked positions, in float64 sums' inputs."""
    if logits is None or logits.shape[:2] != tokens[:, 1:].shape:
        raise ValueError("the source model's output is not next-token logits [windows, positions, vocab]")
    rows = logits[mask.to(logits.device)].float()
    ce = F.cross_entropy(rows, tokens[:, 1:][mask.to(tokens.device)], reduction="none")
    if clean is None:
        return ce, None
    kl = torch.cat(  # in slices: [positions, vocab] log-probabilities of a 50k vocabulary are large
        [
            F.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            for p, q in zip(clean.split(1024), rows.split(1024), strict=True)
        ]
    )
    return ce, kl


class _Sums:
    """Float64 running sums of the core metrics over positions (and batches, for the relative bias)."""

    def __init__(self, d: int, n_latents: int, device: torch.device) -> None:
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        self.y, self.fires, self.mass, self.scalars = zeros(d), zeros(n_latents), zeros(n_latents), zeros(9)
        self.n, self.batches = 0, 0

    def add(self, y: torch.Tensor, recon: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None) -> None:
        y, recon, values = y.double(), recon.double(), values.double()
        norm_in, norm_out = y.norm(dim=1), recon.norm(dim=1)
        cos = (F.normalize(y, dim=1) * F.normalize(recon, dim=1)).sum(1)
        ratio = norm_out / torch.where(norm_in < 1e-4, 1.0, norm_in)  # SAELens's guard against a zero input
        bias = recon.pow(2).sum(1).mean() / (y * recon).sum(1).mean()
        fired = values != 0
        if indices is None:
            self.fires += fired.sum(0)
            self.mass += values.abs().sum(0)
        else:
            self.fires.index_add_(0, indices.flatten(), fired.flatten().double())
            self.mass.index_add_(0, indices.flatten(), values.abs().flatten())
        self.y += y.sum(0)
        self.scalars += torch.stack(
            [
                y.pow(2).sum(),
                (y - recon).pow(2).sum(),
                cos.sum(),
                norm_in.sum(),
                norm_out.sum(),
                ratio.sum(),
                bias,
                fired.sum(),
                values.abs().sum(),
            ]
        )
        self.n, self.batches = self.n + len(y), self.batches + 1

    def result(self, row_norms: torch.Tensor | None = None) -> dict[str, Any]:
        (y2, sse, cos, n_in, n_out, ratio, bias, l0, l1), n = self.scalars.tolist(), max(self.n, 1)
        faint = {}
        if row_norms is not None:  # latents that fire yet write almost nothing (objectives.faint_share)
            means = {"firing_rate": self.fires / n, "code_mass": self.mass / n, "row_norm": row_norms.double()}
            faint["faint_fraction"] = faint_share(means).item()
        variance = y2 / n - (self.y / n).pow(2).sum().item()
        density = (self.fires / n).cpu()
        logs = density[density > 0].log10().clamp(min=float(HISTOGRAM[0]), max=0.0)
        return {
            "reconstruction": {
                "explained_variance": 1 - (sse / n) / variance if variance > 1e-10 else float("nan"),
                "mse": sse / n,
                "mse_per_element": sse / n / len(self.y),
                "cossim": cos / n,
            },
            "shrinkage": {
                "l2_norm_in": n_in / n,
                "l2_norm_out": n_out / n,
                "l2_ratio": ratio / n,
                "relative_reconstruction_bias": bias / max(self.batches, 1),
            },
            "sparsity": {
                "l0": l0 / n,
                "l1": l1 / n,
                "dead_fraction": (density == 0).double().mean().item(),
                **faint,
                **{f"dense_fraction_{t:g}": (density > t).double().mean().item() for t in DENSE},
                "density_histogram": {
                    "log10_edges": HISTOGRAM.tolist(),
                    "counts": torch.histc(logs, len(HISTOGRAM) - 1, float(HISTOGRAM[0]), 0.0).long().tolist(),
                    "never_fired": int((density == 0).sum()),
                },
            },
            "latent_density": density.tolist(),
        }


def _mean_of(source: SourceModel, name: str, rows: int) -> torch.Tensor:
    # the module's mean output over its first `rows` rows (the held-out windows first), for the mean ablation; the
    # forward stops at the hooked modules (a transcoder's rows: its input's columns, then its target's, `name`'s)
    total, count = None, 0
    for batch, _ in windows(source, rows):
        acts = source.activations(to_device(batch, source.device))
        part = acts[:, -source.widths[name] :].double().sum(0)
        total, count = (part if total is None else total + part), count + len(acts)
    return (total / count).float()


@torch.no_grad()
def core(
    sae: nn.Module,
    source: SourceModel,
    tokens: int,
    splice_tokens: int,
    working: Callable[[int, int | None], None] | None = None,
) -> dict[str, Any]:
    """The core metrics of `sae` on `tokens` positions of `source`'s text (the losses on the first
    `splice_tokens` of them), with how long it took and what it read."""
    started = time.perf_counter()
    sae.eval()
    read = source.name
    target = source.targets[0] if source.targets else None
    replaced = target or read  # what the coder's prediction stands in for, and what is ablated
    mean = _mean_of(source, replaced, min(tokens, 65536))
    sums = _Sums(sae.d_out, sae.n_latents, source.device)
    losses = {k: torch.zeros(2, dtype=torch.float64) for k in ("clean", "spliced", "zero_ablated", "mean_ablated")}
    splice = Splice([read], {replaced: lambda captured: sae(captured[read].float())})
    ablations = {
        "zero_ablated": (replaced, torch.zeros_like),
        "mean_ablated": (replaced, lambda rows: mean.to(rows).expand_as(rows)),
    }
    spliced_positions, n_windows, batches = 0, 0, 0
    for batch, mask in windows(source, tokens):
        batch = to_device(batch, source.device)
        splicing = spliced_positions < splice_tokens
        if splicing:  # the whole forward: its logits are the clean ones the others are compared with
            with source.observing(source.names, batch) as seen:
                _, clean_logits = source.loss(batch)
            x, y = seen[read].float(), seen[target or read].float()
        else:  # the forward stops at the hooked modules
            rows = source.activations(batch).float()
            x, y = (rows[:, : sae.d_in], rows[:, sae.d_in :]) if target else (rows, rows)
        recon, values, indices = sae.reconstruct(x)
        sums.add(y, recon, values, indices)
        if splicing:
            tokens_ = batch["tokens"]
            ce, _ = per_token(clean_logits, tokens_, mask, None)
            clean_rows = clean_logits[mask.to(clean_logits.device)].float()
            del clean_logits  # [windows, positions, vocab]: the kept rows are all that is compared
            losses["clean"] += torch.stack([ce.double().sum().cpu(), torch.zeros((), dtype=torch.float64)])
            for name in ("spliced", "zero_ablated", "mean_ablated"):  # one at a time: logits are most of the memory
                logits = source.run(batch, splice if name == "spliced" else ablations[name])[1]
                ce, kl = per_token(logits, tokens_, mask, clean_rows)
                losses[name] += torch.stack([ce.double().sum(), kl.double().sum()]).cpu()
                del logits
            spliced_positions += int(mask.sum())
        n_windows, batches = n_windows + len(batch["tokens"]), batches + 1
        if working is not None:  # the batches still to read at this one's rows: the pass's length and ETA
            working(batches, batches + -(-max(tokens - sums.n, 0) // max(int(mask.sum()), 1)))
    decoder = getattr(sae, "W_dec", None)  # [n_latents, d] rows; a cross-layer transcoder's are per layer
    out = sums.result(decoder.norm(dim=1) if decoder is not None and decoder.ndim == 2 else None)
    out["downstream"] = _downstream(losses, spliced_positions)
    out["read"] = {"positions": sums.n, "windows": n_windows, "seconds": round(time.perf_counter() - started, 2)}
    return out


def _downstream(losses: dict[str, torch.Tensor], positions: int) -> dict[str, Any]:
    means = {name: (total / max(positions, 1)).tolist() for name, total in losses.items()}
    ce = {name: value[0] for name, value in means.items()}
    kl = {name: value[1] for name, value in means.items() if name != "clean"}
    out: dict[str, Any] = {"positions": positions, "ce_clean": ce["clean"], "notes": []}
    for name in ("spliced", "zero_ablated", "mean_ablated"):
        out[f"ce_{name}"], out[f"kl_{name}"] = ce[name], kl[name]
    for ablation, suffix in (("zero_ablated", ""), ("mean_ablated", "_mean")):
        score, note = loss_recovered(ce[ablation], ce["spliced"], ce["clean"])
        out[f"ce_loss_score{suffix}"] = score
        out[f"kl_div_score{suffix}"] = (
            (kl[ablation] - kl["spliced"]) / kl[ablation] if kl[ablation] > 1e-12 else float("nan")
        )
        if note:
            out["notes"].append(f"{ablation}: {note}")
    return out
