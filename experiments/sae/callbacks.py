"""SAE callbacks: ground-truth feature recovery at each validation, and Anthropic-style resampling of silent latents
(for SAEs and transcoders alike)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from experiments.sae.coders.multi import combined, from_every_rank, members, spread_over_ranks
from experiments.sae.evals.ground_truth import KEYS, score_sae
from experiments.sae.metrics import feature_recovery, relative_error
from runner import ConfigError
from runner.config.trust import buildable
from runner.progress import parse_duration
from runner.run import Callback

if TYPE_CHECKING:
    from runner.run import Run


def _fetch(dataset: Any, indices: list[int]) -> torch.Tensor:
    # the activations at `indices`, as the training loader would batch them
    batch = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
    if isinstance(batch, list):
        batch = torch.utils.data.default_collate(batch)
    return batch[0] if isinstance(batch, (tuple, list)) else batch


@buildable("callback")
class GroundTruthRecovery(Callback):
    """Adds val/mmcs and val/recovered_<t> when the validation data knows its true features (synthetic data); for a
    transcoder on data that knows its target directions, the decoder is scored against those, and val/encoder_mmcs
    scores the encoder against the input's directions and val/skip_error a skip map against the true linear part.
    Where the validation data also keeps each sample's true codes (data=synth_sae_bench), SynthSAEBench's metrics
    too: val/gt_mcc, val/gt_f1, val/gt_precision, ... (experiments/sae/evals/ground_truth.py)."""

    def __init__(self, thresholds: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)) -> None:
        self.thresholds = tuple(thresholds)
        recovered = (f"val/recovered_{t:g}" for t in self.thresholds)
        benchmark = (f"val/gt_{k}" for k in KEYS)
        self.provides = ("val/mmcs", *recovered, "val/encoder_mmcs", "val/skip_error", "val/true_features", *benchmark)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Score the decoder against the truth (metrics added here are logged with the validation's row)."""
        dataset = run.val_loader.dataset if run.val_loader is not None else None
        if getattr(dataset, "true_features", None) is None:
            return
        # the dictionary size the data needs: an SAE wider than this leaves latents with no feature of their own
        metrics["val/true_features"] = float(len(dataset.true_features))
        own = {prefix: self._scores(sae, dataset) for prefix, sae in members(run.task)}
        per_sae = from_every_rank(run, own)  # distributed=spread: each rank scored its own SAEs
        for prefix, scores in per_sae.items():
            metrics.update({f"val/{prefix}{k}": v for k, v in scores.items()})
        if len(per_sae) > 1:  # a family's unprefixed scores: the mean over its SAEs
            metrics.update({f"val/{k}": v for k, v in combined(per_sae).items()})

    def _scores(self, sae, dataset: Any) -> dict[str, float]:
        device, targets = sae.W_dec.device, getattr(dataset, "true_targets", None)
        if not getattr(sae, "transcoder", False):
            scores = feature_recovery(sae.W_dec.detach(), dataset.true_features.to(device), self.thresholds)
            if hasattr(dataset, "truth_batches"):
                benchmark = score_sae(sae, dataset.true_features, dataset.truth_batches())
                scores.update({f"gt_{k}": v for k, v in benchmark.items()})
            return scores
        if targets is None:  # a transcoder on data whose target directions are unknown: nothing to score
            return {}
        scores = feature_recovery(sae.W_dec.detach(), targets.to(device), self.thresholds)
        # Encoder columns live in the input's space: input_scale scales the inputs, not the directions.
        truth = dataset.true_features.to(device)
        scores["encoder_mmcs"] = feature_recovery(sae.W_enc.detach().t(), truth, ())["mmcs"]
        linear = getattr(dataset, "true_linear", None)
        if linear is not None and getattr(sae, "W_skip", None) is not None:
            # raw y_hat's skip part is (x * input_scale) @ W_skip / target_scale: the map in raw units
            raw = sae.W_skip.detach().float() * sae.input_scale / sae.target_scale
            scores["skip_error"] = relative_error(raw, linear.to(device))
        return scores


class ResampleDead(Callback):
    """Every `every` (until `until`), re-initialise silent latents (none fired within `dead_window`) towards inputs
    the SAE reconstructs worst (for a transcoder: whose targets it predicts worst).

    As in Anthropic's 'Towards Monosemanticity': sample inputs with probability proportional to their squared
    reconstruction error, point the dead latents' decoder rows at them (unit norm), set their encoder columns to the
    same direction scaled to `encoder_scale` x the mean norm of live encoder columns, zero their encoder bias (and set
    a JumpReLU threshold back to its initial value), and reset the optimizer state of every touched entry. For a
    transcoder the decoder rows point at the sampled targets (minus b_dec) and the encoder columns at their inputs.
    """

    def __init__(
        self, every: str = "250st", until: str = "0.5dur", samples: int = 8192, encoder_scale: float = 0.2
    ) -> None:
        self.every, self.until = parse_duration(every), parse_duration(until)
        self.samples, self.encoder_scale = samples, encoder_scale
        self.resampled = 0

    def on_fit_start(self, run: Run) -> None:
        """Refuse a family spread over ranks: its ranks hold different SAEs, and resampling draws rank 0's inputs for
        the same SAEs on every rank."""
        if spread_over_ranks(run.task):
            raise ConfigError(
                "callbacks.sae_resample does not run under distributed=spread; AuxK (the TopK SAEs' default) revives "
                "dead latents without it: leave sae_resample out, or use distributed=ddp"
            )

    @torch.no_grad()
    def on_optimizer_step(self, run: Run) -> None:
        """Resample at each tick of `every` while `until` has not elapsed (each SAE of a family)."""
        p = run.progress
        if not p.ticked(self.every) or p.elapsed(self.until):
            return
        rows, rows_of = None, getattr(run.task, "rows_of", None)
        for prefix, sae in members(run.task):
            # Each rank tracks firing on its own data: a latent is resampled when it is dead on every rank, so that
            # the ranks change the same latents alike (one read of the device per resampling tick).
            dead = (run.strategy.all_sum(sae.dead_mask().float()) == run.world_size).nonzero().flatten()
            if len(dead) > 0:
                rows = self._inputs(run) if rows is None else rows  # one draw of inputs for the whole family
                mine = rows_of(rows, prefix[:-1]) if rows_of is not None else rows  # a hooked module's columns
                self._resample(run, sae, dead, mine.to(sae.W_dec.device))

    def _resample(self, run: Run, sae, dead: torch.Tensor, rows: torch.Tensor) -> None:
        split = getattr(sae, "split", None)  # a transcoder's rows are [input | target]; an SAE's target is its input
        x, y = split(rows) if split is not None else (rows, rows)
        transcoder = getattr(sae, "transcoder", False)
        xn = x.float() * sae.input_scale
        yn = y.float() * sae.target_scale if transcoder else xn
        recon = sae.decode(*sae.activate(sae.pre_activations(xn)))
        if hasattr(sae, "skip_part"):  # the error of the whole prediction, a skip map's part included (0 without)
            recon = recon + sae.skip_part(xn)
        err = (recon - yn).pow(2).sum(1)
        picks = torch.multinomial(err / err.sum(), len(dead), replacement=len(dead) > len(err))
        directions = F.normalize(yn[picks] - sae.b_dec, dim=1)
        # An SAE's encoder reads x - b_dec (the decoder's direction), a transcoder's its input (b_dec is the target's).
        encoder = F.normalize(xn[picks] - sae.pre_bias, dim=1) if transcoder else directions
        alive = torch.ones(sae.n_latents, dtype=torch.bool, device=dead.device)
        alive[dead] = False
        norm = sae.W_enc[:, alive].norm(dim=0).mean() if alive.any() else torch.tensor(1.0)
        sae.W_dec[dead] = directions
        sae.W_enc[:, dead] = encoder.t() * norm * self.encoder_scale
        sae.restart_latents(dead)  # encoder bias, dead counter, a JumpReLU threshold
        self._reset_optimizer_state(run.optimizer, sae, dead)
        self.resampled += len(dead)

    def _inputs(self, run: Run) -> torch.Tensor:
        # Training rows (a transcoder's: [input | target], split by the SAE) that a resumed run draws alike (indices
        # from the step, not from the loader's position), that leave the training data as it was (a live activation
        # buffer is put back: what is drawn is what comes next), and rank 0's on every rank, so that every rank
        # points the dead latents at the same inputs.
        dataset, chunk = run.train_loader.dataset, run.progress.batch_size
        if not hasattr(dataset, "__len__"):
            raise ConfigError("callbacks.sae_resample draws inputs by index: it needs map-style training data")
        generator = torch.Generator().manual_seed(run.progress.step)
        indices = torch.randint(len(dataset), (self.samples,), generator=generator).tolist()
        with getattr(dataset, "peek", contextlib.nullcontext)():
            parts = [_fetch(dataset, indices[i : i + chunk]) for i in range(0, len(indices), chunk)]
        x = torch.cat(parts)
        return run.strategy.gather(x.cpu())[0] if run.world_size > 1 else x

    @staticmethod
    def _reset_optimizer_state(optimizer: torch.optim.Optimizer, sae, dead: torch.Tensor) -> None:
        for param, index in sae.latent_slices(dead).items():
            for value in optimizer.state.get(param, {}).values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    value[index] = 0.0

    def state_dict(self) -> dict[str, int]:
        """How many latents were resampled."""
        return {"resampled": self.resampled}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore state_dict()."""
        self.resampled = state["resampled"]
