"""TrainingProgress: the one clock of a run, which every duration (runner.durations) is read off."""

from __future__ import annotations

import math
import warnings

from runner import check_whole
from runner.durations import Duration, DurationError, is_duration, parse_duration

_EPS = 1e-9  # float slack so that 0.1ep * 30 batches ticks at batch 3, not at batch 4


class TrainingProgress:
    """Counts optimizer steps, micro-batches, epochs, samples and tokens, and answers questions about durations.

    Samples and tokens are global (all ranks). `batches_per_epoch` is the per-rank number of micro-batches in an epoch
    (the train loader's len), `batch_size` the per-rank micro-batch size. An accumulation window is `accumulate`
    micro-batches, except the last window of an epoch, which is shortened to what is left (the loop divides the loss by
    the real window size, so that step's gradient is still a mean). Hence one epoch is ceil(batches / accumulate) steps.
    """

    def __init__(
        self,
        max_duration: str | Duration,
        batch_size: int,
        batches_per_epoch: int | None,
        samples_per_epoch: int | None = None,
        accumulate: int = 1,
        world_size: int = 1,
        tokens_per_sample: float | None = None,
    ) -> None:
        check_whole(accumulate, "trainer.accumulate_grad_batches")
        if batches_per_epoch is not None and accumulate > batches_per_epoch:
            raise DurationError(
                f"trainer.accumulate_grad_batches={accumulate} does not fit: an epoch has only "
                f"{batches_per_epoch} micro-batches per rank. Lower it or lower data.batch_size."
            )
        self.batch_size, self.accumulate, self.world_size = batch_size, accumulate, world_size
        self.batches_per_epoch = batches_per_epoch
        self.samples_per_epoch = samples_per_epoch
        self.tokens_per_sample = tokens_per_sample
        self._resolved: dict[str | Duration, Duration] = {}
        self.max_duration = parse_duration(max_duration)
        if self.max_duration.unit == "dur":
            raise DurationError("trainer.max_duration cannot be in 'dur' units: it is what 'dur' is a fraction of")
        self.resolve(self.max_duration, "trainer.max_duration")
        self.step = self.micro_batch = self.epoch = self.batch_in_epoch = self.samples = self.tokens = 0
        self._prev = self._last = (0, 0.0, 0, 0)
        self._warned = False
        one_step = self.per_step(self.max_duration.unit)
        if one_step is not None and self.max_duration.value < one_step - _EPS:
            raise DurationError(
                f"trainer.max_duration={self.max_duration} is shorter than one optimizer step "
                f"(one step = {one_step:g}{self.max_duration.unit}: {accumulate} micro-batch(es) of "
                f"{batch_size} samples on {world_size} rank(s))"
            )

    # ---- counting -------------------------------------------------------------------------------------------
    def count_micro_batch(self, samples: int = 0, tokens: int = 0) -> None:
        """Record one micro-batch; `samples` and `tokens` (summed over ranks) may instead be given per step."""
        self.micro_batch += 1
        self.batch_in_epoch += 1
        self.samples += samples
        self.tokens += tokens

    def window_size(self) -> int:
        """Micro-batches in the accumulation window the next micro-batch belongs to (short at the end of an epoch)."""
        if self.batches_per_epoch is None:
            return self.accumulate
        left = self.batches_per_epoch - (self.batch_in_epoch // self.accumulate) * self.accumulate
        return min(self.accumulate, left) if left > 0 else self.accumulate  # past len(): drift, warned at epoch end

    def window_samples(self) -> int:
        """Samples over all ranks in the optimizer step of the next micro-batch (the epoch's last step may be short)."""
        full = self.batch_size * self.world_size * self.accumulate
        if not self.samples_per_epoch:
            return full
        left = self.samples_per_epoch - (self.batch_in_epoch // self.accumulate) * full
        return min(full, left) if left > 0 else full

    def window_done(self, last_in_epoch: bool) -> bool:
        """Whether the micro-batch just counted closes an accumulation window."""
        return last_in_epoch or self.batch_in_epoch % self.accumulate == 0

    def count_optimizer_step(self, samples: int = 0, tokens: int = 0) -> None:
        """Record one optimizer step (also a skipped one: time moves on even when the weights do not), with the
        samples and tokens it trained on over all ranks when they were not counted per micro-batch."""
        self.step += 1
        self.samples += samples
        self.tokens += tokens
        self._prev, self._last = self._last, self._snapshot()
        if self.step == 1 and self.max_duration.unit == "tok" and self.tokens == 0:
            raise DurationError(
                f"trainer.max_duration={self.max_duration} counts tokens, but the batches carry none "
                "(a batch reports its tokens as an integer 'num_tokens' entry): the run would never end"
            )

    def end_epoch(self) -> None:
        """Close the epoch; warn once if the loader yielded a different number of batches than its len() said."""
        expected = self.batches_per_epoch
        if expected is not None and self.batch_in_epoch != expected:
            self._warn(
                f"the train loader yielded {self.batch_in_epoch} micro-batches in epoch {self.epoch} but its "
                f"len() is {expected}: epoch-based durations and the expected step count are off. Make the "
                "dataset's __len__ match what it yields."
            )
        self.epoch += 1
        self.batch_in_epoch = 0
        self._last = self._snapshot()

    def check_total(self) -> None:
        """At the end of a run stopped by max_duration: warn if the step count drifted from the prediction."""
        expected = self.total_steps()
        if expected is not None and expected != self.step:
            self._warn(
                f"training stopped at step {self.step} but max_duration={self.max_duration} predicted "
                f"{expected} steps: the data loader's length does not match what it yields."
            )

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"TrainingProgress: {message}", RuntimeWarning, stacklevel=3)

    # ---- questions ------------------------------------------------------------------------------------------
    @property
    def epoch_float(self) -> float:
        """Epochs done, with the fraction of the current epoch."""
        if not self.batches_per_epoch:
            return float(self.epoch)
        return self.epoch + self.batch_in_epoch / self.batches_per_epoch

    def _snapshot(self) -> tuple[int, float, int, int]:
        return (self.step, self.epoch_float, self.samples, self.tokens)

    def resolve(self, duration: str | Duration, name: str = "a duration") -> Duration:
        """Turn a 'dur' fraction into max_duration's unit; other durations are returned as they are. Epochs are
        refused when the data has no epoch length (a stream): `name` is the setting the error names."""
        known = self._resolved.get(duration)
        if known is not None:  # the loop asks for its intervals at every step: parsed once, not ~6 times a step
            return known
        d = self._resolve(parse_duration(duration), name)
        self._resolved[duration] = d
        return d

    def _resolve(self, d: Duration, name: str) -> Duration:
        if d.unit == "dur":
            return Duration(d.value * self.max_duration.value, self.max_duration.unit)
        if d.unit == "ep" and self.batches_per_epoch is None:
            raise DurationError(
                f"{name}={d} counts epochs, but the training data is a stream without an epoch length: write it in "
                "optimizer steps (st), samples (sa) or tokens (tok)"
            )
        return d

    def check_durations(self, config: object, path: str = "") -> None:
        """Resolve every duration string in a plain config (nested dicts and lists), naming its key on error: epochs
        in a run whose data has no epoch length are refused before the first step, not where a callback first asks."""
        if isinstance(config, dict):
            for key, value in config.items():
                self.check_durations(value, f"{path}.{key}" if path else str(key))
        elif isinstance(config, list):
            for i, value in enumerate(config):
                self.check_durations(value, f"{path}[{i}]")
        elif is_duration(config):
            self.resolve(config, path)

    @staticmethod
    def _value(snapshot: tuple[int, float, int, int], unit: str) -> float:
        return snapshot[("st", "ep", "sa", "tok").index(unit)]

    def elapsed(self, duration: str | Duration) -> bool:
        """Has `duration` elapsed (as of the last optimizer step or epoch end)?"""
        d = self.resolve(duration)
        return self._value(self._last, d.unit) >= d.value - _EPS

    def ticked(self, interval: str | Duration) -> bool:
        """Did the last optimizer step cross a multiple of `interval`?"""
        d = self.resolve(interval)
        if d.value <= 0:
            return False
        before, now = self._value(self._prev, d.unit) / d.value, self._value(self._last, d.unit) / d.value
        return math.floor(now + _EPS) > math.floor(before + _EPS)

    @property
    def finished(self) -> bool:
        """Has max_duration elapsed?"""
        return self.elapsed(self.max_duration)

    def fraction(self) -> float:
        """Progress through max_duration, in [0, 1]."""
        d = self.max_duration
        return min(1.0, self._value(self._last, d.unit) / d.value) if d.value > 0 else 1.0

    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (the short window at its end included)."""
        return None if self.batches_per_epoch is None else math.ceil(self.batches_per_epoch / self.accumulate)

    def per_step(self, unit: str) -> float | None:
        """How much one full optimizer step advances `unit` (None when that cannot be known in advance)."""
        if unit == "st":
            return 1.0
        if unit == "ep":
            return self.accumulate / self.batches_per_epoch if self.batches_per_epoch else None
        if unit == "sa":
            return float(self.batch_size * self.world_size * self.accumulate)
        if unit == "tok" and self.tokens_per_sample:
            return self.batch_size * self.world_size * self.accumulate * self.tokens_per_sample
        return None

    def steps_for(self, duration: str | Duration) -> int | None:
        """Optimizer steps from the start until `duration` has elapsed, or None if that is not known in advance."""
        d = self.resolve(duration)
        if d.unit == "st":
            return int(d.value)
        spe = self.steps_per_epoch()
        if d.unit == "ep":
            if spe is None:
                return None
            whole = int(d.value + _EPS)
            rest_batches = (d.value - whole) * self.batches_per_epoch
            return whole * spe + min(spe, math.ceil(rest_batches / self.accumulate - _EPS))
        per = self.per_step(d.unit)
        if per is None:
            return None
        per_sample = 1 if d.unit == "sa" else self.tokens_per_sample
        epoch_size = self.samples_per_epoch * per_sample if self.samples_per_epoch else None
        if epoch_size and spe:
            # Only the last micro-batch of an epoch can be short, so after k < spe steps an epoch has seen k * per.
            # (tok: exact when every sample holds tokens_per_sample tokens.)
            whole, rest = divmod(d.value, epoch_size)
            return int(whole) * spe + min(spe, math.ceil(rest / per - _EPS))
        return math.ceil(d.value / per - _EPS)

    def total_steps(self) -> int | None:
        """Expected optimizer steps for the whole run."""
        return self.steps_for(self.max_duration)

    # ---- checkpointing --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The counters (the configuration is rebuilt from the config, not restored)."""
        return {k: getattr(self, k) for k in ("step", "micro_batch", "epoch", "batch_in_epoch", "samples", "tokens")}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters saved by state_dict()."""
        for key, value in state.items():
            setattr(self, key, int(value))
        self._prev = self._last = self._snapshot()
