"""The docs site builds with `mkdocs build --strict` (a broken link or anchor, a page left out
of the nav, a bad config all fail it), README stays a front door of at most 300 lines, and
README's links into docs/ reach pages and headings that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from conftest import REPO

README = REPO / "README.md"
# [text](target) where target is relative (no scheme, no leading /).
LINK = re.compile(r"\]\((?![a-z]+://|/|#)([^)\s]+)\)")


def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
         "--config-file", str(REPO / "mkdocs.yml")],
        capture_output=True, text=True, timeout=170, cwd=REPO,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    site, docs = tmp_path / "site", REPO / "docs"
    built = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    pages = sorted(p.relative_to(docs).with_suffix("") for p in docs.rglob("*.md"))
    for page in pages:
        expected = "index.html" if page.name == "index" else f"{page.as_posix()}/index.html"
        assert expected in built, (page, sorted(built))


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)


def anchors(page: Path) -> set[str]:
    """The ids Python-Markdown's toc gives the page's headings (code spans lose their
    backticks in the text it slugifies)."""
    found = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (heading := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)):
            found.add(slugify(re.sub(r"[`*_]", "", heading.group(1)), "-"))
    return found


@pytest.mark.parametrize("target", sorted(set(LINK.findall(README.read_text()))))
def test_readme_links_reach_what_they_name(target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (README.parent / path).resolve()
    assert resolved.exists(), target
    if anchor:
        assert anchor in anchors(resolved), (target, sorted(anchors(resolved)))
