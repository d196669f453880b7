"""The probe both evaluations fit (sparse probing, absorption): L2 logistic regression as scikit-learn fits it, in
torch, so that the evaluations need no scikit-learn."""

from __future__ import annotations

import torch


def fit_logistic(
    x: torch.Tensor, y: torch.Tensor, c: float = 1.0, balanced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 logistic regression as scikit-learn's LogisticRegression(C=c) fits it: (weights, bias) minimising
    0.5 ||w||^2 + c * sum of the log losses (the bias unpenalised), by L-BFGS in float64; `balanced`: each class's
    losses weighted by n / (2 n_class), as its class_weight="balanced"."""
    x, sign = x.double(), y.double() * 2 - 1
    weight = torch.ones_like(sign)
    if balanced:
        positives = y.double().sum().clamp(1, len(y) - 1)
        weight = torch.where(y.bool(), len(y) / (2 * positives), len(y) / (2 * (len(y) - positives)))
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=1000, tolerance_grad=1e-8, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = (
            0.5 * w[:-1].pow(2).sum() + c * (weight * torch.nn.functional.softplus(-sign * (x @ w[:-1] + w[-1]))).sum()
        )
        value.backward()
        return value

    with torch.enable_grad():
        optimizer.step(loss)
    return w[:-1].detach(), w[-1].detach()
