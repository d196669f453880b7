"""Numeric precision as small objects with one interface: fp32, bf16 autocast, fp16 autocast with loss scaling, and
bf16 or fp16 parameters with fp32 master weights (fp16 with loss scaling)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from runner import ConfigError
from runner.config.trust import buildable


@buildable("precision")
class FP32:
    """Full precision: autocast is a no-op and the optimizer steps as usual."""

    name = "fp32"
    # Whether this precision itself skips steps whose gradients overflowed (fp16 loss scaling does).
    handles_overflow = False

    def __init__(self, device: torch.device | str = "cpu", flush_denormal: bool = True) -> None:
        self.device = torch.device(device)
        # Denormal floats (Adam moments of rarely used weights decay into them) are many times slower on CPUs.
        torch.set_flush_denormal(flush_denormal)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`."""
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make .grad hold true gradients before clipping (a no-op without loss scaling)."""

    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """Apply the optimizer step unless `skip` (a 0/1 float on the device) is 1."""
        self.optimizer_step(optimizer, skip)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """The optimizer's own step, unless `skip`. Fused Adam, AdamW and SGD (`fused: true`, the default on CUDA and
        the CPU), and runner's Muon and Signum (runner/optimizers.py), take the flag as their `found_inf` and drop the
        update on the device: no host read. Any other optimizer needs the flag on the host, one read per step (on a
        GPU a sync; on the CPU nothing waits)."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = skip
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif not skip.item():
            optimizer.step()

    def cast(self, task: torch.nn.Module) -> None:
        """Store the task's parameters as this precision keeps them (as they are, but for bf16_true)."""

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tensors the optimizer steps (the parameters themselves, but for *_true's fp32 masters)."""
        return groups

    def stepped(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors the optimizer steps for `params`, whose gradients the loop measures and clips after unscale_."""
        return params

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""


@buildable("precision")
class Autocast(FP32):
    """Mixed precision: the forward pass runs under torch.autocast in `dtype` (bfloat16 needs no loss scaling)."""

    def __init__(
        self, dtype: str = "bfloat16", device: torch.device | str = "cpu", flush_denormal: bool = True
    ) -> None:
        super().__init__(device, flush_denormal)
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        if dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"precision.dtype must be bfloat16 or float16 (bf16/fp16), got {dtype!r}")
        self.dtype = getattr(torch, dtype)
        self.name = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass."""
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


class LossScaling:
    """fp16's loss scaling with a GradScaler, for a precision whose optimizer steps fp32 tensors: the loss is scaled
    up for backward, unscale_ divides the gradients by the scale, and steps whose gradients overflowed are skipped
    while the scale backs off."""

    handles_overflow = True

    def __init__(
        self,
        dtype: str = "float16",
        device: torch.device | str = "cpu",
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        flush_denormal: bool = True,
    ) -> None:
        super().__init__(dtype, device, flush_denormal)
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale, growth_interval=growth_interval)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the scaled loss."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the current scale, so that clipping and norms see true values."""
        super().unscale_(optimizer)  # *_true: the gradients are handed to the fp32 masters first
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """Step unless the gradients overflowed or `skip` (a non-finite loss) is 1, then adapt the scale: on the
        device with a fused optimizer; the scaler reads its flag on the host with any other."""
        # The scaler decides from its own found_inf (set by unscale_): the loop's flag joins it, so a non-finite loss
        # skips the step and backs the scale off like an overflow.
        for found_inf in self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            torch.maximum(found_inf, skip.to(found_inf.device), out=found_inf)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state (and the precision's own)."""
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        super().load_state_dict(state)
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


@buildable("precision")
class ScaledAutocast(LossScaling, Autocast):
    """fp16 autocast with a GradScaler: the loss is scaled up for backward and steps with inf/nan grads are skipped."""


@buildable("precision")
class MasterWeights(Autocast):
    """Low-precision parameters (bf16_true): the model holds its parameters in `dtype` (half the memory of weights
    and gradients, no casts of weights in the forward), and the optimizer steps fp32 master copies, which are copied
    back after each step, so small updates are not rounded away. The gradients are handed to the masters in fp32
    before the loop measures and clips them. Buffers (counters, running statistics) stay as they are. The forward
    still runs under autocast, which casts fp32 inputs and keeps reductions in fp32."""

    def __init__(
        self, dtype: str = "bfloat16", device: torch.device | str = "cpu", flush_denormal: bool = True
    ) -> None:
        super().__init__(dtype, device, flush_denormal)
        if self.dtype != torch.bfloat16 and not self.handles_overflow:
            raise ConfigError(
                "float16 parameters need their gradients scaled: use precision=fp16_true (MasterWeights keeps "
                "bfloat16 ones)"
            )
        self.name = f"{self.name}_true"
        self.params: list[torch.Tensor] = []
        self.master: list[torch.Tensor] = []

    def cast(self, task: torch.nn.Module) -> None:
        """Keep fp32 copies of the trainable parameters, then store the parameters themselves in `dtype`."""
        if hasattr(task, "after_optimizer_step"):
            raise ConfigError(
                f"precision={self.name} steps fp32 master copies of the weights, which {type(task).__name__}'s "
                "after_optimizer_step (a constraint it keeps on its weights, such as an SAE's unit-norm decoder) "
                f"would not reach: use precision={self.name.removesuffix('_true')}"
            )
        self.params = [p for p in task.parameters() if p.requires_grad and p.is_floating_point()]
        self.master = [p.detach().float().clone() for p in self.params]
        for p in self.params:
            p.data = p.data.to(self.dtype)

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups with each model parameter replaced by its fp32 master copy."""
        try:
            return [{**group, "params": self.stepped(group["params"])} for group in groups]
        except KeyError:
            raise ConfigError(
                f"precision={self.name} steps fp32 copies of the model's own parameters, which distributed=fsdp "
                f"replaces with shards: with FSDP use precision={self.name.removesuffix('_true')}"
            ) from None

    def stepped(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 masters of `params`, which hold the gradients after unscale_."""
        master = {id(p): m for p, m in zip(self.params, self.master, strict=True)}
        return [master[id(p)] for p in params]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the gradients to the masters in fp32 (the loop measures and clips them there)."""
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """Step the masters, copy them back in `dtype`."""
        self.optimizer_step(optimizer, skip)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)

    def state_dict(self) -> dict[str, Any]:
        """The fp32 master weights (the model's own are their rounding)."""
        return {"master": self.master}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters, and the model's parameters from them."""
        with torch.no_grad():
            saved = [t.to(m.device) for t, m in zip(state["master"], self.master, strict=True)]
            torch._foreach_copy_(self.master, saved)
            torch._foreach_copy_(self.params, self.master)


@buildable("precision")
class ScaledMasterWeights(LossScaling, MasterWeights):
    """float16 parameters with fp32 masters (fp16_true): as bf16_true, and the loss scaled for backward as fp16
    autocast scales it; the scaled fp16 gradients are unscaled in fp32, on the masters, so small ones survive."""
