"""`python -m runner.sae_eval SAE [evals=[core,probing,absorption]] [tokens=1e6] [splice_tokens=2e5]
[probe_tokens=3e5] [out=DIR] [device=cpu] [--limit] [source=MODEL hook=NAME module=MODULE target=MODULE
skip_positions=N]`: the field's evaluations of an SAE (or transcoder), runner's run or an SAE folder of SAELens or
sparsify attached to the model it reads (runner.load.load_model): core metrics as SAELens's run_evals defines
them, sparse probing and feature absorption as SAEBench's (experiments/sae/evals/). Writes DIR/eval.json and
DIR/index.html (default: SAE/evals). `tokens` positions are read for the core metrics (the source model's losses on
the first `splice_tokens`), `probe_tokens` of held-out Python source for probing; `--limit` reads 20,000 (a quick
look, not a figure to quote). Exit codes: 0, or 2 with a one-line message."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from experiments.sae.evals.run import EVALS, dumps, evaluate
from runner import ConfigError
from runner.load import Attach, load_model, trusted_here
from runner.log.console import ConsoleLogger
from runner.rundir import DiskFull
from runner.rundir.outputs import output_folder, write_failed
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options
from runner.tools.published import quoted_config

DEFAULTS: dict[str, Any] = {
    "evals": ["core", "probing", "absorption"],
    "tokens": 1_000_000,
    "splice_tokens": 200_000,
    "probe_tokens": 300_000,
    "out": None,
    "device": "cpu",
    **dict.fromkeys(Attach.keys()),
}
LIMIT = {"tokens": 20_000, "splice_tokens": 10_000, "probe_tokens": 50_000}
USAGE = (
    "usage: python -m runner.sae_eval SAE [evals=[core,probing,absorption]] [tokens=1e6] [splice_tokens=2e5] "
    "[probe_tokens=3e5] [out=DIR] [device=cpu] [--limit] [source=MODEL hook=NAME module=MODULE target=MODULE]"
)


def _options(argv: list[str]) -> tuple[Path, dict[str, Any]]:
    argv = key_values(argv, DEFAULTS, ("--limit",))
    limit = "--limit" in argv
    argv = [a for a in argv if a != "--limit"]
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    options = read_options(argv[1:], DEFAULTS, ("out", "device", *Attach.TEXT), ", --limit")
    evals = [options["evals"]] if isinstance(options["evals"], str) else options["evals"]
    if not isinstance(evals, list) or not evals or any(e not in EVALS for e in evals):
        raise ConfigError(f"evals={options['evals']!r}: give some of {', '.join(EVALS)}, e.g. evals=[core,probing]")
    options["evals"] = tuple(dict.fromkeys(evals))
    for key in ("tokens", "splice_tokens", "probe_tokens"):
        value = options[key]
        if isinstance(value, float) and value.is_integer():
            value = options[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: give a whole number >= 1, e.g. {key}=1e6")
    if limit:
        options.update({k: min(options[k], v) for k, v in LIMIT.items()})
    return Path(argv[0]), options


def main(argv: list[str] | None = None) -> int:
    """Evaluate, print the headline figures and where they are written, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        path, options = _options(argv)
        device = checked_device(options["device"])
        model, cfg = load_model(path, trusted_here(), Attach.of(options))
        coder = getattr(model, "coder", model)  # an end-to-end run's coder (experiments/sae/end_to_end.py)
        if not hasattr(coder, "reconstruct"):
            raise ConfigError(f"{path}'s model ({type(model).__name__}) is no single SAE or transcoder to evaluate")

        run_dir = path if path.is_dir() else path.parent
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
            )
        except (OSError, DiskFull) as error:
            raise write_failed(error, f"writing the evaluation to {out}", "run the same command again") from None
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(dumps(result))
    print(f"wrote {out / 'eval.json'} and {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
