"""A safe subset of Markdown, as the HTML a QTextDocument draws. No Qt here.

The model's text is never HTML: every character of it is escaped, and the
only tags in the result are the ones made here. The subset is what chat
answers use: headings, paragraphs, bold, italic, strikethrough, inline code,
fenced code blocks, bullet and numbered lists (nested by indentation),
quotes, horizontal rules, and links (http, https and mailto only; any other
target stays text, so a `javascript:` link is never clickable).

A single newline stays a line break, as the answer streamed it: a poem or
an address keeps its lines when the finished answer is drawn as Markdown.
Code blocks always stand on their own (one inside a list item ends the list,
and the list goes on numbered after it), so the transcript's code blocks
are its nested tables, in the order code_blocks() lists them.
"""

from __future__ import annotations

import bisect
import html
import re
from dataclasses import dataclass, field

from . import colors
from .colors import RGB

LINK_SCHEMES = ("http://", "https://", "mailto:")

# Every pattern here runs in time linear in its line or block: no two
# quantifiers in a row that can take the same characters (a fence's `[ \t]*`
# before an info string that also takes blanks was quadratic in a line of
# blanks), and no lazy `[\s\S]+?` that rescans to the end for each opener
# (emphasis and code spans are paired by the scanners below instead).
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_HEADING = re.compile(r"^ {0,3}(?P<level>#{1,6})(?:[ \t]+(?P<text>.*))?$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_ITEM = re.compile(r"^(?P<indent>[ \t]*)(?P<marker>[-*+]|\d{1,9}[.)])[ \t]+(?P<text>\S.*)$")
_QUOTE = re.compile(r"^ {0,3}> ?(?P<text>.*)$")

# What must not be touched by the emphasis rules: code spans, links, URLs,
# backslash escapes. Each is swapped for a placeholder first. A code span's
# opening run of backticks is found here and its closing run by
# _code_span_end (a lazy match to its closer would rescan the rest of the
# text for every backtick that has none). A link's label holds no `[` and an
# autolink no `<`, so a failed match ends at the next one.
_PROTECTED = re.compile(
    r"(?P<ticks>`+)"
    r"|\[(?P<label>[^\[\]\n]+)\]\((?P<url>[^()\s]+)(?:[ \t]+\"[^\"\n]*\")?\)"
    r"|<(?P<auto>(?:https?://|mailto:)[^<>\s]+)>"
    r"|(?P<bare>https?://[^\s<>()\[\]]*[^\s<>()\[\].,;:!?'\"*_~])"
    r"|\\(?P<escaped>[!-/:-@\[-`{-~])"
)
_TICK_RUN = re.compile(r"`+")


@dataclass(frozen=True)
class _Emphasis:
    """One emphasis rule: a delimiter `width` characters wide opens where
    `opener` matches and closes at the first `closer` after at least one
    character; the text between goes in `tag`."""

    opener: re.Pattern[str]
    closer: re.Pattern[str]
    width: int
    tag: str


_EMPHASIS = (
    _Emphasis(re.compile(r"\*\*(?=\S)"), re.compile(r"(?<=\S)\*\*"), 2, "b"),
    _Emphasis(re.compile(r"(?<!\w)__(?=\S)"), re.compile(r"(?<=\S)__(?!\w)"), 2, "b"),
    _Emphasis(re.compile(r"~~(?=\S)"), re.compile(r"(?<=\S)~~"), 2, "s"),
    _Emphasis(re.compile(r"(?<!\*)\*(?=[^\s*])"), re.compile(r"(?<=[^\s*])\*(?!\*)"), 1, "i"),
    _Emphasis(re.compile(r"(?<!\w)_(?=[^\s_])"), re.compile(r"(?<=[^\s_])_(?!\w)"), 1, "i"),
)
# Placeholders use private-use characters; the text's own are dropped first.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

HEADING_SIZES = {1: "x-large", 2: "large", 3: "medium"}


@dataclass(frozen=True)
class MarkdownColors:
    """Colours for what Markdown adds to an answer, on the answer's bubble."""

    code_background: RGB
    code_text: RGB
    link: RGB
    quote: RGB


def markdown_colors(chat: colors.ChatColors) -> MarkdownColors:
    bubble = chat.answer_bubble
    # A well a little off the bubble, towards the text colour: darker on a
    # light theme, lighter on a dark one, never a bright patch.
    code_background = colors.mix(bubble, chat.answer_text, 0.10 if colors.is_dark(bubble) else 0.06)
    return MarkdownColors(
        code_background=code_background,
        code_text=colors.readable(chat.answer_text, code_background),
        link=colors.status_color("info", bubble),
        quote=chat.meta_text,
    )


@dataclass
class Block:
    kind: str                 # paragraph | heading | code | list | quote | rule
    text: str = ""            # paragraph, heading and quote text; the code of a code block
    level: int = 0            # a heading's level
    info: str = ""            # a code block's language, as the fence names it
    items: list[tuple[int, bool, int, str]] = field(default_factory=list)  # (indent, ordered, number, text)
    # Lines gathered while parsing, joined once at the end (adding each line
    # to the text would copy the text again for every line): a quote's
    # lines, or (item, line) for the lines under a list's items.
    lines: list = field(default_factory=list, repr=False, compare=False)

    def join_lines(self) -> None:
        if self.kind == "quote":
            self.text = "\n".join(self.lines)
        elif self.kind == "list" and self.lines:
            under: dict[int, list[str]] = {}
            for item, line in self.lines:
                under.setdefault(item, []).append(line)
            self.items = [(indent, ordered, number, "\n".join([text, *under.get(index, ())]))
                          for index, (indent, ordered, number, text) in enumerate(self.items)]
        self.lines = []


def parse(text: str) -> list[Block]:
    """The blocks of `text`, in order."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    blocks: list[Block] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            blocks.append(Block("paragraph", "\n".join(paragraph)))
            paragraph.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        fence = _FENCE.match(line)
        if fence:
            flush()
            mark, indent = fence["fence"], len(fence["indent"])
            code: list[str] = []
            # An unclosed fence (a truncated answer) runs to the end.
            while i < len(lines) and not _closes(lines[i], mark):
                code.append(_dedent(lines[i], indent))
                i += 1
            i += 1
            info = fence["info"].strip()
            blocks.append(Block("code", "\n".join(code), info=info.split()[0] if info else ""))
            continue
        if not line.strip():
            flush()
            continue
        if heading := _HEADING.match(line):
            flush()
            blocks.append(Block("heading", _heading_text(heading["text"] or ""), level=len(heading["level"])))
        elif _RULE.match(line):
            flush()
            blocks.append(Block("rule"))
        elif item := _ITEM.match(line):
            flush()
            marker = item["marker"]
            ordered = marker[0].isdigit()
            entry = (_width(item["indent"]), ordered, int(marker[:-1]) if ordered else 0, item["text"])
            previous = blocks[-1] if blocks else None
            # A list goes on across blank lines between its items (anything
            # else in between would be the last block).
            if previous is not None and previous.kind == "list":
                previous.items.append(entry)
            else:
                blocks.append(Block("list", items=[entry]))
        elif quote := _QUOTE.match(line):
            flush()
            previous = blocks[-1] if blocks else None
            # Quote lines in a row are one quote; a blank line starts another.
            if previous is not None and previous.kind == "quote" and lines[i - 2].strip():
                previous.lines.append(quote["text"])
            else:
                blocks.append(Block("quote", lines=[quote["text"]]))
        elif not paragraph and blocks and blocks[-1].kind == "list" and lines[i - 2].strip():
            # A line under a list item, not a new paragraph: the item goes on.
            blocks[-1].lines.append((len(blocks[-1].items) - 1, line.strip()))
        else:
            paragraph.append(line)
    flush()
    for block in blocks:
        block.join_lines()
    return blocks


def _heading_text(text: str) -> str:
    """A heading's text without its closing #s ("## Title ##"), which need a
    blank before them; string operations, as a regex for them backtracked
    over every blank of a long line."""
    text = text.strip(" \t")
    bare = text.rstrip("#")
    if bare != text and (not bare or bare[-1] in " \t"):
        text = bare.rstrip(" \t")
    return text


def _closes(line: str, mark: str) -> bool:
    stripped = line.strip()
    return stripped.startswith(mark) and not stripped.strip(mark[0])


def _dedent(line: str, indent: int) -> str:
    """`line` without up to `indent` leading spaces (the fence's own indent)."""
    spaces = len(line) - len(line.lstrip(" "))
    return line[min(spaces, indent):]


def _width(indent: str) -> int:
    return len(indent.replace("\t", "    "))


def code_blocks(text: str) -> list[str]:
    """The code of each fenced block of `text`, in order."""
    return [block.text for block in parse(text) if block.kind == "code"]


def to_html(text: str, palette: MarkdownColors) -> str:
    """`text` as HTML: Markdown's subset drawn, everything else escaped."""
    parts = []
    for block in parse(text):
        # Space between blocks, none above the first: the bubble has its own padding.
        top = "0" if not parts else "8px"
        if block.kind == "paragraph":
            parts.append(f'<p style="margin-top:{top}; margin-bottom:0">{inline_html(block.text, palette)}</p>')
        elif block.kind == "heading":
            size = HEADING_SIZES.get(block.level, "medium")
            parts.append(f'<p style="margin-top:{top}; margin-bottom:0; font-size:{size}; font-weight:600">'
                         f'{inline_html(block.text, palette)}</p>')
        elif block.kind == "code":
            parts.append(_code_html(block, palette, top))
        elif block.kind == "list":
            parts.append(_list_html(block.items, palette, top))
        elif block.kind == "quote":
            parts.append(f'<p style="margin-top:{top}; margin-bottom:0; margin-left:14px; '
                         f'color:{colors.to_hex(palette.quote)}">{inline_html(block.text, palette)}</p>')
        else:
            parts.append("<hr>")
    return "".join(parts)


def _code_html(block: Block, palette: MarkdownColors, top: str) -> str:
    background = colors.to_hex(palette.code_background)
    return (f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{background}" '
            f'style="margin-top:{top}; margin-bottom:0"><tr><td>'
            f'<pre style="margin:0; color:{colors.to_hex(palette.code_text)}">{html.escape(block.text)}</pre>'
            '</td></tr></table>')


def _list_html(items: list[tuple[int, bool, int, str]], palette: MarkdownColors, top: str) -> str:
    """Nested <ul>/<ol> from (indent, ordered, number, text): deeper indent, deeper list."""
    out: list[str] = []
    open_lists: list[tuple[int, bool]] = []  # (indent, ordered) of each list still open
    for indent, ordered, number, text in items:
        while open_lists and indent < open_lists[-1][0]:
            out.append(f"</li></{'ol' if open_lists.pop()[1] else 'ul'}>")
        if open_lists and indent == open_lists[-1][0] and ordered != open_lists[-1][1]:
            out.append(f"</li></{'ol' if open_lists.pop()[1] else 'ul'}>")
        if not open_lists or indent > open_lists[-1][0]:
            tag = "ol" if ordered else "ul"
            start = f' start="{number}"' if ordered and number != 1 else ""
            margin = f"margin-top:{top if not open_lists else '0'}; margin-bottom:0"
            out.append(f'<{tag}{start} style="{margin}">')
            open_lists.append((indent, ordered))
        else:
            out.append("</li>")
        out.append(f"<li>{inline_html(text, palette)}")
    while open_lists:
        out.append(f"</li></{'ol' if open_lists.pop()[1] else 'ul'}>")
    return "".join(out)


def inline_html(text: str, palette: MarkdownColors, *, links: bool = True) -> str:
    """One block's text: code spans, links and emphasis; newlines as <br>.
    Without `links`, URLs stay text (a link's label: no link inside a link).

    Linear in the text's length: each scan goes on from where the last one
    stopped, and a delimiter that finds no partner ends its rule's scan."""
    text = text.replace(_OPEN, "").replace(_CLOSE, "")
    kept: list[str] = []
    marked = html.escape(_protect(text, palette, links, kept))
    for rule in _EMPHASIS:
        marked = _emphasize(marked, rule)
    marked = marked.replace("\n", "<br>")
    return _PLACEHOLDER.sub(lambda m: kept[int(m[1])], marked)


def _protect(text: str, palette: MarkdownColors, links: bool, kept: list[str]) -> str:
    """`text` with each code span, link, URL and escape drawn into `kept`
    and replaced by its placeholder."""
    tick_runs: dict[int, list[int]] = {}  # a run's width -> where such runs start, in order
    for run in _TICK_RUN.finditer(text):
        tick_runs.setdefault(run.end() - run.start(), []).append(run.start())
    out: list[str] = []
    position = 0
    while match := _PROTECTED.search(text, position):
        start, end = match.span()
        if match["ticks"]:
            width = end - start
            closing = _code_span_end(tick_runs.get(width, ()), end)
            if closing is None:
                # No run as wide closes it: the backticks are text (CommonMark's rule).
                out.append(text[position:end])
                position = end
                continue
            kept.append(_code_span_html(text[end:closing], palette))
            end = closing + width
        else:
            kept.append(_protected_html(match, palette, links))
        out.append(f"{text[position:start]}{_OPEN}{len(kept) - 1}{_CLOSE}")
        position = end
    out.append(text[position:])
    return "".join(out)


def _code_span_end(run_starts: list[int] | tuple[()], after: int) -> int | None:
    """Where the first run of the same width at or after `after` starts: the
    span's closer. Runs are whole runs, so none starts right at `after`."""
    index = bisect.bisect_left(run_starts, after)
    return run_starts[index] if index < len(run_starts) else None


def _emphasize(marked: str, rule: _Emphasis) -> str:
    """`marked` with each opener of `rule` and the first closer after it in
    `rule.tag`, scanning left to right as a regex substitution would."""
    out: list[str] = []
    position = 0
    while opener := rule.opener.search(marked, position):
        start = opener.start()
        closer = rule.closer.search(marked, start + rule.width + 1)
        if closer is None:
            break  # a later opener would need a closer later still
        out.append(f"{marked[position:start]}<{rule.tag}>{marked[start + rule.width:closer.start()]}</{rule.tag}>")
        position = closer.end()
    out.append(marked[position:])
    return "".join(out)


def _code_span_html(code: str, palette: MarkdownColors) -> str:
    if code.startswith(" ") and code.endswith(" ") and code.strip():
        code = code[1:-1]
    return (f'<code style="background-color:{colors.to_hex(palette.code_background)}; '
            f'color:{colors.to_hex(palette.code_text)}">{html.escape(code).replace(chr(10), " ")}</code>')


def _protected_html(match: re.Match[str], palette: MarkdownColors, links: bool) -> str:
    if match["escaped"]:
        return html.escape(match["escaped"])
    url = match["url"] or match["auto"] or match["bare"]
    label = match["label"]
    if not links or not url.lower().startswith(LINK_SCHEMES):
        return html.escape(match[0])  # not a link we open: the text as written
    shown = inline_html(label, palette, links=False) if label else html.escape(url)
    return (f'<a href="{html.escape(url, quote=True)}" style="color:{colors.to_hex(palette.link)}">'
            f'{shown}</a>')
