"""The docs stand on their own: every relative link resolves inside the repository.

A link to a file beside the checkout (``../<elsewhere>/...``) works only on the
machine it was written on; a user's clone has nothing there. So every
relative link of README.md and docs/*.md must name a file of this
repository (and, with ``#anchor``, a heading of that file), and no page may
point outside it, in a link or in plain text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: every markdown file a user reads, fixture READMEs included
ALL_MARKDOWN = sorted({*PAGES, *(ROOT / "tests" / "fixtures").rglob("*.md")})

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: a path in prose that climbs out of its folder (`../x/...`); checked against the repository root
_UP_PATH = re.compile(r"(?<![\w./])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*)")


def _lines(text: str, *, inline_code: bool) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code dropped unless kept."""
    out, in_code = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            out.append((n, line if inline_code else _INLINE_CODE.sub("", line)))
    return out


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _lines(page.read_text(encoding="utf-8"), inline_code=True):
        m = _HEADING.match(line)
        if m:
            base = _slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def _links(page: Path) -> list[tuple[int, str]]:
    return [
        (n, m.group(1))
        for n, line in _lines(page.read_text(encoding="utf-8"), inline_code=False)
        for m in _LINK.finditer(line)
    ]


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def test_the_pages_are_found() -> None:
    assert {"replay-math.md", "router-metrics.md", "bundle-format.md"} <= {p.name for p in PAGES}


def _broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link of ``page`` that leaves ``root`` or names nothing."""
    page, root = page.resolve(), root.resolve()
    bad = []
    for n, target in _links(page):
        if not _relative(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        where = f"{page.relative_to(root)}:{n}: {target}"
        if not dest.is_relative_to(root):
            bad.append(f"{where} points outside the repository")
        elif not dest.exists():
            bad.append(f"{where} names no file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{where} names no heading of {dest.relative_to(root)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_of_the_repository(page: Path) -> None:
    bad = _broken_links(page)
    assert not bad, "\n".join(bad)


def _paths_outside(page: Path, root: Path = ROOT) -> list[str]:
    """One line per `../` path mentioned anywhere in ``page`` (code included) that leaves ``root``:
    a user's clone holds nothing beside the checkout."""
    page, root = page.resolve(), root.resolve()
    return [
        f"{page.relative_to(root)}:{n}: {m.group(1)}"
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for m in _UP_PATH.finditer(line)
        if not (page.parent / m.group(1)).resolve().is_relative_to(root)
    ]


@pytest.mark.parametrize("page", ALL_MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_mentions_a_path_beside_the_checkout(page: Path) -> None:
    hits = _paths_outside(page)
    assert not hits, "\n".join(hits)


def test_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    """The checker itself: links in prose are found, links in code are not."""
    page = tmp_path / "p.md"
    page.write_text(
        "See [a](missing.md), [b](../outside/x.md), `[c](ignored.md)`,\n"
        "```\n[d](also-ignored.md)\n```\n[e](https://example.com).\n",
        encoding="utf-8",
    )
    assert [t for _, t in _links(page)] == ["missing.md", "../outside/x.md", "https://example.com"]
    assert not _relative("https://example.com") and _relative("../outside/x.md")


def test_broken_links_are_reported(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "beside.md").write_text("# Beside\n", encoding="utf-8")
    (repo / "docs" / "a.md").write_text("# Title\n\n## A section\n", encoding="utf-8")
    page = repo / "docs" / "p.md"
    page.write_text(
        "[ok](a.md#a-section) [gone](b.md) [out](../../beside.md) [anchor](a.md#nope)\n",
        encoding="utf-8",
    )
    assert [line.split(": ", 1)[1] for line in _broken_links(page, repo)] == [
        "b.md names no file",
        "../../beside.md points outside the repository",
        "a.md#nope names no heading of docs/a.md",
    ]


def test_a_path_beside_the_checkout_is_reported(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs" / "sub").mkdir(parents=True)
    page = repo / "docs" / "p.md"
    page.write_text(
        "see ../../elsewhere/spec/math.md and `../../notes/x.md`\n"
        "but ../README.md and ../docs/sub/ stay inside\n",
        encoding="utf-8",
    )
    assert _paths_outside(page, repo) == [
        "docs/p.md:1: ../../elsewhere/spec/math.md",
        "docs/p.md:1: ../../notes/x.md",
    ]
