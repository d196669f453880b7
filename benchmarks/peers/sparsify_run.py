"""EleutherAI sparsify's own Trainer on an activation file (run by benchmarks/sae_peers.py in sparsify's virtualenv).

sparsify trains on a Hugging Face model's hooked activations: its Trainer finds the hook point by name in
`model.base_model`, runs `model(input_ids)` once per batch and trains in a forward hook. Here the model is a stand-in
whose hook point returns the file's rows: "token" i of the dataset is row i, and a batch is `batch // 128` sequences
of 128 positions, so every step trains on `batch` rows in file order. Everything else is sparsify's Trainer.fit as its
users run it: its initialisation (nn.Linear encoder, decoder its normalised copy, b_dec the first batch's mean), FVU
loss, AuxK over dead latents, Adam with its linear warmup and decay, gradient projection and decoder renorm. On CUDA its
forward runs under bf16 autocast whatever the job's precision (a decorator of SparseCoder.forward); on the CPU in fp32.

A transcoder (`d_out` in the job: SaeConfig(transcode=True), and skip_connection=True for the skip contender):
sparsify's hook reads the hooked module's input as the transcoder's input and its output as the target, so the
stand-in's hook point takes the rows' input columns and returns their target columns (the same rows: the same ids).
Then it is sparsify's transcoder recipe: no input centring (the encoder bias starts at minus the first batch's input
mean through the encoder), decoder zero at the start and not renormalised, b_dec the first batch's target mean, W_skip
zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.driver import job, own_fve, rows, split, stamp_steps, write  # noqa: E402

POSITIONS = 128  # positions per sequence


class Rows(Dataset):
    """Sequences of consecutive row numbers, as sparsify's tokenised datasets hold sequences of token ids."""

    def __init__(self, n_rows: int) -> None:
        self.n = n_rows // POSITIONS

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(i * POSITIONS, (i + 1) * POSITIONS)}


class Target(nn.Module):
    """The hook point: its input is the rows' input columns, its output their target columns (an SAE's: the rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.y: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.y is None else self.y


class FileModel(nn.Module):
    """A stand-in for a transformer: `acts`, the hook point, reads and outputs the file's rows that the ids name."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.array, self.spec = rows(spec["train"]), spec
        self.acts = Target()
        self.device = torch.device(spec["device"])
        self.dummy_inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}

    @property
    def base_model(self) -> nn.Module:
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.flatten().cpu().numpy()
        batch = torch.from_numpy(np.ascontiguousarray(self.array[ids])).view(*input_ids.shape, -1)
        x, y = (part.to(self.device, non_blocking=True) for part in split(batch, self.spec))
        self.acts.y = y if self.spec["d_out"] else None
        return self.acts(x)


def main() -> None:
    spec = job()
    from sparsify import SaeConfig, TrainConfig, Trainer

    torch.manual_seed(spec["seed"])
    model = FileModel(spec)
    transcode, width = bool(spec["d_out"]), int(model.array.shape[1])
    if transcode and width != 2 * spec["d_out"]:  # its W_skip and encoder are [d, d], d the hooked output's width
        raise SystemExit(f"sparsify's transcoders read and write one width: rows of {width} != 2 x {spec['d_out']}")
    cfg = TrainConfig(
        SaeConfig(num_latents=spec["n_latents"], k=spec["k"], transcode=transcode, skip_connection=spec["skip"]),
        batch_size=spec["batch"] // POSITIONS,
        loss_fn="fvu",
        optimizer="adam",
        lr=spec["lr"],
        lr_warmup_steps=spec["lr_warmup_steps"],
        auxk_alpha=spec["auxk_coeff"],
        dead_feature_threshold=spec["dead_steps"] * spec["batch"],  # in tokens: the same number of steps
        hookpoints=["acts"],
        init_seeds=[spec["seed"]],
        save_every=10**9,
        log_to_wandb=False,
        save_dir=str(Path(spec["out"]).parent / "sparsify-checkpoints"),
    )
    trainer = Trainer(cfg, Rows(spec["steps"] * spec["batch"]), model)
    stamps = stamp_steps(trainer.optimizers[0], spec)
    trainer.fit()
    sae = trainer.saes["acts"]
    own = {"fve": own_fve(lambda x: sae(x.to(sae.device)).sae_out.float().cpu(), spec), "tool": "sparsify"}
    weights = {
        "W_enc": sae.encoder.weight.t(),
        "b_enc": sae.encoder.bias,
        "W_dec": sae.W_dec,
        "b_dec": sae.b_dec,
        "center": torch.zeros_like(sae.b_dec) if transcode else sae.b_dec,  # a transcoder's input is not centred
        "scale": torch.ones(()),
    }
    if sae.W_skip is not None:
        weights["W_skip"] = sae.W_skip.t()  # sparsify adds x @ W_skip.mT
    write(spec, stamps, weights, own)


if __name__ == "__main__":
    main()
