"""`python -m runner.export RUN_DIR format=saelens|sparsify|hf|circuit_tracer [out=DIR] [model_name=NAME]
[sae_set=NAME]`: a finished run's model in another tool's folder layout, where the model knows how to write one
(`export(fmt, out, cfg, summary=)`: runner's SAEs write SAELens's and sparsify's; `hf`, a Hugging Face repository
folder of SAELens folders with a model card quoting the run's summary.json; `circuit_tracer`, the folder circuit-tracer
loads a transcoder or a cross-layer transcoder from; experiments/sae/formats/). DIR defaults to RUN_DIR/export-FORMAT
and must be empty or new; it is written beside it and renamed into place once whole, and a symlink in the run folder
never leads it elsewhere (runner.rundir.outputs). What it quotes of the run's config is plain data, never a resolver's
value, and the source model is named by its publishing name (model_name=, default its hub name or its folder's name;
sae_set=, the card's name of the set: runner.tools.published).
The model is built from the run's own config under the same trust rules as evaluation (runner.load.load_trained).
Exit codes: 0, or 2 with a one-line message (a wrong folder, format, model, name or output)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.load import load_trained
from runner.rundir import SUMMARY, DiskFull, read_json, staged_folder
from runner.rundir.outputs import clear_temporaries, output_folder, write_failed
from runner.tools.cli import as_flags
from runner.tools.published import publish_names, quoted_config

# where each publishing name is written: SAELens's cfg.json metadata and the card's title; the card's set
USES = {"model_name": ("saelens", "hf"), "sae_set": ("hf",)}


def _quoted(run_dir: Path, cfg: Any, fmt: str, model_name: str | None, sae_set: str | None) -> tuple[dict, str]:
    # What the export quotes of the run: its config as plain data (runner.tools.published), with the source named by its
    # publishing name, which SAE.export and the model card read as data.checkpoint, and the names themselves; and the
    # line that says which names were chosen by default
    for key, value in (("model_name", model_name), ("sae_set", sae_set)):
        if value is not None and fmt not in USES[key]:
            where = " and ".join(f"format={f}" for f in USES[key])
            raise ConfigError(f"{key}={value}: only {where} names one (format={fmt} has no field for it): leave it out")
    view = quoted_config(run_dir, cfg)
    used = tuple(key for key, formats in USES.items() if fmt in formats)
    names, said = publish_names(view, run_dir, model_name, sae_set, used)
    data = view.get("data") or {}
    if names["model_name"] is not None:
        data = {**data, "checkpoint": names["model_name"]}
    return {"model": view.get("model") or {}, "data": data, "publish": names}, said


def main(argv: list[str] | None = None) -> int:
    """Export, print the folders written, exit 0; or print why not and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished run folder (or its model.safetensors)")
    parser.add_argument(
        "--format", required=True, help="saelens, sparsify, hf (a Hugging Face repository folder) or circuit_tracer"
    )
    parser.add_argument("--out", type=Path, help="the folder to write (default: RUN_DIR/export-FORMAT)")
    parser.add_argument("--model-name", help="the source model's name in cfg.json and the card (default: its hub name)")
    parser.add_argument("--sae-set", help="the SAEs' name as a set, in the card (default: the run folder's name)")
    keys = ("format", "out", "model_name", "sae_set")
    args = parser.parse_args(as_flags(sys.argv[1:] if argv is None else argv, keys))
    run_dir = args.run_dir if args.run_dir.is_dir() else args.run_dir.parent
    try:
        model, cfg = load_trained(args.run_dir)
        if not hasattr(model, "export"):
            raise ConfigError(f"{run_dir}'s model ({type(model).__name__}) has no export (runner's SAEs have)")
        if not args.format.isidentifier():  # it names the default folder
            raise ConfigError(f"--format {args.format}: give saelens, sparsify, hf or circuit_tracer")
        quoted, said = _quoted(run_dir, cfg, args.format, args.model_name, args.sae_set)
        out = output_folder(run_dir, args.out, f"export-{args.format}", "--out ")
        if out.is_dir():
            clear_temporaries(out)  # an older runner's export wrote into the folder itself: a killed one left these
            if any(out.iterdir()):
                raise ConfigError(f"--out {out} already holds files: give an empty or new folder (nothing was written)")
        try:  # beside `out`, renamed into place once whole: a killed export leaves nothing in the way of the next
            with staged_folder(out) as partial:
                summary = read_json(run_dir / SUMMARY) or {}  # a repository's model card quotes its metrics
                # the run's own data config (never quoted): what a format that computes from the run's held-out rows
                # builds them from, its source named by its path here
                view = {**quoted, "run_data": cfg.get("data")}
                written = model.export(args.format, partial, view, summary=summary)
                folders = [out / Path(f).relative_to(partial) for f in written]
        except (OSError, DiskFull) as error:
            raise write_failed(error, f"writing the export to {out}", f"nothing was written to {out}") from None
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for folder in folders:
        print(f"wrote {folder}")
    if said:
        print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
