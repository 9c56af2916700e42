"""The README stays a page a newcomer reads: short, with the quick start, and links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 200
MAX_BYTES = 12 * 1024
QUICK_START = ("bash scripts/demo.sh", "bash scripts/test.sh")

#: `[text](target)` and `[text]: target`; the target up to a space, `)` or the end of the line
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def relative_links(markdown: str) -> list[str]:
    """Link targets that point into the repository (no scheme, no `mailto:`, not a bare `#anchor`),
    without their `#anchor`; links inside fenced code blocks are not links."""
    text = _FENCE.sub("", markdown)
    targets = [a or b for a, b in _LINK.findall(text)]
    return [
        t.split("#", 1)[0]
        for t in targets
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")
    ]


def markdown_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, (
        "README.md is over 200 lines: move reference material to docs/"
    )
    size = len(text.encode("utf-8"))
    assert size <= MAX_BYTES, (
        f"README.md is {size} bytes (at most {MAX_BYTES}): move reference material to docs/"
    )


def test_readme_has_the_two_command_quick_start() -> None:
    text = README.read_text(encoding="utf-8")
    for command in QUICK_START:
        assert command in text, f"README.md's quick start lacks `{command}`"


def test_readme_links_the_docs_pages() -> None:
    linked = {Path(t).name for t in relative_links(README.read_text(encoding="utf-8"))}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages, "docs/ holds no page"
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    missing = [
        target
        for target in relative_links(page.read_text(encoding="utf-8"))
        if target and not (page.parent / target).resolve().exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_relative_links_finds_links_and_skips_the_rest() -> None:
    text = (
        "[a](docs/a.md) [b](../x/y.py#L3 'title') [web](https://example.com) [top](#top)\n"
        "[ref]: docs/ref.md\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    assert relative_links(text) == ["docs/a.md", "../x/y.py", "docs/ref.md"]
