"""Every link inside the docs and the README reaches a heading (GitHub's anchor of it) or a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken(page: Path) -> list[str]:
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists() or (fragment and fragment not in anchors(where)):
            bad.append(target)
    return bad


def test_every_link_reaches_its_heading_or_file():
    assert {page.name: broken(page) for page in PAGES if broken(page)} == {}


def test_a_link_to_a_heading_that_is_not_there_is_caught(tmp_path):
    """Negative control: the same check on a page with a misspelt anchor and a missing file."""
    page = tmp_path / "p.md"
    page.write_text(
        "## A loop of your own: `samestep.Run`\n[ok](#a-loop-of-your-own-samesteprun) "
        "[bad](#a-loop-of-your-own) [gone](missing.md)\n",
        encoding="utf-8",
    )
    assert broken(page) == ["#a-loop-of-your-own", "missing.md"]
