"""The chat's transcript: the turns of a conversation and how they are drawn.

`render_html` draws the whole conversation (a finished answer as Markdown, a
question's images as thumbnails); `ChatTranscript` is the text browser that
shows it, appends a streaming answer's text in place, rewrites its route
line each poll, follows the end unless the user scrolled up, and copies a
message or a code block from its context menu.
"""

from __future__ import annotations

import functools
import html
import time
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices, QImage, QKeySequence, QTextCursor, QTextDocument, QTextFrame
from PySide6.QtWidgets import QApplication, QMenu, QTextBrowser, QWidget

from . import colors
from . import markdown
from . import theme
from .conversations import image_bytes, user_content

# Ends a streaming answer's text; new text goes in just before it.
ANSWER_END_MARK = "\u25ae"
# Starts a streaming answer's route line (a word joiner: not seen), so that
# each poll's "about 12 s left" replaces the line alone.
ANSWER_META_MARK = "\u2060"

THUMBNAIL_PX = 96


@dataclass
class Turn:
    role: str            # user | assistant
    text: str = ""
    meta: str = ""
    error: str = ""
    pending: bool = False
    route: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    images: list[str] = field(default_factory=list)  # a question's attached images, as data: URIs

    def record(self) -> dict[str, Any]:
        """What a saved conversation keeps of it."""
        record: dict[str, Any] = {"role": self.role, "text": self.text, "meta": self.meta, "error": self.error}
        return {**record, "images": list(self.images)} if self.images else record

    @property
    def question(self) -> dict[str, Any]:
        """A question turn as the message that asks it."""
        return {"role": "user", "content": user_content(self.text, self.images)}


class ChatTranscript(QTextBrowser):
    """The conversation's turns, drawn. Streaming appends to the document in
    place (a transcript-wide setHtml per chunk grows with the conversation
    and drops the user's selection); the whole transcript is drawn again only
    when more than the answer's text changed. A finished answer is drawn as
    Markdown."""

    copied = Signal(str)  # what was copied ("the message", ...), for the state line

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.turns: list[Turn] = []
        self.answer = Turn("assistant")  # the latest answer (streaming while it is pending)
        self.render_pending = False
        self.needs_full_render = True
        self._answer_end: QTextCursor | None = None  # where the next fragment goes, while streaming
        self._answer_chars_shown = 0                 # how much of the answer's text the document has
        self.setOpenExternalLinks(False)
        self.setOpenLinks(False)
        self.anchorClicked.connect(self._open_link)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._show_context_menu)
        self.document().setDocumentMargin(10)
        # Follow the answer as it grows, unless the user scrolls up to read.
        self.follow = True
        self.verticalScrollBar().actionTriggered.connect(self._user_scrolled)
        self.copy_last_action = QAction("Copy las&t answer", self)
        self.copy_last_action.setShortcut(QKeySequence("Ctrl+Shift+C"))
        self.copy_last_action.setToolTip("Copy the last answer's text, as Markdown (Ctrl+Shift+C)")
        self.copy_last_action.triggered.connect(self.copy_last_answer)

    # ----- drawing -------------------------------------------------------------------------

    def schedule_render(self) -> None:
        # Tokens can come faster than a repaint is worth: draw at most every 50 ms.
        if not self.render_pending:
            self.render_pending = True
            QTimer.singleShot(50, self, self._show_changes)

    def _user_scrolled(self, _action: int) -> None:
        bar = self.verticalScrollBar()
        QTimer.singleShot(0, self, lambda: setattr(self, "follow", bar.value() >= bar.maximum() - 4))

    def _show_changes(self) -> None:
        self.render_pending = False
        if self.needs_full_render or not self._append_answer_text():
            self.render()

    def _append_answer_text(self) -> bool:
        """Insert only the answer's new text; False if the document has no
        place for it (the answer's first text replaces the '…' placeholder)."""
        cursor = self._answer_end
        if cursor is None:
            return False
        fragment = self.answer.text[self._answer_chars_shown:]
        if fragment:
            # A line separator, as <br> renders: a newline would start a new block.
            cursor.insertText(fragment.replace("\n", "\u2028"))
            self._answer_chars_shown = len(self.answer.text)
            if self.follow:
                bar = self.verticalScrollBar()
                bar.setValue(bar.maximum())
        return True

    def render(self, *, keep_selection: bool = True) -> None:
        self.render_pending = False
        self.needs_full_render = False
        bar = self.verticalScrollBar()
        keep = bar.value()
        # Earlier turns render the same each time, so a selection in them
        # keeps its positions across a redraw (a route line update, a new turn).
        selected = self.textCursor()
        selection = (selected.anchor(), selected.position()) if keep_selection and selected.hasSelection() else None
        document = self.document()
        for index, turn in enumerate(self.turns):
            for number, uri in enumerate(turn.images):
                document.addResource(QTextDocument.ResourceType.ImageResource, QUrl(image_name(index, number)),
                                     QImage.fromData(image_bytes(uri)))
        self.setHtml(render_html(self.turns, colors.chat_colors(theme.current_palette())))
        document = self.document()
        self._answer_end = self._find_answer_end() if self.turns and self.turns[-1] is self.answer else None
        self._answer_chars_shown = len(self.answer.text)
        if selection is not None and max(selection) < document.characterCount():
            restored = QTextCursor(document)
            restored.setPosition(selection[0])
            restored.setPosition(selection[1], QTextCursor.MoveMode.KeepAnchor)
            self.setTextCursor(restored)
        if self.follow:
            if selection is None:
                self.moveCursor(QTextCursor.MoveOperation.End)
            bar.setValue(bar.maximum())
        else:
            bar.setValue(keep)

    def replace_answer_meta(self, meta: str) -> bool:
        """Put `meta` in place of the streaming answer's route line; False if
        the document has no such line (drawn before the answer was routed)."""
        answer = self.answer
        if not (answer.pending and self.turns and self.turns[-1] is answer):
            return False
        cursor = self._cursor_at_last(ANSWER_META_MARK, after=True)
        if cursor is None:
            return False
        cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock, QTextCursor.MoveMode.KeepAnchor)
        # The new text takes the format of the mark before it: the route line's.
        cursor.insertText(meta)
        return True

    def _find_answer_end(self) -> QTextCursor | None:
        """A cursor just before the streaming answer's end mark; None when
        the answer has no text to follow yet."""
        answer = self.answer
        if not (answer.pending and answer.text):
            return None
        # Typing here takes the format of the character before: the answer's text, not the mark's.
        return self._cursor_at_last(ANSWER_END_MARK, after=False)

    def _cursor_at_last(self, mark: str, *, after: bool) -> QTextCursor | None:
        """A cursor just before (or after) the document's last `mark`; None without one."""
        document = self.document()
        found = document.find(mark, document.characterCount(), QTextDocument.FindFlag.FindBackward)
        if found.isNull():
            return None
        cursor = QTextCursor(document)
        cursor.setPosition(found.selectionEnd() if after else found.selectionStart())
        return cursor

    def keep_end_in_view(self) -> None:
        """After the window's size changed: the end stays in view while following."""
        if self.follow:
            bar = self.verticalScrollBar()
            QTimer.singleShot(0, self, lambda: bar.setValue(bar.maximum()))

    # ----- copying -------------------------------------------------------------------------

    def _copy(self, text: str, what: str) -> None:
        QApplication.clipboard().setText(text)
        self.copied.emit(what)

    def copy_message(self, index: int) -> None:
        """A message's text as written: an answer's Markdown source, not what it renders to."""
        self._copy(self.turns[index].text, "the message")

    def copy_code_block(self, index: int, block: int) -> None:
        self._copy(markdown.code_blocks(self.turns[index].text)[block], "the code block")

    def last_answer(self) -> Turn | None:
        return next((t for t in reversed(self.turns) if t.role == "assistant" and t.text), None)

    def copy_last_answer(self) -> None:
        answer = self.last_answer()
        if answer is not None:
            self._copy(answer.text, "the last answer")

    def message_at(self, pos: QPoint) -> tuple[int, int | None] | None:
        """(the turn, the code block in it or None) at `pos` in the viewport.

        Each turn is one top-level table of the document, and each code block
        of a drawn answer one table inside it, in markdown.code_blocks' order."""
        cursor = self.cursorForPosition(pos)
        chain: list[QTextFrame] = []
        frame = cursor.currentFrame()
        while frame is not None and frame.parentFrame() is not None:
            chain.append(frame)
            frame = frame.parentFrame()
        if not chain or frame is None:
            return None  # on the empty transcript's note
        top = chain[-1]
        index = [f.firstPosition() for f in frame.childFrames()].index(top.firstPosition())
        if index >= len(self.turns):
            return None
        block = None
        if len(chain) > 1:
            block = [f.firstPosition() for f in top.childFrames()].index(chain[-2].firstPosition())
            if block >= len(markdown.code_blocks(self.turns[index].text)):
                block = None
        return index, block

    def context_menu(self, pos: QPoint) -> QMenu:
        """The menu at `pos` (viewport coordinates): the text browser's own
        (copy the selection, a link), then copying a message."""
        offset = QPoint(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        menu = self.createStandardContextMenu(pos + offset)
        menu.setToolTipsVisible(True)
        menu.addSeparator()
        found = self.message_at(pos)
        if found is not None:
            index, block = found
            copy = menu.addAction("Copy &message")
            copy.setToolTip("Copy this message's whole text (an answer as Markdown)")
            copy.triggered.connect(lambda: self.copy_message(index))
            if block is not None:
                code = menu.addAction("Copy &code block")
                code.setToolTip("Copy the code in this block, without the fences")
                code.triggered.connect(lambda: self.copy_code_block(index, block))
        menu.addAction(self.copy_last_action)
        return menu

    def _show_context_menu(self, pos: QPoint) -> None:
        menu = self.context_menu(pos)
        menu.exec(self.viewport().mapToGlobal(pos))
        menu.deleteLater()

    def _open_link(self, url: QUrl) -> None:
        # markdown.py links only these; a check here too, as the page is the model's words.
        if url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)


def image_name(turn: int, number: int) -> str:
    """The transcript's name for a question's attached image."""
    return f"chat-image:{turn}-{number}"


def render_html(turns: list[Turn], palette: colors.ChatColors | None = None) -> str:
    """The transcript as HTML, in `palette` (by default the light theme's)."""
    c = palette or colors.chat_colors(colors.LIGHT)
    md = markdown.markdown_colors(c)
    css = theme.css
    if not turns:
        return (f'<p style="color:{css(c.placeholder)}; margin-top:40px" align="center">'
                'Chat with the model behind this service.<br>Answers say which path served them and why.<br>'
                'Right-click a message to copy it, or the code block under the pointer.</p>')
    parts = []
    for index, turn in enumerate(turns):
        if turn.role == "user":
            # The images as thumbnails, from the resources ChatTranscript.render adds under these names.
            images = "".join(f'<img src="{image_name(index, number)}" height="{THUMBNAIL_PX}"> '
                             for number in range(len(turn.images)))
            parts.append(
                '<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:10px"><tr>'
                '<td width="18%"></td>'
                f'<td bgcolor="{css(c.user_bubble)}" style="padding:8px 10px; color:{css(c.user_text)}">'
                f'{images + "<br>" if images and turn.text else images}{_text_html(turn.text)}</td></tr></table>')
        else:
            if turn.pending:
                # Streamed as plain text, appended in place; drawn as Markdown once finished.
                body = _text_html(turn.text)
                body += f'<span style="color:{css(c.meta_text)}">{ANSWER_END_MARK}</span>' if turn.text else \
                    f'<span style="color:{css(c.meta_text)}"><i>…</i></span>'
            else:
                body = answer_html(turn.text, md)
            if turn.error:
                body += (f'<p style="margin-top:{"6px" if body else "0"}; margin-bottom:0; color:{css(c.error_text)}">'
                         f'<b>{html.escape(turn.error)}</b></p>')
            mark = ANSWER_META_MARK if turn.pending else ""
            meta = (f'<div style="color:{css(c.meta_text)}; font-size:small; margin-top:4px">'
                    f'{mark}{html.escape(turn.meta)}</div>' if turn.meta else "")
            parts.append(
                '<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:10px"><tr>'
                f'<td bgcolor="{css(c.answer_bubble)}" style="padding:8px 10px; color:{css(c.answer_text)}">'
                f'{body}{meta}</td><td width="12%"></td></tr></table>')
    return "".join(parts)


@functools.lru_cache(maxsize=256)
def answer_html(text: str, palette: markdown.MarkdownColors) -> str:
    """A finished answer drawn as Markdown, once: the transcript is drawn
    again for every new turn, route line and theme change, and an answer's
    text doesn't change once it is finished. Keyed by the text itself, so an
    edited or reopened answer is drawn afresh; 256 answers of a long session
    stay drawn."""
    return markdown.to_html(text, palette)


def _text_html(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")
