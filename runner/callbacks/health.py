"""Training health: per-layer gradient and parameter norms, update/weight ratios and activation statistics, measured
on the device at the steps that log and read there in one transfer; a warning when a layer's gradients explode or
vanish against their own running level."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from runner import ConfigError
from runner.callbacks import needs_every_module
from runner.distributed.fsdp import local_shard
from runner.run import Callback, Run


class TrainingHealth(Callback):
    """Every `every` steps (whole optimizer steps; by default the log interval): for each parameter tensor, the
    gradient norm (after unscaling and clipping, as the optimizer sees it), the weight norm and the update/weight
    ratio ||W_after - W_before|| / ||W_before|| of that step; for each module named in `modules`, its output's mean,
    std, largest magnitude and fraction of zeros. Every value goes to `health.jsonl` in `run_dir` (rank 0); the
    loggers get the `top` layers by gradient norm as health/grad_norm/<name> and the largest update ratio, and with
    `histograms` every layer's values (log10) as the histograms health/log10_{grad_norm,param_norm,update_ratio}
    (TensorBoard, wandb). A layer
    whose gradient norm leaves [vanish, explode] x its running level (an exponential mean of the log norm over the
    measured steps, after `warmup` of them) is named in a warning, once per layer and kind. Nothing is read from the
    device between those steps; a measured step copies the weights once (for the update ratio).
    """

    def __init__(
        self,
        run_dir: str,
        every: str = "50st",
        top: int = 5,
        explode: float = 10.0,
        vanish: float = 0.01,
        warmup: int = 3,
        modules: list[str] | None = None,
        histograms: bool = True,
    ) -> None:
        for name, count in (("top", top), ("warmup", warmup)):  # top=-1 sent all layers but one, as a slice does
            if count < 0:
                raise ConfigError(f"callbacks.health.{name} must be a whole number >= 0, got {count}")
        self.path, self.every, self.top, self.histograms = Path(run_dir) / "health.jsonl", every, top, histograms
        self.explode, self.vanish, self.warmup = explode, vanish, warmup
        self.module_names = list(modules or [])
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.level: dict[str, float] = {}  # running mean of log10 gradient norm per layer
        self.seen = 0
        self.warned: set[tuple[str, str]] = set()
        self._due, self._before, self._pending = False, None, None
        self._acts: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def on_fit_start(self, run: Run) -> None:
        """Resolve the interval, list the parameters and hook the named modules."""
        needs_every_module(run, "health", "it reports rank 0's parameters as the model's")
        self.k = run.progress.steps_for(self.every)
        if not self.k:
            raise ConfigError(f"callbacks.health.every={self.every}: give it in optimizer steps, e.g. 50st")
        # Under FSDP a parameter is this rank's shard: its norms are the shard's.
        named = [(n, local_shard(p)) for n, p in run.task.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.holders = run.precision.stepped(self.params)  # where the gradients are: *_true hands them to masters
        modules = dict(run.task.named_modules())
        for name in self.module_names:
            if name not in modules:
                raise ConfigError(f"callbacks.health.modules: {name!r} is not a module of {type(run.task).__name__}")
            self._hooks.append(modules[name].register_forward_hook(self._activation_hook(name)))
        self._due = (run.progress.step + 1) % self.k == 0
        self.is_main = run.strategy.is_main

    def _activation_hook(self, name: str) -> Any:
        def hook(_module: Any, _inputs: Any, out: Any) -> None:
            if self._due and torch.is_tensor(out) and name not in self._acts and torch.is_grad_enabled():
                x = out.detach().float()
                self._acts[name] = torch.stack([x.mean(), x.std(), x.abs().max(), (x == 0).float().mean()])

        return hook

    def on_before_optimizer_step(self, run: Run) -> None:
        """On a measured step: the gradient and weight norms, and the weights before the update."""
        if self._due:
            grads = [local_shard(h.grad) if h.grad is not None else torch.zeros_like(h) for h in self.holders]
            self._pending = (torch._foreach_norm(grads), torch._foreach_norm(self.params))
            self._before = [p.detach().clone() for p in self.params]

    def on_optimizer_step(self, run: Run) -> None:
        """On a measured step: the update's norm, all values stacked on the device for the one read."""
        if self._due and self._pending is not None:
            grad, weight = self._pending
            update = torch._foreach_norm(torch._foreach_sub([p.detach() for p in self.params], self._before))
            self._pending = torch.stack([torch.stack(grad), torch.stack(weight), torch.stack(update)]).float()
            self._before = None

    def on_step_end(self, run: Run) -> None:
        """Read what the step measured, write and warn; arm the next measured step."""
        if self._due and torch.is_tensor(self._pending):
            grad, weight, update = self._pending.tolist()  # the one read, on a step that logs anyway
            acts = {
                name: dict(zip(("mean", "std", "max_abs", "zero_fraction"), v.tolist(), strict=True))
                for name, v in self._acts.items()
            }
            self._report(run, grad, weight, update, acts)
        self._pending, self._acts = None, {}
        self._due = (run.progress.step + 1) % self.k == 0

    def _report(self, run: Run, grad: list[float], weight: list[float], update: list[float], acts: dict) -> None:
        step = run.progress.step
        layers = {
            name: {"grad_norm": g, "param_norm": w, "update_ratio": u / w if w > 0 else 0.0}
            for name, g, w, u in zip(self.names, grad, weight, update, strict=True)
        }
        self._watch(layers, step)
        if not run.strategy.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "layers": layers, "activations": acts}) + "\n")
        ranked = sorted(layers, key=lambda n: -layers[n]["grad_norm"])[: self.top]
        metrics = {f"health/grad_norm/{name}": layers[name]["grad_norm"] for name in ranked}
        metrics["health/max_update_ratio"] = max((v["update_ratio"] for v in layers.values()), default=0.0)
        # every layer's values as histograms (log10: norms span orders of magnitude), for loggers that draw them
        spread = {
            f"health/log10_{kind}": [math.log10(max(v[kind], 1e-30)) for v in layers.values()]
            for kind in ("grad_norm", "param_norm", "update_ratio")
        }
        for logger in run.loggers:
            logger.log(metrics, step)
            if self.histograms and hasattr(logger, "log_histograms"):
                logger.log_histograms(spread, step)

    def _watch(self, layers: dict[str, dict[str, float]], step: int) -> None:
        # Each layer against its own running level: a norm 10x above it explodes, 100x below it vanishes.
        self.seen += 1
        flagged = {"exploding": [], "vanishing": []}
        for name, values in layers.items():
            level = math.log10(max(values["grad_norm"], 1e-30))
            if name in self.level and self.seen > self.warmup:
                if level > self.level[name] + math.log10(self.explode):
                    flagged["exploding"].append(name)
                elif level < self.level[name] + math.log10(self.vanish):
                    flagged["vanishing"].append(name)
            self.level[name] = level if name not in self.level else 0.8 * self.level[name] + 0.2 * level
        for kind, names in flagged.items():
            new = [n for n in names if (n, kind) not in self.warned]
            if new:
                self.warned |= {(n, kind) for n in new}
                if self.is_main:
                    print(
                        f"warning: step {step}: gradients {kind} in {', '.join(new)} (against their running level)",
                        file=sys.stderr,
                    )

    def on_fit_end(self, run: Run) -> None:
        """Remove the activation hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def state_dict(self) -> dict[str, Any]:
        """The running levels and the warnings given."""
        return {"level": self.level, "seen": self.seen, "warned": sorted(map(list, self.warned))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()."""
        self.level, self.seen = dict(state["level"]), state["seen"]
        self.warned = {tuple(w) for w in state["warned"]}
