"""Two optimizers the field trains sparse autoencoders with (EleutherAI's sparsify offers both), each one plain
torch.optim.Optimizer, so that runner's schedulers, checkpoints, clipping and non-finite guard treat them as any other:
Signum (the sign of momentum) and Muon (orthogonalised momentum for matrices, Adam for the rest, in one optimizer).

Neither has a fused kernel, but both drop a step the loop finds non-finite on the device as fused Adam does: they take
the loop's flag as their `found_inf` (runner/precision.py), so that a step that does not log reads nothing back from a
GPU. Both take `fused` only so that a preset which sets `optimizer.fused` for Adam (+experiment=sae) composes with them
too; it changes nothing."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam

from runner import ConfigError

# Where `optimizer.fused: null` (adam, adamw, sgd) is fused: the devices runner runs on (torch has the kernels there).
FUSED_DEVICES = ("cuda", "cpu")

# Keller Jordan's quintic Newton-Schulz coefficients (https://kellerjordan.github.io/posts/muon/), as torch.optim.Muon
# and sparsify use them: chosen for the steepest slope at zero, so 5 steps push every singular value into ~[0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw")
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more: each step is three matmuls of every matrix
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX), as oneDNN says."""
    # oneDNN's own answer (it honours ONEDNN_MAX_CPU_ISA): without them a bfloat16 matmul is emulated, ~50x slower
    # than float32 at Muon's sizes (2048 x 256: 1.75 s against 35 ms for the iteration, on an AVX-512 EPYC core
    # limited to AVX2 by ONEDNN_MAX_CPU_ISA; benchmarks/muon.py)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where `device` multiplies it natively (a GPU; a CPU with AVX-512 BF16 or AMX), else float32."""
    return torch.float32 if device.type == "cpu" and not cpu_multiplies_bf16() else torch.bfloat16


def orthogonalize(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """About the nearest semi-orthogonal matrix to the 2-D `g` (U V^T of its SVD, singular values ~1), in `dtype`:
    torch.optim.Muon's quintic Newton-Schulz iteration, op for op in bfloat16 (its function is private to torch)."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype).T if tall else g.to(dtype)  # wide: the Gram matrix x @ x.T is the small side
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm = 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.T if tall else x


def _adjusted_lr(lr: float, how: str | None, shape: torch.Size) -> float:
    # torch.optim.Muon's rule. "original" (Keller's, torch's default): sqrt(max(1, rows / cols)). "match_rms_adamw"
    # (Moonshot's, https://arxiv.org/abs/2502.16982, sparsify's): 0.2 sqrt(max(rows, cols)), the RMS of an AdamW
    # update, so that AdamW's learning rate carries over and does not depend on the number of latents.
    rows, cols = shape
    return lr * (0.2 * math.sqrt(max(rows, cols)) if how == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols)))


def _bad(name: str, lr: float, weight_decay: float, momentum: float) -> str:
    return (
        f"{name} needs lr >= 0, weight_decay >= 0 and 0 <= momentum < 1; got lr={lr}, weight_decay={weight_decay}, "
        f"momentum={momentum}"
    )


class SkipsOnDevice(torch.optim.Optimizer):
    """An optimizer whose `_update()` steps every parameter that has a gradient, and which drops that step on the
    device when handed a set `found_inf` flag (as runner/precision.py and torch's GradScaler hand one to fused Adam):
    every parameter and state tensor it changed takes its value before the step back (a state made by this step, its
    zero start), by torch.where, with no host read. A state tensor kept on another device than the flag (the Adam
    part's step count, on the host as torch's Adam keeps it) is left as stepped: a count ahead after a dropped step.
    A flag on the CPU is read instead: there reading waits for nothing, and the copies cost ~25% of a Muon step."""

    _step_supports_amp_scaling = True  # what precision.py and GradScaler look for before they set found_inf
    reads_cpu_flag = True  # False: the device path for a CPU flag too (tests stand the CPU in for a GPU)

    def _update(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient, unless `found_inf` is set; returns closure()'s loss if given."""
        loss = _closure_loss(closure)
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(f"{type(self).__name__} steps true gradients: unscale_ them (GradScaler) before step")
        flag = getattr(self, "found_inf", None)
        if flag is None or (self.reads_cpu_flag and flag.device.type == "cpu"):
            if flag is None or not flag.item():
                self._update()
            return loss
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        before = {(i, None): p.clone() for i, p in enumerate(params)}
        before |= {(i, k): t.clone() for i, p in enumerate(params) for k, t in self.state[p].items() if _tensor(t)}
        self._update()
        drop = flag.to(params[0].device if params else flag.device) > 0
        for i, p in enumerate(params):
            for key, t in [(None, p), *self.state[p].items()]:
                if _tensor(t) and t.device == drop.device:
                    old = before.get((i, key))
                    t.copy_(torch.where(drop, torch.zeros_like(t) if old is None else old, t))
        return loss


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Signum(SkipsOnDevice):
    """Signum (Bernstein et al. 2018, https://arxiv.org/abs/1802.04434): buf = momentum * buf + (1 - momentum) * grad,
    then every entry moves by `lr` against the sign of buf, after decoupled weight decay (p *= 1 - lr * weight_decay).

    sparsify's `optimizer="signum"` (its default) differs: SignSGD (the sign of the raw gradient) inside schedule-free
    averaging (schedulefree.ScheduleFreeWrapper, momentum 0.95), at lr 5e-3 / sqrt(n_latents / 2**14) with no schedule.
    That keeps a second copy of the weights and swaps the average in for evaluation and saving, which a plain
    optimizer cannot do; momentum 0.9 here is the paper's. The state is one tensor per parameter, "momentum_buffer"."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        fused: bool | None = None,  # no fused kernel (the module's docstring says why it is taken)
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ConfigError(_bad("Signum", lr, weight_decay, momentum))
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def _update(self) -> None:
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"].mul_(momentum).add_(p.grad, alpha=1 - momentum)
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(buf.sign(), alpha=-lr)


class Muon(SkipsOnDevice):
    """Muon for every 2-D parameter, Adam for every other (biases, gains, thresholds), in one optimizer.

    A matrix gets torch.optim.Muon's update: buf = lerp(buf, grad, 1 - momentum); with nesterov the update is
    lerp(grad, buf, momentum), orthogonalised by `ns_steps` of Newton-Schulz (`orthogonalize`), scaled by torch's
    `adjust_lr_fn` rule, after decoupled weight decay (state: "momentum_buffer"). Any other parameter gets
    torch.optim.Adam's update at the group's lr with `adam_betas` and `adam_eps`, its weight decay decoupled as AdamW's
    (state: "step", "exp_avg", "exp_avg_sq"). Defaults are torch's; sparsify 1.3 (optimizer="muon") uses lr 2e-3 for
    both parts, weight decay 0.1 on the matrices and none on the rest, match_rms_adamw scaling, and a linear decay.

    Which parameters get Muon is decided by shape alone: an embedding or an output head (2-D) gets it too, which
    Muon's authors advise against for language models; sparse coders have no such matrix.

    `ns_dtype` is the Newton-Schulz iteration's: "bfloat16" (torch's and sparsify's), "float32", or None: bfloat16
    where the device multiplies it natively, float32 on a CPU without bf16 instructions (newton_schulz_dtype)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        fused: bool | None = None,  # no fused kernel (the module's docstring says why it is taken)
        ns_dtype: str | None = None,
    ) -> None:
        if ns_dtype not in (None, *NS_DTYPES):
            raise ConfigError(
                f"Muon: ns_dtype must be null (the device's fast one) or one of {list(NS_DTYPES)}, got {ns_dtype!r}"
            )
        if adjust_lr_fn not in (None, *ADJUST_LR):
            raise ConfigError(f"Muon: adjust_lr_fn must be null or one of {list(ADJUST_LR)}, got {adjust_lr_fn!r}")
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ConfigError(_bad("Muon", lr, weight_decay, momentum))
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps <= MAX_NS_STEPS:
            # 0 would not orthogonalise at all
            raise ConfigError(f"Muon: ns_steps must be a whole number in [1, {MAX_NS_STEPS}], got {ns_steps!r}")
        if len(ns_coefficients) != 3 or not all(map(math.isfinite, ns_coefficients)) or not 0 < eps <= 1:
            raise ConfigError(  # eps 0: a zero gradient matrix would be divided by 0
                f"Muon needs 3 finite ns_coefficients and 0 < eps <= 1; got ns_coefficients={ns_coefficients}, "
                f"eps={eps}"
            )
        if len(adam_betas) != 2 or not all(0 <= b < 1 for b in adam_betas) or not 0 < adam_eps <= 1:
            raise ConfigError(
                f"Muon needs two adam_betas in [0, 1) and 0 < adam_eps <= 1; got adam_betas={adam_betas}, "
                f"adam_eps={adam_eps}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),  # plain tuples: a checkpoint's groups stay plain data
            "ns_steps": ns_steps,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
            "adam_betas": tuple(adam_betas),
            "adam_eps": adam_eps,
        }
        super().__init__(params, defaults)
        # not a group default: a checkpoint's param_groups stay what they were, and resume on another CPU picks anew
        self.ns_dtype = NS_DTYPES.get(ns_dtype)
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"]):
                raise ConfigError("Muon orthogonalises whole matrices, which distributed=fsdp shards: use ddp")

    def _update(self) -> None:
        for group in self.param_groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            for p in stepped:
                if p.ndim == 2:
                    self._muon(p, group)
            self._adam([p for p in stepped if p.ndim != 2], group)

    def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        dtype = self.ns_dtype or newton_schulz_dtype(p.device)
        update = orthogonalize(update, group["ns_steps"], group["ns_coefficients"], group["eps"], dtype)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-_adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))

    def _adam(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        if not params:
            return
        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:  # as torch.optim.Adam makes it (its step a CPU tensor: reading it never syncs a GPU)
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["adam_betas"]
        adam(  # torch's own Adam arithmetic (foreach on CUDA, as torch.optim.Adam chooses)
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adam_eps"],
            maximize=False,
        )
