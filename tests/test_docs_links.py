"""Every relative markdown link of the README, the docs pages and the other top-level pages leads to a file
that exists, and a `#anchor` into a markdown file to one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "BENCHMARKS.md", ROOT / "data" / "README.md",
                *(ROOT / "docs").glob("*.md")})
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    slugs: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = _slug(heading)
        n = slugs.get(slug, 0)
        slugs[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_pages_exist() -> None:
    assert (ROOT / "docs").is_dir() and len(PAGES) > 4


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_quickstart() -> None:
    """At most ~200 lines, with the test command CI runs (.ci/run), and a link to every docs page."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "`bash scripts/test.sh`" in text
    linked = {Path(target.partition("#")[0]).name for target in _links(ROOT / "README.md")}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
