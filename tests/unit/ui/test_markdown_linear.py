"""The chat's Markdown takes time linear in the answer's length, whatever the
answer holds (issue 27: a 16 KB answer took 0.45 s, and 64 KB of unclosed
`**` took 9 s, as each delimiter without a partner rescanned the rest).

No wall-clock threshold: the shape is checked. Each input is drawn at a size
and at 8 times that size, and the larger must take less than 24 times as long
(linear work takes about 8 times as long, quadratic work 64 times). Times are
this process's CPU time, the best of a few runs, so other processes on a busy
machine don't count."""

from __future__ import annotations

import time
from typing import Callable

import pytest

from tray_app.ui import colors
from tray_app.ui import markdown as md

PALETTE = md.markdown_colors(colors.chat_colors(colors.LIGHT))
SMALL = 4_000
GROWTH = 8
# Linear: about GROWTH; quadratic: GROWTH ** 2. Far from both.
MOST = 3 * GROWTH


def repeated(unit: str) -> Callable[[int], str]:
    return lambda size: unit * (size // len(unit))


# Each shape made one of the old patterns rescan the rest of its text (or
# line) from every position where it could start.
SHAPES = {
    "bold never closed": repeated("**a "),
    "strikethrough never closed": repeated("~~a "),
    "underscore emphasis never closed": repeated("_a "),
    "star emphasis never closed": repeated("*a "),
    "link label never closed": repeated("[a "),
    "autolink never closed": repeated("<http://a"),
    "code span with no run as wide": lambda size: "``" + "a` " * (size // 3),
    "heading with a long run of blanks": lambda size: "# a" + " " * size + "x",
    "fence line with a long run of blanks": lambda size: "```" + " " * size + "`",
    "list item with many lines under it": lambda size: "- item\n" + "  more\n" * (size // 7),
    "quote of many lines": repeated("> q\n"),
    "an ordinary answer": repeated("Some **bold**, *italic*, `code`, a [link](https://example.org) and text.\n\n"),
}


def cpu_time(text: str, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        md.to_html(text, PALETTE)
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("shape", SHAPES)
def test_drawing_takes_time_linear_in_the_answer(shape: str) -> None:
    make = SHAPES[shape]
    small, large = make(SMALL), make(SMALL * GROWTH)
    small_s = max(cpu_time(small, runs=5), 1e-5)  # a clock tick is not zero work
    large_s = cpu_time(large)
    assert large_s < MOST * small_s, (
        f"{shape}: {len(large)} characters took {large_s * 1000:.1f} ms, {large_s / small_s:.0f} times the "
        f"{small_s * 1000:.2f} ms of {len(small)}: that grows faster than the text")


def test_the_linear_scanners_draw_what_the_patterns_did() -> None:
    # Emphasis pairs each opener with the first closer after it, as a lazy
    # regex would, and a delimiter without a partner stays text.
    out = md.inline_html("**a** **b ~~c~~ *d* _e_ __f__ x_y_z **open", PALETTE)
    assert out == "<b>a</b> **b <s>c</s> <i>d</i> <i>e</i> <b>f</b> x_y_z **open"
    # A code span closes at a run of backticks exactly as wide as its opener.
    out = md.inline_html("``a ` b`` and `c`` d` and ``e", PALETTE)
    assert out.count("<code") == 2 and ">a ` b</code>" in out and ">c`` d</code>" in out and "``e" in out
    # The innermost brackets make the link; an autolink ends at a blank or "<".
    out = md.inline_html("[a [b](https://x.org) <http://y.org<z>", PALETTE)
    assert out.startswith('[a <a href="https://x.org"') and 'href="http://y.org"' in out
    assert md.parse("## Title ##")[0].text == "Title" and md.parse("# C#")[0].text == "C#"
    assert md.parse("```python   \nx\n```")[0].info == "python"
    (item,) = md.parse("- one\n  two\n  three")[0].items
    assert item[3] == "one\ntwo\nthree"
    assert md.parse("> a\n> b")[0].text == "a\nb"
