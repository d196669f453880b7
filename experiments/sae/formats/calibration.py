"""A TopK coder's codes as a JumpReLU for circuit-tracer (circuit_tracer.py, circuit_tracer_clt.py): the threshold at
which JumpReLU keeps the TopK's mean L0 on held-out rows (the BatchTopK rule), and what the conversion costs there
(the FVE and L0 of both, printed and written into the folder's config.yaml)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner import ConfigError

ROWS = 4096  # held-out rows a TopK's threshold is calibrated on


def fve(pred: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of `y`'s variance (about its mean) that `pred` explains."""
    return float(1 - (pred - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum().clamp_min(1e-30))


def threshold_for(pre: torch.Tensor, l0: float) -> float:
    """The threshold at which JumpReLU keeps `l0` of `pre`'s [rows, n] values a row on average."""
    flat = pre.flatten()
    count = min(round(l0 * len(pre)), int((flat > 0).sum()))
    return 0.0 if count >= int((flat > 0).sum()) else float(flat.topk(count + 1).values[-1])


def need(rows: Any, what: str) -> torch.Tensor:
    """The held-out rows (float64) a TopK's conversion needs, or refused without them."""
    if rows is None or len(rows) == 0:
        raise ConfigError(f"format=circuit_tracer: {what} has TopK codes, which circuit-tracer reads as a JumpReLU "
                          "calibrated on held-out rows, and no validation rows were given")  # fmt: skip
    return rows.double()


@torch.no_grad()
def calibrate_layer(sae: nn.Module, tensors: dict[str, torch.Tensor], rows: Any) -> tuple[torch.Tensor, dict]:
    """A per-layer TopK transcoder's JumpReLU threshold [n] on raw inputs, and what it costs on `rows`."""
    rows = need(rows, type(sae).__name__)
    x, y = rows[:, : sae.d_in], rows[:, sae.d_in :]
    sae = sae.double().eval()
    pred, values, _ = sae.reconstruct(x)
    l0 = float((values > 0).sum(1).double().mean())
    pre = x @ tensors["W_enc"].double().t() + tensors["b_enc"].double()
    t = threshold_for(pre, l0)
    codes = pre * (pre > t)
    converted = codes @ tensors["W_dec"].double() + tensors["b_dec"].double()
    if "W_skip" in tensors:
        converted = converted + x @ tensors["W_skip"].double().t()
    sae.float()
    paid = cost([fve(pred, y)], [fve(converted, y)], [l0], [float((codes > 0).sum(1).double().mean())], len(x))
    return torch.full((sae.n_latents,), t, dtype=torch.float32), paid


def cost(fves: list, fve_jr: list, l0: list, l0_jr: list, rows: int) -> dict[str, Any]:
    """The conversion's cost (each layer's FVE and L0 before and after), printed in a line; as config.yaml holds it."""
    cost = {"rows": rows, "fve_topk": fves, "fve_jumprelu": fve_jr, "l0_topk": l0, "l0_jumprelu": l0_jr}
    mean = {key: sum(v) / len(v) for key, v in cost.items() if key != "rows"}
    print(f"format=circuit_tracer: TopK -> JumpReLU on {rows} held-out rows: FVE {mean['fve_topk']:.4f} -> "
          f"{mean['fve_jumprelu']:.4f}, L0 {mean['l0_topk']:.2f} -> {mean['l0_jumprelu']:.2f}")  # fmt: skip
    return {key: [round(x, 6) for x in v] if isinstance(v, list) else v for key, v in cost.items()}
