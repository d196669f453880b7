"""Language-model callbacks: perplexity from the validation loss, and sampled continuations written as training goes."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runner import ConfigError
from runner.config.trust import buildable
from runner.log.wandb_logger import WandbLogger
from runner.progress import parse_duration
from runner.run import Callback

if TYPE_CHECKING:
    from runner.run import Run


@buildable("callback")
class Perplexity(Callback):
    """val/ppl = exp(val/loss): the perplexity of the whole validation split (a mean of per-batch perplexities would
    overstate it: exp is convex)."""

    provides = ("val/ppl",)

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        """Add val/ppl to the validation's row."""
        if "val/loss" in metrics:
            metrics["val/ppl"] = math.exp(min(metrics["val/loss"], 700.0))  # exp overflows a float past ~709


class TextSamples(Callback):
    """Every `every`, `n` sampled continuations of fixed prompts to `dir`/step-N.txt (and wandb when it is on).

    Files go to `dir` (${run_dir}/samples). Prompts: `prompts` (strings, for a byte-level model), or else the first
    `prompt_tokens` tokens of n validation windows spread over the split. Sampling uses a generator of its own (seeded
    by `seed` and the step), never the global RNG, so training goes on exactly as without it. Every rank samples
    (FSDP's forward is a collective); rank 0 writes.
    """

    def __init__(
        self,
        dir: str,
        every: str = "0.25dur",
        n: int = 4,
        prompts: list[str] | None = None,
        prompt_tokens: int = 48,
        new_tokens: int = 160,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        if temperature <= 0:
            raise ConfigError(f"callbacks.text_samples.temperature must be > 0, got {temperature}")
        self.dir, self.every, self.n, self.prompts = (
            Path(dir),
            parse_duration(every),
            n,
            list(prompts) if prompts else None,
        )
        self.prompt_tokens, self.new_tokens = prompt_tokens, new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed

    def on_fit_start(self, run: Run) -> None:
        """Check that the prompts can be made for this model and data."""
        vocab = getattr(run.task, "vocab_size", None)
        if self.prompts and vocab != 256:
            raise ConfigError(
                f"callbacks.text_samples.prompts are text, encoded as bytes, but the model's vocab_size is {vocab}: "
                "leave prompts null (prompts from the validation data) for a tokenized model"
            )
        if not self.prompts and run.val_loader is None:
            raise ConfigError("callbacks.text_samples needs prompts=[...] when the data has no validation split")

    def on_optimizer_step(self, run: Run) -> None:
        """Sample and write at each tick of `every`."""
        if run.progress.ticked(self.every):
            self.write(run)

    def _prompts(self, run: Run) -> torch.Tensor:
        if self.prompts:
            rows = [list(p.encode()) for p in self.prompts[: self.n]]
            width = min(map(len, rows))  # one batch: prompts cut to the shortest
            return torch.tensor([r[-width:] for r in rows])
        windows = run.val_loader.dataset
        picks = torch.linspace(0, len(windows) - 1, self.n).round().long().tolist()
        return windows.__getitems__(picks)["tokens"][:, : self.prompt_tokens]

    @torch.no_grad()
    def sample(self, run: Run, prompts: torch.Tensor) -> torch.Tensor:
        """Continue each prompt by new_tokens tokens (top-k, temperature), with this callback's own generator."""
        model, device = run.task, run.device
        generator = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + run.progress.step)
        tokens = prompts.to(device)
        was_training = model.training
        model.eval()
        # Compiled blocks would recompile for every length: sampling runs eagerly
        stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else None
        with stance or contextlib.nullcontext(), run.precision.autocast():
            tokens = model.generate(tokens, self.new_tokens, self.temperature, self.top_k, generator)
        model.train(was_training)
        return tokens.cpu()

    def write(self, run: Run) -> Path | None:
        """Sample now; rank 0 writes samples/step-N.txt and returns its path."""
        prompts = self._prompts(run)
        tokens = self.sample(run, prompts)
        if not run.strategy.is_main:
            return None
        width, text = prompts.shape[1], []
        for i, row in enumerate(tokens.tolist()):
            prompt, more = _show(row[:width], run.task.vocab_size), _show(row[width:], run.task.vocab_size)
            text.append(f"=== sample {i} (prompt | continuation) ===\n{prompt}|{more}\n")
        path = self.dir / f"step-{run.progress.step}.txt"
        self.dir.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(text))
        _to_wandb(run, tokens, width)
        return path


def _show(ids: list[int], vocab: int) -> str:
    # bytes as text (an invalid UTF-8 sequence shows as U+FFFD); a tokenizer's ids as numbers (we do not have it)
    return bytes(ids).decode("utf-8", errors="replace") if vocab == 256 else " ".join(map(str, ids))


def _to_wandb(run: Run, tokens: torch.Tensor, width: int) -> None:
    wandb_run = next((lg.run for lg in run.loggers if isinstance(lg, WandbLogger)), None)
    if wandb_run is None:
        return
    import wandb

    vocab = run.task.vocab_size
    rows = [[run.progress.step, _show(r[:width], vocab), _show(r[width:], vocab)] for r in tokens.tolist()]
    table = wandb.Table(columns=["step", "prompt", "continuation"], data=rows)
    wandb_run.log({"text_samples": table}, step=run.progress.step)  # "samples" is the metric rows' sample count
