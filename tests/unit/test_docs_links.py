"""The documentation's links hold: every relative link in README.md,
docs/**/*.md and CHANGELOG.md points to a file that exists, every #anchor (on the same page or
another) names a heading of its target as GitHub renders it, and every page at
the top of docs/ is linked from the README, the front door.

External links (any URL with a scheme: http(s), mailto...) are not checked.
Links inside code (fenced blocks and `code spans`) are not links, and headings
inside fenced blocks are not headings, so both are left out.

Anchors follow GitHub's rule (github-slugger): the heading's text as rendered
(a link's text, no inline markup), lowercased, every character that is not a
letter, digit, underscore, hyphen or space dropped, each space a hyphen; a
repeated slug gets -1, -2... in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "CHANGELOG.md"]


# ---------------------------------------------------------------- reading markdown

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
# [text](dest "title") and ![alt](dest); the text may hold one level of [brackets].
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^<>\n]*>|[^\s()<>]*(?:\([^\s()]*\)[^\s()<>]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
_HTML_ID = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for every line outside a fenced code block."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = _FENCE.match(line)
        if fence is None:
            if opened:
                fence = opened.group(1)
                continue
            yield number, line
        elif opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) \
                and not line.strip()[len(opened.group(1)):].strip():
            fence = None


def without_code_spans(text: str) -> str:
    """One line with its code spans blanked out (a link inside code is text)."""
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def heading_texts(text: str) -> list[str]:
    """Each heading's raw text, in order (ATX and setext)."""
    headings: list[str] = []
    previous: tuple[int, str] | None = None
    for number, line in prose_lines(text):
        atx = _ATX.match(line)
        if atx:
            headings.append(atx.group(2) or "")
            previous = None
            continue
        setext = _SETEXT.match(line)
        if setext and previous is not None and previous[0] == number - 1:
            prev = previous[1]
            is_paragraph = prev.strip() and not prev.lstrip().startswith(("|", "-", "*", "+", ">")) \
                and not re.match(r"^\s*\d+[.)]\s", prev) and not prev.startswith(("    ", "\t"))
            if is_paragraph:
                headings.append(prev.strip())
                previous = None
                continue
        previous = (number, line)
    return headings


def plain_heading(raw: str) -> str:
    """A heading's text as GitHub renders it: code spans' contents kept,
    images and links by their text, HTML tags and emphasis markers gone."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    text = re.sub(r"(?<!\w)(_{1,3})(\S(?:.*?\S)?)\1(?!\w)", r"\2", text)  # not inside a word
    return text


def github_slug(heading: str) -> str:
    """GitHub's anchor for one heading, before duplicates are numbered."""
    text = plain_heading(heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every #fragment a link into this markdown may name."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in heading_texts(text):
        base = github_slug(heading)
        slug = base
        while slug in seen:
            seen[base] += 1
            slug = f"{base}-{seen[base]}"
        seen[slug] = 0
        found.add(slug)
    found.update(_HTML_ID.findall(text))
    return found


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str


def links(path: Path) -> list[Link]:
    """Every link destination in a markdown file, outside code."""
    text = path.read_text(encoding="utf-8")
    kept = {number: line for number, line in prose_lines(text)}
    lines = [without_code_spans(kept.get(n, "")) for n in range(1, len(text.splitlines()) + 1)]
    # Inline links may wrap across lines: read the prose as one string, keeping line numbers.
    joined = "\n".join(lines)
    found: list[Link] = []
    for match in _INLINE_LINK.finditer(joined):
        target = match.group(1)
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        found.append(Link(path, joined.count("\n", 0, match.start()) + 1, target))
    for match in _REF_DEF.finditer(joined):
        found.append(Link(path, joined.count("\n", 0, match.start()) + 1, match.group(1).strip("<>")))
    return found


def problem(link: Link, root: Path = ROOT) -> str | None:
    """Why a link is broken, or None."""
    target = link.target
    if not target:
        return "an empty link"
    if _SCHEME.match(target) or target.startswith("//"):
        return None  # external: http(s), mailto and the like are not checked here
    path_part, _, fragment = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    resolved = (link.source.parent / path_part).resolve() if path_part else link.source
    if path_part.startswith("/"):
        resolved = (root / path_part.lstrip("/")).resolve()
    if root not in resolved.parents and resolved != root:
        return f"{target!r} points outside the repository"
    if not resolved.exists():
        return f"{target!r}: no file {resolved.relative_to(root)}"
    if not fragment:
        return None
    fragment = unquote(fragment)
    if resolved.suffix.lower() != ".md":
        if re.fullmatch(r"L\d+(-L\d+)?", fragment):
            return None  # GitHub's line anchors in a source file
        return f"{target!r}: #{fragment} points into {resolved.relative_to(root)}, which has no headings"
    if fragment not in anchors(resolved.read_text(encoding="utf-8")):
        return f"{target!r}: no heading in {resolved.relative_to(root)} has the anchor #{fragment}"
    return None


def broken(path: Path, root: Path = ROOT) -> list[str]:
    return [f"{link.source.relative_to(root)}:{link.line}: {why}"
            for link in links(path) if (why := problem(link, root)) is not None]


# ---------------------------------------------------------------- the checks


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    problems = broken(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / unquote(link.target.partition("#")[0])).resolve()
              for link in links(readme) if not _SCHEME.match(link.target)}
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ has no pages"
    missing = [str(page.relative_to(ROOT)) for page in pages if page.resolve() not in linked]
    assert not missing, f"docs pages the README doesn't link: {missing}"


def test_the_checker_finds_links_and_anchors() -> None:
    """The README and docs really are read: links found, anchors computed."""
    readme_links = links(ROOT / "README.md")
    assert any(link.target.startswith("docs/") for link in readme_links)
    assert any("#" in link.target for link in readme_links)
    assert "quick-start" in anchors((ROOT / "README.md").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- the rules themselves


@pytest.mark.parametrize("heading, slug", [
    ("Quick start", "quick-start"),
    ("What is read where: GPU memory on every vendor", "what-is-read-where-gpu-memory-on-every-vendor"),
    ("llama.cpp RPC: a model over several machines", "llamacpp-rpc-a-model-over-several-machines"),
    ("`tray-app status`", "tray-app-status"),
    ("Ollama's and Anthropic's APIs on the same port", "ollamas-and-anthropics-apis-on-the-same-port"),
    ("The web page, from a phone", "the-web-page-from-a-phone"),
    ("Reasoning (thinking models)", "reasoning-thinking-models"),
    ("[0.4.0] - 2026-12-06", "040---2026-12-06"),
    ("A [linked](other.md) **bold** word", "a-linked-bold-word"),
    ("snake_case stays", "snake_case-stays"),
    ("`[gpu] rpc_servers` and _emphasis_", "gpu-rpc_servers-and-emphasis"),
])
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_repeated_headings_are_numbered() -> None:
    text = "# Notes\n\n## Notes\n\n### Notes\n\n## Other\n"
    assert anchors(text) == {"notes", "notes-1", "notes-2", "other"}


def test_headings_and_links_inside_code_do_not_count(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Real\n\n```bash\n# not a heading\n[x](missing.md)\n```\n\n"
                    "`[y](also-missing.md)` and [z](page.md#real)\n", encoding="utf-8")
    assert anchors(page.read_text()) == {"real"}
    assert [link.target for link in links(page)] == ["page.md#real"]


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    (root / "other.md").write_text("# Setup\n\n## Setup\n", encoding="utf-8")
    page = root / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#setup-1) [same page](#page) [web](https://example.com/x.md#nope)\n"
        "[mail](mailto:someone@example.com) ![img](other.md)\n"
        "[gone](nothere.md) [bad anchor](other.md#setup-2)\n"
        "[bad here](#nothing) [wrapped\ntext](other.md#missing)\n",
        encoding="utf-8")
    found = broken(page, root)
    assert len(found) == 4, found
    assert "nothere.md" in found[0]
    assert "#setup-2" in found[1]
    assert "#nothing" in found[2]
    assert "#missing" in found[3] and found[3].startswith("page.md:6:")
