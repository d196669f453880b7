"""`python -m runner.export RUN_DIR format=saelens|sparsify|hf [out=DIR]`: a finished run's model in another tool's
folder layout, where the model knows how to write one (`export(fmt, out, cfg, summary=)`: runner's SAEs write
SAELens's and sparsify's, and `hf`, a Hugging Face repository folder of SAELens folders with a model card quoting
the run's summary.json; experiments/sae/formats.py). DIR defaults to RUN_DIR/export-FORMAT and must be empty or
new; it is written beside it and renamed into place once whole, and a symlink in the run folder never leads it
elsewhere (runner.outdir).
The model is built from the run's own config under the same trust rules as evaluation (runner.trained.load_trained).
Exit codes: 0, or 2 with a one-line message (a wrong folder, format, model or output)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner import ConfigError
from runner.cli import as_flags
from runner.outdir import clear_temporaries, output_folder, staged, write_failed
from runner.rundir import SUMMARY, DiskFull, read_json
from runner.trained import load_trained


def main(argv: list[str] | None = None) -> int:
    """Export, print the folders written, exit 0; or print why not and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished run folder (or its model.safetensors)")
    parser.add_argument("--format", required=True, help="saelens, sparsify or hf (a Hugging Face repository folder)")
    parser.add_argument("--out", type=Path, help="the folder to write (default: RUN_DIR/export-FORMAT)")
    args = parser.parse_args(as_flags(sys.argv[1:] if argv is None else argv, ("format", "out")))
    run_dir = args.run_dir if args.run_dir.is_dir() else args.run_dir.parent
    try:
        model, cfg = load_trained(args.run_dir)
        if not hasattr(model, "export"):
            raise ConfigError(f"{run_dir}'s model ({type(model).__name__}) has no export (runner's SAEs have)")
        if not args.format.isidentifier():  # it names the default folder
            raise ConfigError(f"--format {args.format}: give saelens, sparsify or hf")
        out = output_folder(run_dir, args.out, f"export-{args.format}", "--out ")
        if out.is_dir():
            clear_temporaries(out)  # a killed export of an earlier version wrote into the folder itself
            if any(out.iterdir()):
                raise ConfigError(f"--out {out} already holds files: give an empty or new folder (nothing was written)")
        try:  # beside `out`, renamed into place once whole: a killed export leaves nothing in the way of the next
            with staged(out) as partial:
                summary = read_json(run_dir / SUMMARY) or {}  # a repository's model card quotes its metrics
                written = model.export(args.format, partial, cfg, summary=summary)
                folders = [out / Path(f).relative_to(partial) for f in written]
        except (OSError, DiskFull) as error:
            raise write_failed(error, f"writing the export to {out}", f"nothing was written to {out}") from None
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for folder in folders:
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
