"""`python -m runner.sae_eval SAE [RUN ...] [evals=[core,probing,absorption,replacement]] [tokens=1e6]
[splice_tokens=2e5] [probe_tokens=3e5] [prompts=16] [prompt_tokens=32] [out=DIR] [device=cpu] [--limit]
[source=MODEL hook=NAME module=MODULE target=MODULE skip_positions=N]`: the field's evaluations of an SAE (or
transcoder), runner's run or an SAE folder of SAELens or sparsify attached to the model it reads
(runner.load.load_model): core metrics as SAELens's run_evals defines them, sparse probing and feature absorption as
SAEBench's (experiments/sae/evals/). `replacement` (not among the defaults) reads a coder set as runner.attribute
does: a cross-layer transcoder's run, or one transcoder's run per block given one after another (RUN0 RUN1 ...;
several runs: replacement alone, the default then); it gives the mean and spread of circuit-tracer's replacement and
completeness scores of `prompts` held-out prompts of `prompt_tokens` tokens. `ground_truth` (an SAE of
data=synth_sae_bench) gives SynthSAEBench's MCC, uniqueness, precision, recall, F1, explained variance, shrinkage and
dead latents on `tokens` fresh samples of the run's own synthetic world. Writes DIR/eval.json and DIR/index.html
(default: SAE/evals, the first run's). `tokens` positions are read for the core metrics (the source model's losses on
the first `splice_tokens`), `probe_tokens` of held-out Python source for probing; `--limit` reads 20,000 and 4
prompts (a quick look, not a figure to quote). Exit codes: 0, or 2 with a one-line message."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.evals.replacement import load_circuits
from experiments.sae.evals.run import EVALS, ONE_CODER, SINGLE, dumps, evaluate
from runner import ConfigError
from runner.load import Attach, load_model, trusted_here
from runner.log.console import ConsoleLogger
from runner.rundir import DiskFull
from runner.rundir.outputs import output_folder, write_failed
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options
from runner.tools.published import quoted_config

DEFAULTS: dict[str, Any] = {
    "evals": None,  # core, probing and absorption of one run; replacement of several (a transcoder set)
    "tokens": 1_000_000,
    "splice_tokens": 200_000,
    "probe_tokens": 300_000,
    "prompts": 16,
    "prompt_tokens": 32,
    "out": None,
    "device": "cpu",
    **dict.fromkeys(Attach.keys()),
}
LIMIT = {"tokens": 20_000, "splice_tokens": 10_000, "probe_tokens": 50_000, "prompts": 4}
USAGE = (
    "usage: python -m runner.sae_eval SAE [RUN ...] [evals=[core,probing,absorption,replacement,ground_truth]] "
    "[tokens=1e6] "
    "[splice_tokens=2e5] [probe_tokens=3e5] [prompts=16] [prompt_tokens=32] [out=DIR] [device=cpu] [--limit] "
    "[source=MODEL hook=NAME module=MODULE target=MODULE]"
)


def _options(argv: list[str]) -> tuple[list[Path], dict[str, Any]]:
    argv = key_values(argv, DEFAULTS, ("--limit",))
    limit = "--limit" in argv
    argv = [a for a in argv if a != "--limit"]
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    paths = [Path(a) for a in argv if "=" not in a and not a.startswith("-")]
    options = read_options(
        [a for a in argv if "=" in a or a.startswith("-")], DEFAULTS, ("out", "device", *Attach.TEXT), ", --limit"
    )
    evals = options["evals"]
    if evals is None:
        evals = ["replacement"] if len(paths) > 1 else list(SINGLE)
    evals = [evals] if isinstance(evals, str) else evals
    if not isinstance(evals, list) or not evals or any(e not in EVALS for e in evals):
        raise ConfigError(f"evals={options['evals']!r}: give some of {', '.join(EVALS)}, e.g. evals=[core,probing]")
    options["evals"] = tuple(dict.fromkeys(evals))
    single = [e for e in options["evals"] if e in ONE_CODER]
    if len(paths) > 1 and single:
        raise ConfigError(
            f"{len(paths)} runs name a coder set (one transcoder per block), which evals=[replacement] alone reads; "
            f"{', '.join(single)} evaluate one SAE or transcoder: give its run alone, or evals=[replacement]"
        )
    for key in ("tokens", "splice_tokens", "probe_tokens", "prompts", "prompt_tokens"):
        value = options[key]
        if isinstance(value, float) and value.is_integer():
            value = options[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: give a whole number >= 1, e.g. {key}=1e6")
    if limit:
        options.update({k: min(options[k], v) for k, v in LIMIT.items()})
    return paths, options


def _coders(paths: list[Path], options: dict[str, Any], device: str) -> tuple[Any, Any, Any]:
    # (the one coder the single-coder evaluations read or None, the first run's config, the replacement's coder set
    # or None); the coder set is read first, so that a run it refuses is said before any evaluation runs
    trusted, evals = trusted_here(), options["evals"]
    circuits = None
    if "replacement" in evals:
        circuits = load_circuits(paths, trusted, device, options["prompts"], options["prompt_tokens"])
    model, cfg = load_model(paths[0], trusted, Attach.of(options))
    coder = getattr(model, "coder", model)  # an end-to-end run's coder (experiments/sae/end_to_end.py)
    if not any(e in ONE_CODER for e in evals):
        return None, cfg, circuits
    if not hasattr(coder, "reconstruct"):
        clt = isinstance(coder, CrossLayerTranscoder)
        raise ConfigError(
            f"{paths[0]}'s model ({type(coder if clt else model).__name__}) is no single SAE or transcoder to "
            "evaluate" + (": a cross-layer transcoder's replacement model is evals=[replacement]'s" if clt else "")
        )
    return coder, cfg, circuits


def main(argv: list[str] | None = None) -> int:
    """Evaluate, print the headline figures and where they are written, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        paths, options = _options(argv)
        device = checked_device(options["device"])
        coder, cfg, circuits = _coders(paths, options, device)
        run_dir = paths[0] if paths[0].is_dir() else paths[0].parent
        quoted = quoted_config(run_dir, cfg)  # what eval.json says of the source: plain data (runner.tools.published)
        out = output_folder(run_dir, options["out"] or None, "evals", "out=")
        console = ConsoleLogger()
        try:
            result = evaluate(
                coder,
                cfg,
                out,
                options["evals"],
                options["tokens"],
                options["splice_tokens"],
                options["probe_tokens"],
                device,
                console.working,
                quoted,
                circuits,
            )
        except (OSError, DiskFull) as error:
            raise write_failed(error, f"writing the evaluation to {out}", "run the same command again") from None
        finally:
            console.close()  # a pass cut short by an error: its heartbeat thread stops with it
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(dumps(result))
    print(f"wrote {out / 'eval.json'} and {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
