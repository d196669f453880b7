"""The README is a front page (at most ~250 lines) and every link in it, in docs/ and in benchmarks/README.md leads
somewhere: the file exists and, for a page's #anchor, one of its headings makes that anchor (as GitHub spells it)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    # GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", page.read_text(), re.MULTILINE)}


def test_the_readme_is_a_front_page_and_every_page_s_links_lead_somewhere() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len(PAGES) >= 10  # the docs/ pages by topic
    broken = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", (ROOT / "README.md").read_text()))
    assert {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"} <= linked  # no page the front page hides
