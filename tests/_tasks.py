"""Test-only tasks for subprocess runs (the tests put this folder on PYTHONPATH)."""

import torch

from experiments.digits import MLPClassifier


class SkewedValidation(MLPClassifier):
    """Digits, plus a validation metric 'skew' that rank 0's data alone would see improve at every validation
    (1/k at the k-th) and rank 1's alone would see worsen (k): only their exact reduction decides early stopping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validations = 0

    def validation_step(self, batch):
        out = super().validation_step(batch)
        self.validations += 1  # one batch per rank and validation (val_batch_size >= the rank's shard)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        k = float(self.validations)
        return {**out, "skew": torch.tensor(k if rank == 1 else 1 / k)}
