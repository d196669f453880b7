"""`python -m runner.features RUN_DIR [tokens=1e6] [out=DIR] [top=16] [device=cpu] [--serve] [port=8000]`: feature
dashboards of a finished SAE run: per latent its strongest contexts in the source's text, examples across its range of
activation, how often it fires, a histogram, the tokens it promotes and suppresses, its nearest latents. Static pages
in DIR (default RUN_DIR/features): open DIR/index.html from disk, or `--serve` them on localhost. The model writes
them (`features(cfg, run_dir, out, ...)`: runner's SAEs, experiments/sae/dashboard.py), built under the same trust
rules as evaluation (runner.trained.load_trained). Exit codes: 0, or 2 with a one-line message."""

from __future__ import annotations

import functools
import http.server
import sys
import time
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.evaluate import checked_device, read_options
from runner.trained import load_trained, trusted_here

DEFAULTS: dict[str, Any] = {"tokens": 1_000_000, "out": None, "top": 16, "device": "cpu", "port": 8000}
USAGE = "usage: python -m runner.features RUN_DIR [tokens=1e6] [out=DIR] [top=16] [device=cpu] [--serve] [port=8000]"


def _options(argv: list[str]) -> tuple[Path, dict[str, Any], bool]:
    serve = "--serve" in argv
    argv = [a for a in argv if a != "--serve"]
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    options = read_options(argv[1:], DEFAULTS, ("out", "device"), ", or --serve")
    for key in ("tokens", "top", "port"):
        value = options[key]
        if isinstance(value, float) and value.is_integer():
            value = options[key] = int(value)  # tokens=2e6
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: give a whole number >= 1")
    return Path(argv[0]), options, serve


def main(argv: list[str] | None = None) -> int:
    """Write the pages (and serve them with --serve), exit 0; or print why not and exit 2."""
    try:
        path, options, serve = _options(sys.argv[1:] if argv is None else argv)
        device = checked_device(options["device"])
        model, cfg = load_trained(path, trusted_here())
        if not hasattr(model, "features"):
            raise ConfigError(f"{path}'s model ({type(model).__name__}) has no feature pages (runner's SAEs have)")
        run_dir = path if path.is_dir() else path.parent
        out = Path(options["out"]) if options["out"] else run_dir / "features"
        started = time.perf_counter()
        pages = model.features(cfg, run_dir, out, tokens=options["tokens"], top=options["top"], device=device)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for page in pages:
        print(f"wrote {page}")
    print(f"{time.perf_counter() - started:.1f} s; open {pages[0]} in a browser (no server needed)", file=sys.stderr)
    if serve:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
        with http.server.ThreadingHTTPServer(("127.0.0.1", options["port"]), handler) as server:
            print(f"serving {out} at http://127.0.0.1:{options['port']}/ (Ctrl-C stops)", file=sys.stderr)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
