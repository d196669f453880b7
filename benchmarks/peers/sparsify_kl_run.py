"""EleutherAI sparsify's own Trainer on runner's lm GPT, end to end (`loss_fn="kl"`) or by reconstruction
(`loss_fn="fvu"`): run by benchmarks/sae_kl.py in sparsify's virtualenv.

The model is runner's GPT rewritten in plain torch (benchmarks/peers/gpt.py: the same module names, logits equal to
runner's), loaded from the lm run; the dataset is the token windows runner's `+experiment=sae_lm_kl` run trains on,
in its order (a .npy of [windows, seq_len + 1] tokens that sae_kl.py wrote from runner's own loader): each step is
`batch` of them, their first seq_len tokens as `input_ids`. Everything else is sparsify's Trainer.fit as its users run
it, on hook point `blocks.2` (the residual stream after block 2): in kl mode a clean forward for the next-token
probabilities, then a forward whose hook replaces blocks.2's output by the SAE's and -sum(clean_probs * log_probs)
backpropagated through the frozen blocks after it (no AuxK in the loss); in fvu mode its FVU + AuxK; its
initialisation, Adam with its linear warmup and decay, gradient projection and decoder renorm.

runner leaves the first position of each window out of training and splicing (`source.skip_positions=1`: its stream
is an outlier). sparsify leaves positions out by token (`exclude_tokens`, for BOS tokens): here the first position's
id is given as id + vocab_size and `exclude_tokens` lists those ids, and the model reads id mod vocab_size, so
sparsify's own mask leaves exactly that position out (of the SAE's rows, its b_dec init and its dead-latent count) and
its splice keeps the model's own stream there, as runner's does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import gpt  # noqa: E402
from benchmarks.peers.driver import job, own_fve, stamp_steps, write  # noqa: E402


class Windows(Dataset):
    """The windows' inputs as sparsify's tokenised datasets hold them, the left-out first positions marked."""

    def __init__(self, path: str, vocab: int, skip: int) -> None:
        self.tokens, self.vocab, self.skip = np.load(path, mmap_mode="r"), vocab, skip

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.array(self.tokens[i, :-1], dtype=np.int64))
        ids[: self.skip] += self.vocab  # an id sparsify's exclude_tokens names: the position is left out
        return {"input_ids": ids}


class Marked(nn.Module):
    """The GPT reading marked ids as their tokens; `base_model` is the GPT, so hook points keep runner's names."""

    def __init__(self, model: gpt.GPT) -> None:
        super().__init__()
        self.gpt = model

    @property
    def base_model(self) -> nn.Module:
        return self.gpt

    @property
    def device(self) -> torch.device:
        return self.gpt.device

    @property
    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        return self.gpt.dummy_inputs

    def forward(self, input_ids: torch.Tensor) -> gpt.Output:
        return self.gpt(input_ids.remainder(self.gpt.vocab_size))


def main() -> None:
    spec = job()
    from sparsify import SaeConfig, TrainConfig, Trainer

    torch.manual_seed(spec["seed"])
    model = Marked(gpt.load(spec["lm"], spec["device"]))
    vocab = model.gpt.vocab_size
    with torch.no_grad():  # the probe's logits: sae_kl.py checks them against runner's GPT's
        probe = model.gpt(torch.from_numpy(np.load(spec["probe"]))).logits
    np.save(Path(spec["out"]).with_name(Path(spec["out"]).stem + "-probe.npy"), probe.numpy())
    dataset = Windows(spec["windows"], vocab, spec["skip_positions"])
    if len(dataset) < spec["steps"] * spec["batch"]:
        raise SystemExit(
            f"{spec['windows']} holds {len(dataset)} windows: fewer than {spec['steps']} x {spec['batch']}"
        )
    cfg = TrainConfig(
        SaeConfig(num_latents=spec["n_latents"], k=spec["k"]),
        batch_size=spec["batch"],  # windows per step
        loss_fn=spec["loss_fn"],
        optimizer="adam",  # its default is signum
        lr=spec["lr"],
        lr_warmup_steps=spec["lr_warmup_steps"],
        auxk_alpha=spec["auxk_coeff"],  # fvu only: kl's loss is the KL alone
        dead_feature_threshold=spec["dead_tokens"],
        exclude_tokens=list(range(vocab, 2 * vocab)),
        hookpoints=[spec["hookpoint"]],
        init_seeds=[spec["seed"]],
        save_every=10**9,
        log_to_wandb=False,
        save_dir=str(Path(spec["out"]).parent / "sparsify-checkpoints"),
    )
    trainer = Trainer(cfg, torch.utils.data.Subset(dataset, range(spec["steps"] * spec["batch"])), model)
    stamps = stamp_steps(trainer.optimizers[0], spec)
    trainer.fit()
    sae = trainer.saes[spec["hookpoint"]]
    own = {"fve": own_fve(lambda x: sae(x.to(sae.device)).sae_out.float().cpu(), spec), "tool": "sparsify"}
    weights = {
        "W_enc": sae.encoder.weight.t(),
        "b_enc": sae.encoder.bias,
        "W_dec": sae.W_dec,
        "b_dec": sae.b_dec,
        "center": sae.b_dec,
        "scale": torch.ones(()),
    }
    write(spec, stamps, weights, own)


if __name__ == "__main__":
    main()
