"""The chat's Markdown subset: what it draws, and that the model's text is never HTML."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tray_app.ui import colors
from tray_app.ui import markdown as md

LIGHT = md.markdown_colors(colors.chat_colors(colors.LIGHT))
DARK_PALETTE = colors.Palette(window=(0x2D, 0x2F, 0x33), window_text=(0xE8, 0xE8, 0xE8), base=(0x1F, 0x21, 0x24),
                              text=(0xE8, 0xE8, 0xE8), muted_text=(0x9A, 0xA0, 0xA6))


def html(text: str) -> str:
    return md.to_html(text, LIGHT)


def test_the_modules_stay_free_of_qt() -> None:
    code = ("import sys, tray_app.ui.markdown, tray_app.ui.conversations; "
            "sys.exit(any(m.startswith('PySide6') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("text", [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "**<b>bold</b>**",
    "`<i>code</i>`",
    "```html\n<a href='x'>fence</a>\n```",
    "- <u>item</u>",
    "# <h1>heading</h1>",
    "> <span>quote</span>",
    "[<b>label</b>](https://example.org/\"onmouseover=\"x)",
])
def test_html_in_the_text_is_escaped_everywhere(text: str) -> None:
    out = html(text)
    for tag in ("<script", "<img", "<u>", "<h1>", "<span>", "<a href='x'", "<i>code", "<b>bold", "<b>label"):
        assert tag not in out, out
    assert "&lt;" in out


def test_emphasis_code_and_headings() -> None:
    out = html("# Title\nSome **bold**, *italic*, __strong__, _em_, ~~gone~~ and `a < b`.")
    assert 'font-size:x-large; font-weight:600">Title</p>' in out
    assert "<b>bold</b>" in out and "<i>italic</i>" in out and "<b>strong</b>" in out and "<i>em</i>" in out
    assert "<s>gone</s>" in out
    assert f'background-color:{colors.to_hex(LIGHT.code_background)}' in out and ">a &lt; b</code>" in out


def test_what_is_not_emphasis_stays_as_written() -> None:
    out = html(r"snake_case_name, 2 * 3 * 4, \*literal\* and `**not bold**`")
    assert "snake_case_name" in out and "2 * 3 * 4" in out and "*literal*" in out
    assert "<b>" not in out and "<i>" not in out
    assert ">**not bold**</code>" in out


def test_a_fenced_code_block_is_a_monospace_box_with_its_text_untouched() -> None:
    text = "Before:\n\n```python\nif a < b and c:\n    print(\"**hi**\")\n```\nAfter."
    out = html(text)
    assert f'bgcolor="{colors.to_hex(LIGHT.code_background)}"' in out
    assert "<pre " in out and "if a &lt; b and c:\n    print(&quot;**hi**&quot;)</pre>" in out
    assert md.code_blocks(text) == ['if a < b and c:\n    print("**hi**")']
    assert out.index("Before:") < out.index("<pre") < out.index("After.")


def test_an_unclosed_fence_runs_to_the_end_and_tilde_fences_work() -> None:
    assert md.code_blocks("~~~\nx = 1\n~~~\ntext\n```\nunfinished\nstill code") == ["x = 1", "unfinished\nstill code"]


def test_lists_nest_and_numbering_goes_on_after_a_code_block() -> None:
    text = "1. one\n2. two\n   - a\n   - b\n\n   ```sh\n   make\n   ```\n3. three"
    out = html(text)
    assert out.startswith('<ol style=') and "<li>one</li><li>two<ul" in out and "<li>a</li><li>b</li></ul>" in out
    assert '<ol start="3"' in out and "<li>three</li>" in out
    assert md.code_blocks(text) == ["make"]
    assert "<ul" in html("- x\n* y\n+ z") and html("- x\n* y\n+ z").count("<li>") == 3


def test_links_only_for_web_and_mail() -> None:
    out = html("[docs](https://example.org/a?b=1&c=2), <mailto:me@example.org>, see http://x.org/page.")
    assert '<a href="https://example.org/a?b=1&amp;c=2"' in out and ">docs</a>" in out
    assert '<a href="mailto:me@example.org"' in out
    assert '<a href="http://x.org/page"' in out and "</a>." in out  # the full stop is not part of the link
    assert f"color:{colors.to_hex(LIGHT.link)}" in out
    unsafe = html("[click](javascript:alert(1)) [x](file:///etc/passwd) [y](data:text/html,hi)")
    assert "<a " not in unsafe and "[x](file:///etc/passwd)" in unsafe


def test_newlines_stay_line_breaks_and_blank_lines_paragraphs() -> None:
    out = html("roses are red\nviolets are blue\n\nsecond")
    assert "roses are red<br>violets are blue</p>" in out and out.count("<p ") == 2


def test_quotes_and_rules() -> None:
    out = html("> quoted\n> on\n\n---\n\nafter")
    assert f"color:{colors.to_hex(LIGHT.quote)}\">quoted<br>on</p>" in out
    assert "<hr>" in out


def test_placeholder_characters_in_the_text_cannot_inject() -> None:
    out = html("\ue0000\ue001 `x`")
    assert out.count("<code") == 1 and "\ue000" not in out


def test_code_colours_are_readable_in_light_and_dark() -> None:
    for palette in (colors.LIGHT, DARK_PALETTE):
        chat = colors.chat_colors(palette)
        theme = md.markdown_colors(chat)
        assert colors.contrast_ratio(theme.code_text, theme.code_background) >= colors.TEXT_CONTRAST
        assert colors.contrast_ratio(theme.link, chat.answer_bubble) >= colors.TEXT_CONTRAST
        assert theme.code_background != chat.answer_bubble
    dark = md.markdown_colors(colors.chat_colors(DARK_PALETTE))
    assert colors.is_dark(dark.code_background)  # no bright patch in a dark theme
