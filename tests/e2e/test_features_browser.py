"""The feature pages in a real browser (headless Chromium, Debian's `chromium`; skipped where it is missing): the index
renders its table of latents and one latent its contexts, with no console error, from disk; and a corpus that holds
`<script>` and `</div>` shows them as text."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import finished_run

from runner.features import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
HOSTILE = '<script>alert("owned")</script> </div><img src=x onerror=alert(1)> '


def _browser(url: str, *args: str) -> tuple[str, list[str]]:
    # the DOM after the page's scripts ran (or what `args` ask instead), and the console lines Chromium logged
    done = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
        + ["--virtual-time-budget=5000", *(args or ["--dump-dom"]), url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if "CONSOLE" in line]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Feature pages of an SAE on a tiny GPT trained on text full of markup."""
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
    assert main([str(sae), "tokens=2000", f"out={root / 'pages'}"]) == 0
    return root / "pages"


def test_the_index_and_a_latent_render_from_disk_with_no_console_error(pages: Path, tmp_path: Path) -> None:
    index, console = _browser((pages / "index.html").as_uri())
    assert console == [], console
    assert len(re.findall(r'class="latent-row"', index)) == 64  # one page of the table: all 64 latents
    shot = tmp_path / "index.png"
    _browser((pages / "index.html").as_uri(), f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.stat().st_size > 10_000
    latent = re.search(r'href="#latent=(\d+)"', index).group(1)  # the densest latent (the table's first row)
    view, console = _browser(f"{(pages / 'index.html').as_uri()}#latent={latent}")
    assert console == [], console
    assert f"latent {latent}</h2>" in view and len(re.findall(r'class="ctx"', view)) >= 16
    assert 'class="tok fire"' in view


def test_markup_in_the_corpus_is_shown_as_text(pages: Path) -> None:
    shown = ""
    index, _ = _browser((pages / "index.html").as_uri())
    for latent in re.findall(r'href="#latent=(\d+)"', index)[:8]:  # the densest latents: contexts of all kinds
        view, console = _browser(f"{(pages / 'index.html').as_uri()}#latent={latent}")
        assert console == [], console
        assert "<img" not in view and "alert(" not in "".join(re.findall(r"<script[^>]*>[^<]*", view))
        shown += html.unescape(re.sub(r"<[^>]+>", "", view))  # the page's text, as a reader sees it
    # (a context is 31 tokens: the markup comes in pieces)
    assert "<script>" in shown and "</div><img" in shown
