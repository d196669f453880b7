"""The dead-latent clock every SAE keeps: per latent, the optimizer steps (or samples) since it last fired, counted
over every rank's rows where ranks share the SAE. A latent silent for `dead_window` is dead: AuxK trains it, and
`silent_fraction` counts it."""

from __future__ import annotations

import torch

from experiments.sae.coders.init import ranks_share
from runner import ConfigError
from runner.progress import parse_duration


def dead_clock(dead_window: str) -> tuple[str, float]:
    """(unit, length) of a `dead_window`: optimizer steps ("st") or samples ("sa"; tokens count as samples)."""
    window = parse_duration(dead_window)
    if window.unit not in ("st", "sa", "tok"):
        raise ConfigError(f"model.dead_window={dead_window}: give it in optimizer steps (st) or samples (sa)")
    return ("st" if window.unit == "st" else "sa"), window.value


# More than this share of an SAE's latents firing on none of the validation split is said at the end of the run
DEAD_SAID = 0.01


def dead_advice(
    metrics: dict[str, float], n_latents: int, revive: str, prefix: str = "", what: str = "SAE"
) -> list[str]:
    """The line that says a coder (`what`: SAE, transcoder...) left latents unused: above DEAD_SAID of them never
    fired on the final validation (`val/<prefix>dead_fraction`), with `revive`, what to change; none otherwise."""
    dead = metrics.get(f"val/{prefix}dead_fraction")
    if dead is None or dead <= DEAD_SAID:
        return []
    who = f"{what} {prefix.rstrip('/')}'s" if prefix else f"{what}'s"
    return [
        f"{dead:.1%} of the {who} {n_latents} latents ({round(dead * n_latents)}) never fired on the validation "
        f"split (val/{prefix}dead_fraction): {revive}"
    ]


def faint_advice(
    metrics: dict[str, float], n_latents: int, unit_rows: bool, key: str, prefix: str = "", spare: str | None = None
) -> list[str]:
    """The line that says more than 1% of the latents fire yet write almost nothing (val/<prefix>faint_fraction:
    objectives.faint_share), with the cause where it is known (free decoder rows that shrank) or `spare`."""
    faint = metrics.get(f"val/{prefix}faint_fraction")
    if faint is None or faint <= DEAD_SAID:
        return []
    who = f"{prefix.rstrip('/')}'s" if prefix else "the coder's"
    line = (
        f"{faint:.1%} of {who} {n_latents} latents ({round(faint * n_latents)}) fire but write under a tenth of the "
        f"median latent's output (val/{prefix}faint_fraction: mean code when firing times decoder row norm)"
    )
    if spare:
        return [f"{line}: {spare}"]
    if unit_rows:
        return [f"{line}: they add almost nothing to the reconstruction, and dead_fraction does not count them"]
    return [
        f"{line}: free decoder rows ({key}.unit_norm_decoder=false) shrank towards zero while their latents kept "
        f"firing; {key}.unit_norm_decoder=true holds every row at unit norm, and a higher L0 leaves fewer (a JumpReLU "
        "on a GPT's residual stream after 5 epochs: 4.4-4.8% at L0 9-13 free, none unit, 0.7% at L0 40 free)"
    ]


class DeadLatents:
    """The clock's buffers and counting, mixed into SAE (an nn.Module with `n_latents`, `dead_unit`, `dead_window`)."""

    def advice(self, metrics: dict[str, float], prefix: str = "", key: str = "model") -> list[str]:
        """Said at the end of the run (runner.train): the latents that never fired on the validation split, when
        more than 1% of them, with what trains them back (`key`: where this SAE's settings are in the config)."""
        what = "transcoder" if getattr(self, "transcoder", False) else "SAE"
        revive = self.surplus(metrics, prefix, key) or self.revive_hint(key)
        if "val/true_features" not in metrics and getattr(self, "encoder_init", None) == "fit" and what == "SAE":
            # the synthetic preset's start, on a model's activations (`+experiment=sae data=activations_file`)
            revive += (
                f"; on a model's activations the fitted encoder start ({key}.encoder_init=fit) is most of it: "
                f"{key}.encoder_init=unit left under 1% unused on a GPT's residual stream (for a file, "
                "+experiment=sae_file has that start with Muon and a dead window in rows)"
            )
        return dead_advice(metrics, self.n_latents, revive, prefix, what) + self.faint_advice(metrics, prefix, key)

    def faint_advice(self, metrics: dict[str, float], prefix: str = "", key: str = "model") -> list[str]:
        """faint_advice for this coder: spare width where the data's true features say so (surplus)."""
        unit = getattr(self, "unit_norm_decoder", True)
        return faint_advice(metrics, self.n_latents, unit, key, prefix, self.surplus(metrics, prefix, key))

    def surplus(self, metrics: dict[str, float], prefix: str = "", key: str = "model") -> str | None:
        """Where the data's true features are known (val/true_features) and this SAE has more latents than those,
        with no more latents dead or faint than the surplus: what says so (no remedy gives such latents a feature)."""
        # a latent that fires but writes almost nothing (faint) is as unused as a dead one
        true = metrics.get("val/true_features")
        unused = metrics.get(f"val/{prefix}dead_fraction", 0.0) + metrics.get(f"val/{prefix}faint_fraction", 0.0)
        if not true or self.n_latents <= true or round(unused * self.n_latents) > self.n_latents - true:
            return None
        found = metrics.get(f"val/{prefix}mmcs")
        return (
            f"the data has {true:g} true features (val/true_features){f', found at MMCS {found:.4f}' if found else ''}"
            f", so {self.n_latents - true:g} of the latents have none of their own to learn: spare width, not a "
            f"failure of training, which no dead-latent remedy changes ({key}.n_latents sets the width)"
        )

    def revive_hint(self, key: str = "model") -> str:
        """What trains dead latents back, for this SAE's settings (under the config node `key`)."""
        if getattr(self, "auxk_coeff", 0) > 0:
            window = f"{key}.dead_window={self.dead_window:g}{self.dead_unit}"
            return (
                f"AuxK ({key}.auxk_coeff={self.auxk_coeff:g}) trains latents silent for {window}: a shorter window or "
                "a larger coefficient brings them back sooner, as does a longer trainer.max_duration"
            )
        return "nothing in this SAE trains a latent that stopped firing: a TopK SAE (model=sae_topk) has AuxK for that"

    def _register_clock(self, n_latents: int) -> None:
        # Per latent: steps (or samples) since it last fired, and the running counters that measure it.
        self.register_buffer("since_fired", torch.zeros(n_latents))
        self.register_buffer("fired", torch.zeros(n_latents, dtype=torch.bool))  # within the current step
        # Dead latents as of the last optimizer step, kept on the device: AuxK reads them with no host read.
        self.register_buffer("dead", torch.zeros(n_latents, dtype=torch.bool), persistent=False)

    def _tick(self) -> None:
        # after an optimizer step: a step's firing counted, and the dead latents the next steps' AuxK reads
        if self.dead_unit == "st":
            self.since_fired.add_(1).masked_fill_(self.fired, 0)
            self.fired.zero_()
        self.dead.copy_(self.dead_mask())

    def logged(self, metrics: dict[str, float], prefix: str = "") -> None:
        """Told the run's last logged row (runner's loop does, after each row): on CUDA AuxK runs while that row saw
        dead latents, and no step reads the device to decide it (on the CPU each step counts them: no wait there).
        `prefix`: this SAE's metric prefix in a family (model=sae_multi)."""
        self.auxk_active = metrics.get(f"train/{prefix}silent_fraction", 0.0) > 0

    @property
    def n_dead(self) -> int:
        """How many latents AuxK treats as dead this step (a host read: for tests and reports, not the step)."""
        return int(self.dead.sum())

    def _track(self, codes_fired: torch.Tensor, batch: int) -> None:
        # codes_fired: [n_latents] bool, latents that fired anywhere in this micro-batch
        rows: int | torch.Tensor = batch
        if ranks_share(self):
            # Every rank's rows: a latent fired if it fired on any rank, and the window counts all ranks' rows (one
            # small all-reduce queued on the device). Otherwise DDP, which broadcasts buffers from rank 0 at each
            # forward, would leave rank 0's data alone deciding which latents are dead.
            both = torch.cat([codes_fired.float(), codes_fired.new_full((1,), batch, dtype=torch.float32)])
            torch.distributed.all_reduce(both)
            codes_fired, rows = both[:-1] > 0, both[-1]
        if self.dead_unit == "st":
            self.fired |= codes_fired
        else:
            self.since_fired.add_(rows).masked_fill_(codes_fired, 0)

    def track(self, values: torch.Tensor, indices: torch.Tensor | None) -> None:
        """Count which latents fired in a training micro-batch's codes (as `activate` gives them)."""
        fired = values.detach() > 0
        if indices is None:
            self._track(fired.any(0), values.shape[0])
        else:  # no host sync: scatter the per-row hits into a per-latent count
            hits = torch.zeros(self.n_latents, device=values.device).index_add_(
                0, indices.flatten(), fired.flatten().float()
            )
            self._track(hits > 0, values.shape[0])

    def dead_mask(self) -> torch.Tensor:
        """Latents that have not fired within dead_window."""
        return self.since_fired >= self.dead_window
