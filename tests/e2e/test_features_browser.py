"""The feature pages in a real browser (headless Chromium, Debian's `chromium`; those tests are skipped where it is
missing): the index renders its table of latents and one latent its contexts, with no console error, from disk; a
corpus that holds `<script>` and `</div>` shows them as text; and `--serve` serves the pages until Ctrl-C."""

from __future__ import annotations

import html
import json
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import CHROMIUM, finished_run, headless_chromium, popen

from runner.tools.features import main

browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
HOSTILE = '<script>alert("owned")</script> </div><img src=x onerror=alert(1)> '


@pytest.fixture(scope="module")
def sae_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished SAE on a tiny GPT trained on text full of markup."""
    root = tmp_path_factory.mktemp("features")
    for i in range(4):  # every other file held out
        (root / f"page{i}.txt").write_text((HOSTILE + f"plain text number {i}, more words\n") * 60)
    lm = root / "lm"
    lm.mkdir()
    tiny = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.val_windows=16"]
    finished_run(
        lm,
        "+experiment=lm",
        f"data.paths=[{root}/*.txt]",
        "data.val_every=2",
        *tiny,
        "trainer.max_duration=30st",
        "logger=none",
        "callbacks=none",
        "checkpoint=none",
    )
    sae = root / "sae"
    sae.mkdir()
    small = ["model.n_latents=64", "model.k=4", "data.batch_size=64", "data.buffer_size=512", "logger=none"]
    finished_run(
        sae,
        "+experiment=sae_lm",
        f"source.checkpoint={lm}",
        "source.layer=1",
        *small,
        "data.samples_per_epoch=1024",
        "trainer.max_duration=20st",
        "checkpoint=none",
    )
    return sae


@pytest.fixture(scope="module")
def pages(sae_run: Path) -> Path:
    """Its feature pages."""
    assert main([str(sae_run), "tokens=2000", f"out={sae_run.parent / 'pages'}"]) == 0
    return sae_run.parent / "pages"


@browser
def test_the_index_and_a_latent_render_from_disk_with_no_console_error(pages: Path, tmp_path: Path) -> None:
    index, console = headless_chromium((pages / "index.html").as_uri())
    assert console == [], console
    assert len(re.findall(r'class="latent-row"', index)) == 64  # one page of the table: all 64 latents
    shot = tmp_path / "index.png"
    headless_chromium((pages / "index.html").as_uri(), f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.stat().st_size > 10_000
    latent = re.search(r'href="#latent=(\d+)"', index).group(1)  # the densest latent (the table's first row)
    view, console = headless_chromium(f"{(pages / 'index.html').as_uri()}#latent={latent}")
    assert console == [], console
    assert f"latent {latent}</h2>" in view and len(re.findall(r'class="ctx"', view)) >= 16
    assert 'class="tok fire"' in view


@browser
def test_markup_in_the_corpus_is_shown_as_text(pages: Path) -> None:
    shown = ""
    index, _ = headless_chromium((pages / "index.html").as_uri())
    for latent in re.findall(r'href="#latent=(\d+)"', index)[:8]:  # the densest latents: contexts of all kinds
        view, console = headless_chromium(f"{(pages / 'index.html').as_uri()}#latent={latent}")
        assert console == [], console
        assert "<img" not in view and "alert(" not in "".join(re.findall(r"<script[^>]*>[^<]*", view))
        shown += html.unescape(re.sub(r"<[^>]+>", "", view))  # the page's text, as a reader sees it
    # (a context is 31 tokens: the markup comes in pieces)
    assert "<script>" in shown and "</div><img" in shown


@browser
def test_every_latent_shows_five_fifths_or_says_why_and_no_blank_token_cell(pages: Path) -> None:
    # the faults this guards against: a fifth missing, blank cells where the token was a space, histograms without a
    # count axis
    def cells(view: str) -> list[str]:  # the text of every token cell (top tokens, promotes, suppresses)
        found = re.findall(r'<td class="text ctx">(.*?)</td>', view)
        return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in found]

    # every latent's data: five fifths, or a note that says how many are empty (that no example repeats a strongest
    # row is tested on rows in tests/unit/test_features.py: this corpus repeats its text, so contexts repeat here)
    data = (pages / "data" / "latents-0000.js").read_text()
    latents = json.loads(re.fullmatch(r"FEATURES\.chunk\((.*)\);\n", data, re.DOTALL).group(1))["latents"]
    assert len(latents) == 64
    for number, latent in latents.items():
        intervals = latent["intervals"]
        assert len(intervals) == 5 or latent["note"].startswith(f"{5 - len(intervals)} of the 5 fifths"), number
    assert sum(len(latent["intervals"]) == 5 for latent in latents.values()) >= 16  # most that fire often
    index, _ = headless_chromium((pages / "index.html").as_uri())
    assert cells(index) and all(text.strip() for text in cells(index)), cells(index)
    assert "\u2423" in "".join(cells(index))  # this corpus's space tokens, drawn
    assert re.search(r'class="axis"><span>[\d,]+</span><span>latents</span><span>0</span>', index)
    densities = re.findall(r'href="#latent=(\d+)">\d+</a></td><td>([^<]+)</td>', index)  # densest first
    fired = [latent for latent, density in densities if density != "0"]
    # the densest latent and the rarest one that fired, rendered: five fifths, or a note saying why not
    for latent in (fired[0], fired[-1]):
        view, console = headless_chromium(f"{(pages / 'index.html').as_uri()}#latent={latent}")
        assert console == [], console
        fifths = re.findall(r'<h3 class="quantile">examples from the (\d+)-(\d+)% quantile', view)
        note = re.search(r'class="muted note">(\d) of the 5 fifths have no examples: it fired on', view)
        assert len(fifths) == 5 or (note and int(note.group(1)) == 5 - len(fifths)), (latent, fifths)
        assert fifths == sorted(fifths, key=lambda f: -int(f[0]))  # the strongest fifth first, none twice
        assert all(text.strip() for text in cells(view)), (latent, cells(view))
        assert re.search(r'class="axis"><span>[\d,]+</span><span>rows</span><span>0</span>', view)


def test_serve_serves_the_pages_on_localhost_until_ctrl_c(sae_run: Path, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "served"
    proc = popen(
        "-m", "runner.features", str(sae_run), "tokens=500", f"out={out}", "--serve", f"port={port}", cwd=tmp_path
    )
    try:
        deadline, page = time.monotonic() + 120, None
        while page is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=5).read().decode()
            except OSError:
                time.sleep(0.5)
        assert page == (out / "index.html").read_text()
        data = urllib.request.urlopen(f"http://127.0.0.1:{port}/data/index.js", timeout=5).read().decode()
        assert data == (out / "data" / "index.js").read_text() and data.startswith("FEATURES.index(")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"serving {out} at http://127.0.0.1:{port}/" in err
