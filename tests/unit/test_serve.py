"""`python -m runner.features RUN_DIR --serve`: the real handler (runner.tools.features.PagesHandler), on an ephemeral
port in a thread, serves the pages folder's files to localhost and nothing else: no symlink out of the folder (a victim
outside it is never read), no `..`, no directory listing, 403 for a foreign Host header (DNS rebinding), 400 and no
traceback for a NUL byte; and a port in use is one line naming a free one and the pages already written."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import finished_run

from experiments.sae.pages.write import STATIC
from runner.tools import features

SAE = ["+experiment=sae", "model.n_latents=32", "data.splits.n_train=512", "data.splits.n_val=64"]
SAE += ["data.splits.d=16", "data.splits.n_features=16", "trainer.max_duration=2st", "logger=none", "checkpoint=none"]
SECRET = "the victim's secret\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny SAE run, its real pages, and a victim beside them that links in the pages folder point at."""
    root = tmp_path_factory.mktemp("serve")
    run = root / "run"
    run.mkdir()
    finished_run(run, *SAE)
    pages = root / "pages"
    assert features.main([str(run), "tokens=64", f"out={pages}"]) == 0
    victim = root / "elsewhere"
    victim.mkdir()
    (victim / "secret.txt").write_text(SECRET)
    (root / "secret.txt").write_text(SECRET)  # the pages folder's parent: what `..` would reach
    (pages / "leak").symlink_to(victim)
    (pages / "data" / "secret.js").symlink_to(victim / "secret.txt")
    (pages / "sub").mkdir()
    (pages / "sub" / "index.html").symlink_to(victim / "secret.txt")
    return {"run": run, "pages": pages, "victim": victim}


@pytest.fixture(scope="module")
def port(site: dict[str, Path]) -> Iterator[int]:
    server = features.pages_server(site["pages"], 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _get(port: int, path: str, host: str | None = "127.0.0.1:{port}") -> tuple[int, bytes]:
    # one raw HTTP/1.0 request (http.client refuses a NUL byte or a missing Host), and its status and body
    head = f"GET {path} HTTP/1.0\r\n" + (f"Host: {host.format(port=port)}\r\n" if host is not None else "") + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head.encode("latin-1"))
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    status, _, body = answer.partition(b"\r\n\r\n")
    return int(status.split()[1]), body


def test_the_real_pages_are_served(site: dict[str, Path], port: int) -> None:
    assert _get(port, "/") == (200, (STATIC / "index.html").read_bytes())
    assert _get(port, "/app.js") == (200, (STATIC / "app.js").read_bytes())
    assert _get(port, "/data/index.js?x=1") == (200, (site["pages"] / "data" / "index.js").read_bytes())
    assert _get(port, "/data")[0] == 301  # a folder without its slash is sent to it, as before


@pytest.mark.parametrize("path", ["/leak/secret.txt", "/leak/", "/leak", "/data/secret.js", "/sub/", "/data/"])
def test_nothing_outside_the_folder_and_no_listing_is_served(site: dict[str, Path], port: int, path: str) -> None:
    status, body = _get(port, path)
    assert status == 404 and b"secret" not in body and b"index.js" not in body
    assert (site["victim"] / "secret.txt").read_text() == SECRET


@pytest.mark.parametrize("path", ["/../secret.txt", "/%2e%2e/secret.txt", "/data/../../secret.txt", "/..%2fsecret.txt"])
def test_dot_dot_is_refused(port: int, path: str) -> None:
    status, body = _get(port, path)
    assert status in (400, 404) and b"secret" not in body


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "LOCALHOST:{port}", "127.0.0.1", "[::1]:{port}"])
def test_a_localhost_name_is_answered(port: int, host: str) -> None:
    assert _get(port, "/app.js", host)[0] == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "", None])
def test_a_foreign_host_header_is_refused(port: int, host: str | None) -> None:
    status, body = _get(port, "/app.js", host)
    assert status == 403 and b"FEATURES" not in body


@pytest.mark.parametrize("path", ["/index.html%00.js", "/\0", "/data/%00/index.js", "/%ff%fe"])
def test_a_nul_byte_or_bad_encoding_is_400_without_a_traceback(port: int, path: str, capfd) -> None:
    assert _get(port, path)[0] == 400
    assert "Traceback" not in capfd.readouterr().err


def test_a_port_in_use_says_so_and_where_the_pages_are(site: dict[str, Path], port: int, tmp_path: Path, capsys):
    out = tmp_path / "again"
    args = [str(site["run"]), "tokens=64", f"out={out}", "--serve", f"port={port}"]
    capsys.readouterr()
    assert features.main(args) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the line that says how long the pages took
    assert re.fullmatch(f"error: port {port} is in use: give another, e.g. port=\\d+ .*", last), err
    assert "Traceback" not in err
    assert f"open {out / 'index.html'} from disk" in last and (out / "index.html").is_file()


def test_only_the_named_subfolders_of_a_served_folder_are_served(site: dict[str, Path]) -> None:
    # an attribution graph's page links the run's feature pages: the run folder is served, its pages folders alone
    root = site["pages"].parent
    assert (site["run"] / "model.safetensors").is_file() and (root / "secret.txt").is_file()
    server = features.pages_server(root, 0, only=("pages",))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert _get(port, "/pages/") == (200, (STATIC / "index.html").read_bytes())
        for path in ("/secret.txt", "/run/model.safetensors", "/run/config.yaml", "/", "/pages/leak/secret.txt"):
            status, body = _get(port, path)
            assert status == 404 and b"secret" not in body, path
    finally:
        server.shutdown()
        server.server_close()


def test_serve_serves_the_pages_already_written_and_builds_only_if_none_are(
    site: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import json
    import shutil

    listed = json.loads((site["pages"] / features.MANIFEST).read_text())
    assert listed["pages"] == ["index.html"] and listed["options"]["tokens"] == 64
    served = []
    monkeypatch.setattr(features, "serve", lambda out, port, index, only=(): served.append((out, port, index)) or 0)

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pages were built again")

    monkeypatch.setattr(features, "load_model", no_build)
    run, pages = str(site["run"]), site["pages"]
    assert features.main([run, "tokens=64", f"out={pages}", "--serve", "port=8123"]) == 0
    assert served == [(pages.resolve(), 8123, pages.resolve() / "index.html")]
    err = capsys.readouterr().err
    assert "serving the pages already in" in err and "run without --serve" in err and "not " not in err
    assert features.main([run, "tokens=128", f"out={pages}", "--serve"]) == 0
    assert "with tokens=64 (not 128)" in capsys.readouterr().err
    # pages a killed build left (no manifest), or pages since removed: built again
    partial = tmp_path / "partial"
    shutil.copytree(pages, partial, symlinks=True)
    (partial / "index.html").unlink()
    assert features.written_pages(partial) is None
    (partial / features.MANIFEST).write_text(json.dumps({"pages": ["../secret.txt"]}))
    assert features.written_pages(partial) is None
    with pytest.raises(AssertionError, match="built again"):
        features.main([run, "tokens=64", f"out={partial}", "--serve"])
