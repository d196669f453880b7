"""`python -m runner.features RUN_DIR [tokens=1e6] [out=DIR] [top=16] [device=cpu] [neuronpedia=true] [--serve]
[port=8000]`: feature dashboards of a finished SAE run (or of an SAE folder of SAELens or sparsify, with `source=MODEL`,
the model it reads: runner.load.load_model): per latent its strongest contexts in the source's text, examples across
its range of activation, how often it fires, a histogram, the tokens it promotes and suppresses, its nearest latents.
Static pages in DIR (default RUN_DIR/features; a symlink in the run folder never leads them elsewhere:
runner.rundir.outputs): open DIR/index.html from disk, or `--serve` them to this machine's browser (PagesHandler:
pages already whole in DIR, as DIR/pages.json lists them, are served as they are, and built only if there are none). The
model writes them (`features(cfg, run_dir, out, ...)`: runner's SAEs, experiments/sae/pages/dashboard.py), built under
the same trust rules as evaluation (runner.load.load_trained). `neuronpedia=true` writes the same latents as
Neuronpedia's upload batches too (DIR/neuronpedia/batch-N.json: experiments/sae/pages/neuronpedia.py), under
`model_name=` and `sae_set=` (default: the source's hub name, else its folder's name, and this run folder's name: never
a local path; what the files quote of the config is plain data, never a resolver's value: runner.tools.published). Exit
codes: 0, or 2 with a one-line message."""

from __future__ import annotations

import errno
import functools
import http.server
import re
import socket
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.load import Attach, load_model, trusted_here
from runner.log.console import ConsoleLogger
from runner.rundir import DiskFull, read_json, write_json
from runner.rundir.outputs import output_folder, write_failed
from runner.tools.cli import help_asked, key_values
from runner.tools.evaluate import checked_device, read_options
from runner.tools.published import publish_names, quoted_config

DEFAULTS: dict[str, Any] = {
    "tokens": 1_000_000,
    "out": None,
    "top": 16,
    "device": "cpu",
    "neuronpedia": False,  # the pages' data as Neuronpedia's upload batches too (experiments/sae/pages/neuronpedia.py)
    "port": 8000,
    "model_name": None,  # Neuronpedia's model_id and sae_set (default: the source's hub name, the run folder's name)
    "sae_set": None,
    **dict.fromkeys(Attach.keys()),  # an SAE folder of SAELens or sparsify: the model it reads (runner.load.load_model)
}
USAGE = (
    "usage: python -m runner.features RUN_DIR [tokens=1e6] [out=DIR] [top=16] [device=cpu] [neuronpedia=true "
    "[model_name=NAME] [sae_set=NAME]] [--serve] [port=8000]\n"
    "       python -m runner.features SAE_DIR source=MODEL [hook=NAME] [module=MODULE] ...   (SAELens, sparsify)"
)


def _options(argv: list[str]) -> tuple[Path, dict[str, Any], bool]:
    argv = key_values(argv, DEFAULTS, ("--serve",))
    serve = "--serve" in argv
    argv = [a for a in argv if a != "--serve"]
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    options = read_options(argv[1:], DEFAULTS, ("out", "device", "model_name", "sae_set", *Attach.TEXT), ", or --serve")
    for key in ("tokens", "top", "port"):
        value = options[key]
        if isinstance(value, float) and value.is_integer():
            value = options[key] = int(value)  # tokens=2e6
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: give a whole number >= 1")
    if not isinstance(options["neuronpedia"], bool):
        raise ConfigError(f"neuronpedia={options['neuronpedia']!r}: give true or false")
    named = [key for key in ("model_name", "sae_set") if options[key] is not None]
    if named and not options["neuronpedia"]:
        raise ConfigError(f"{named[0]}={options[named[0]]}: it names Neuronpedia's batches: give neuronpedia=true too")
    if options["port"] > 65535:
        raise ConfigError(f"port={options['port']}: give a port from 1 to 65535, e.g. port=8000")
    return Path(argv[0]), options, serve


# the names of this machine a browser sends as Host; a page elsewhere that rebinds its own name to 127.0.0.1 (DNS
# rebinding) sends that name, and is refused
LOCAL_HOST = re.compile(r"(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", re.IGNORECASE)


class PagesHandler(http.server.SimpleHTTPRequestHandler):
    """The files of one pages folder, to this machine's browser only: nothing whose real path leaves the folder (a
    symlink in it is the run folder's data) or, where `only` names some of its subfolders, those; a folder's
    index.html but never a listing, 403 for a Host header that is not a localhost name (DNS rebinding), 400 for a
    malformed path (a NUL byte, `..`), and never a traceback."""

    def __init__(self, *args: Any, only: tuple[str, ...] = (), **kwargs: Any) -> None:
        root = Path(kwargs["directory"]).resolve()
        self.folders = [(root / name).resolve() for name in only] or [root]
        super().__init__(*args, **kwargs)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not LOCAL_HOST.fullmatch(self.headers.get("Host", "")):
            self.send_error(403, "the feature pages are served to localhost, 127.0.0.1 or [::1] only")
            return False
        return True

    def translate_path(self, path: str) -> str:
        local = super().translate_path(path)
        if path.split("?", 1)[0].split("#", 1)[0].endswith("/"):
            local = str(Path(local) / "index.html")  # a folder is its index page (none: 404), never a listing
        return local

    def send_head(self) -> Any:
        try:
            url = urllib.parse.unquote(self.path.split("?", 1)[0].split("#", 1)[0], errors="strict")
        except UnicodeDecodeError:
            url = "\0"
        if "\0" in url or ".." in url.split("/"):
            self.send_error(400, "malformed path")
            return None
        try:
            real = Path(self.translate_path(self.path)).resolve()
        except (OSError, RuntimeError):  # too long, a loop of links
            real = None
        if real is None or not any(real.is_relative_to(folder) for folder in self.folders):
            self.send_error(404)
            return None
        return super().send_head()

    def list_directory(self, path: str) -> None:
        self.send_error(404)  # translate_path asks for index.html: a listing is never needed

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError):
            pass  # a browser that went away mid-answer


def pages_server(out: Path, port: int, only: tuple[str, ...] = ()) -> http.server.ThreadingHTTPServer:
    """A server (not yet serving) of the pages folder `out` (of its subfolders `only`, if any) on 127.0.0.1:`port`
    (0: any free one), by PagesHandler."""
    handler = functools.partial(PagesHandler, directory=str(out.resolve()), only=only)
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def _address(root: Path, index: Path) -> str:
    # the page's path under the served folder, a folder's index.html as the folder (no listing: the root's own URL
    # answers 404 when the page is deeper); "" when the page is the root's index or lies elsewhere
    root, index = root.resolve(), index.resolve()
    path = index.parent if index.name == "index.html" else index
    if path == root or not path.is_relative_to(root):
        return ""
    return path.relative_to(root).as_posix() + ("/" if path.is_dir() else "")


def serve(out: Path, port: int, index: Path, only: tuple[str, ...] = ()) -> int:
    """Serve the pages folder `out` (its subfolders `only`, if any) until Ctrl-C, exit 0; a port that cannot be had
    is a one-line error naming a free one, exit 2 (the pages are written all the same)."""
    try:
        server = pages_server(out, port, only)
    except OSError as error:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        why = "is in use" if error.errno == errno.EADDRINUSE else f"cannot be used ({error.strerror})"
        print(
            f"error: port {port} {why}: give another, e.g. port={free} (the pages are written all the same: open "
            f"{index} from disk)",
            file=sys.stderr,
        )
        return 2
    with server:
        print(f"serving {out} at http://127.0.0.1:{port}/{_address(out, index)} (Ctrl-C stops)", file=sys.stderr)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


MANIFEST = "pages.json"  # the pages a build wrote, written last (and removed as a build starts): they are whole
BUILT_BY = ("tokens", "top", "neuronpedia", "source", "hook", "module", "target")  # the options the pages depend on


def written_pages(out: Path) -> dict[str, Any] | None:
    """What the last whole build in `out` wrote (its pages, under `out`; when; with which options), or None."""
    manifest = read_json(out / MANIFEST)
    pages = manifest.get("pages") if isinstance(manifest, dict) else None
    if not isinstance(pages, list) or not pages or not all(isinstance(p, str) for p in pages):
        return None
    root = out.resolve()
    if not all((out / p).resolve().is_relative_to(root) and (out / p).is_file() for p in pages):
        return None  # pages since removed, or a name that leads out of the folder: build them again
    return manifest


def _serve_written(out: Path, options: dict[str, Any], manifest: dict[str, Any]) -> int:
    # the pages there, as they are: a server starts in seconds where a build reads the source model's text again
    said = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    differ = [f"{k}={said.get(k)!r} (not {options.get(k)!r})" for k in BUILT_BY if options.get(k) != said.get(k)]
    print(
        f"serving the pages already in {out}, written {manifest.get('written', '?')}"
        + (f" with {', '.join(differ)}" if differ else "")
        + f"; to build them again, run without --serve (or remove {out / MANIFEST})",
        file=sys.stderr,
    )
    return serve(out, options["port"], out / manifest["pages"][0])


def main(argv: list[str] | None = None) -> int:
    """Write the pages (and serve them with --serve), exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        path, options, served = _options(argv)
        run_dir = path if path.is_dir() else path.parent
        if served and run_dir.is_dir():
            out = output_folder(run_dir, options["out"] or None, "features", "out=")
            if (manifest := written_pages(out)) is not None:
                return _serve_written(out, options, manifest)
        device = checked_device(options["device"])
        model, cfg = load_model(path, trusted_here(), Attach.of(options))
        if not hasattr(model, "features"):
            raise ConfigError(f"{path}'s model ({type(model).__name__}) has no feature pages (runner's SAEs have)")
        # what the pages and batches quote of the config is plain data, and the names they publish under are never a
        # local path (runner.tools.published)
        names, said = publish_names(quoted_config(run_dir, cfg), run_dir, options["model_name"], options["sae_set"])
        out = output_folder(run_dir, options["out"] or None, "features", "out=")
        started = time.perf_counter()
        console = ConsoleLogger()  # each phase's progress: a line every 10 s in a terminal, 30 s elsewhere
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / MANIFEST).unlink(missing_ok=True)  # until this build is whole, no page here is served as whole
            working = console.working
            pages = model.features(
                cfg,
                run_dir,
                out,
                tokens=options["tokens"],
                top=options["top"],
                device=device,
                working=working,
                neuronpedia=options["neuronpedia"],
                publish=names,
            )
            listed = [page.resolve().relative_to(out.resolve()).as_posix() for page in pages]
            settings = {key: options.get(key) for key in BUILT_BY}
            written = time.strftime("%Y-%m-%d %H:%M:%S")
            write_json(out / MANIFEST, {"pages": listed, "written": written, "options": settings})
        except (OSError, DiskFull) as error:
            kept = "any pages there may be incomplete (the same command writes them whole)"
            raise write_failed(error, f"making the feature pages in {out}", kept) from None
        finally:
            console.close()  # a pass cut short by an error: its heartbeat thread stops, not beats on in this process
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for page in pages:
        print(f"wrote {page}")
    if said and options["neuronpedia"]:
        print(said, file=sys.stderr)
    print(f"{time.perf_counter() - started:.1f} s; open {pages[0]} in a browser (no server needed)", file=sys.stderr)
    return serve(out, options["port"], pages[0]) if served else 0


if __name__ == "__main__":
    sys.exit(main())
