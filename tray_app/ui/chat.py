"""The chat window: a client of the service's own OpenAI-compatible port.

It streams with QNetworkAccessManager (readyRead -> SSE lines), so the GUI
never waits; it sends its own X-Request-Id, so Stop (and the degraded
banner's Cancel) can cancel exactly its own request with
DELETE /v1/requests/{id}.
"""

from __future__ import annotations

import html
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QByteArray, QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QKeyEvent, QKeySequence, QShortcut, QTextCursor, QTextDocument
from PySide6.QtNetwork import QNetworkReply, QNetworkRequest
from PySide6.QtWidgets import (
    QComboBox, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QTextBrowser, QVBoxLayout, QWidget,
)

from . import colors
from . import theme
from . import viewmodel as vm
from .client import ServiceClient
from .icons import state_icon
from .widgets import DegradedBanner, set_text
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

STOP_GRACE_MS = 3000


class ChatStream(QObject):
    """One streaming chat completion. Emits what arrives, never blocks."""

    routed = Signal(object)      # the response headers that matter (served by, reason, ...)
    delta = Signal(str)          # text as it arrives
    finished = Signal(str)       # finish reason ("stop", "length", ...) or "" if none was sent
    failed = Signal(str, str)    # (message, code)

    def __init__(self, client: ServiceClient, messages: list[dict[str, Any]], *, request_id: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None,
                 client_name: str = "tray-app chat", model: str | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.model = model  # None: the service's default model
        self.temperature = temperature
        self.client_name = client_name
        self.request_id = request_id or f"chat-{uuid.uuid4().hex[:16]}"
        self.messages = messages
        self.max_tokens = max_tokens
        self.reply: QNetworkReply | None = None
        self.parser = vm.SseParser()
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.text: list[str] = []
        self.finish_reason = ""
        self.done = False
        self.stopping = False
        self._body = b""

    def start(self) -> None:
        request = self.client.request("/v1/chat/completions", timeout_ms=0)
        request.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
        request.setRawHeader(b"Accept", b"text/event-stream")
        request.setRawHeader(b"X-Request-Id", self.request_id.encode())
        request.setRawHeader(b"X-Client-Name", self.client_name.encode())
        body: dict[str, Any] = {"messages": self.messages, "stream": True}
        if self.model:
            body["model"] = self.model
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        reply = self.client.nam.post(request, QByteArray(json.dumps(body).encode()))
        self.reply = reply
        reply.metaDataChanged.connect(self._on_headers)
        reply.readyRead.connect(self._on_ready_read)
        reply.finished.connect(self._on_finished)

    def stop(self) -> None:
        """Cancel through the service; abort the connection if that fails."""
        if self.done or self.stopping:
            return
        self.stopping = True

        def cancelled(ok: bool, code: int, data: Any, message: str) -> None:
            if not ok:  # not known to the service (yet, or any more): drop the connection
                self.abort()

        self.client.cancel(self.request_id, cancelled)
        QTimer.singleShot(STOP_GRACE_MS, self, self.abort)

    def abort(self) -> None:
        if not self.done and self.reply is not None:
            self.reply.abort()

    def _on_headers(self) -> None:
        reply = self.reply
        if reply is None or self.status_code:
            return
        self.status_code = int(reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute) or 0)
        if not self.status_code:
            return
        self.headers = {bytes(k.data()).decode("latin-1").lower(): bytes(v.data()).decode("latin-1")
                        for k, v in reply.rawHeaderPairs()}
        if self.status_code == 200:
            self.routed.emit(self.route())

    def route(self) -> dict[str, str | None]:
        h = self.headers
        return {"served_by": h.get("x-served-by"), "reason": h.get("x-route-reason"),
                "fallback_model": h.get("x-fallback-model"), "estimated_latency": h.get("x-estimated-latency"),
                "request_id": h.get("x-request-id")}

    def _on_ready_read(self) -> None:
        reply = self.reply
        if reply is None:
            return
        if not self.status_code:
            self._on_headers()
        data = bytes(reply.readAll().data()) if reply.isOpen() else b""
        if self.status_code != 200:
            self._body += data
            return
        for event in self.parser.feed(data):
            self._handle(event)

    def _handle(self, event: Any) -> None:
        if self.done:
            return
        if event == vm.DONE:
            self._finish(self.finish_reason)
            return
        if isinstance(event, dict) and "error" in event:
            message, code = vm.error_message(event)
            self._fail(message, code)
            return
        if isinstance(event, dict):
            text = vm.delta_text(event)
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            if text:
                self.text.append(text)
                self.delta.emit(text)

    def _on_finished(self) -> None:
        reply = self.reply
        if reply is None:
            return
        self._on_ready_read()
        if self.status_code == 200:
            for event in self.parser.close():
                self._handle(event)
        if self.done:
            return  # handled (and the reply released) by the event that ended it
        self.reply = None
        reply.deleteLater()
        if self.status_code and self.status_code != 200:
            message, code = vm.error_message(self._body, self.status_code)
            self._fail(message, code)
        elif reply.error() == QNetworkReply.NetworkError.OperationCanceledError:
            self._fail("stopped", "request_canceled")
        elif reply.error() != QNetworkReply.NetworkError.NoError:
            self._fail(f"the connection to the service failed: {reply.errorString()}", "network_error")
        else:
            self._fail("the answer ended without [DONE]; it may be incomplete", "incomplete")

    def _finish(self, reason: str) -> None:
        self.done = True
        self._release_reply()
        self.finished.emit(reason)

    def _fail(self, message: str, code: str) -> None:
        self.done = True
        self._release_reply()
        self.failed.emit(message, code)

    def _release_reply(self) -> None:
        """The reply outlives this object if the stream ended before the
        connection did: let it delete itself when it is through."""
        reply = self.reply
        if reply is None:
            return
        self.reply = None
        if reply.isFinished():
            reply.deleteLater()
        else:
            reply.finished.connect(reply.deleteLater)


@dataclass
class Turn:
    role: str            # user | assistant
    text: str = ""
    meta: str = ""
    error: str = ""
    pending: bool = False
    route: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class _InputBox(QPlainTextEdit):
    """Enter sends; Shift+Enter starts a new line."""

    submit = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt name
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submit.emit()
            return
        super().keyPressEvent(event)


class ChatWindow(QWidget):
    """Keeps the conversation for the session; sends all of it each turn."""

    answer_finished = Signal(str)   # "ok", "stopped" or "failed"

    def __init__(self, client: ServiceClient, *, max_tokens: int | None = None, temperature: float | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.max_tokens = max_tokens
        # None: the server's default sampling.
        self.temperature = temperature
        self.turns: list[Turn] = []
        self.history: list[dict[str, str]] = []
        self.stream: ChatStream | None = None
        self._answer = Turn("assistant")
        self._render_pending = False
        # Streaming appends to the document in place (a transcript-wide setHtml
        # per chunk grows with the conversation and drops the user's
        # selection); the whole transcript is drawn again only when more than
        # the answer's text changed.
        self._needs_full_render = True
        self._answer_end: QTextCursor | None = None  # where the next fragment goes, while streaming
        self._answer_chars_shown = 0                 # how much of the answer's text the document has
        self.setWindowTitle("tray-app: chat")
        self.setWindowIcon(state_icon(vm.GPU))
        self.resize(640, 620)

        root = QVBoxLayout(self)
        root.setContentsMargins(12, 12, 12, 12)
        root.setSpacing(8)
        self.banner = DegradedBanner()
        self.banner.show_empty_note = False
        self.banner.cancel_requested.connect(self.cancel_request)
        root.addWidget(self.banner)

        self.transcript = QTextBrowser()
        self.transcript.setOpenExternalLinks(False)
        self.transcript.setOpenLinks(False)
        self.transcript.document().setDocumentMargin(10)
        # Follow the answer as it grows, unless the user scrolls up to read.
        self._follow = True
        self.transcript.verticalScrollBar().actionTriggered.connect(self._user_scrolled)
        root.addWidget(self.transcript, 1)

        self.input = _InputBox()
        self.input.setPlaceholderText("Ask something. Enter or Ctrl+Enter sends, Shift+Enter adds a line, "
                                      "Esc stops an answer.")
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 3 + 16)
        self.input.submit.connect(self.send)
        root.addWidget(self.input)

        row = QHBoxLayout()
        # Which library model answers; shown once the service has more than one.
        self.model_picker = QComboBox()
        self.model_picker.setToolTip("The model that answers the next message")
        # As wide as a short name: an 80-character GGUF name would widen the
        # window; the list that drops down shows the names whole.
        self.model_picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_picker.setMinimumContentsLength(24)
        self.model_picker.currentTextChanged.connect(self.model_picker.setToolTip)
        self.model_label = QLabel("&Model:")
        self.model_label.setBuddy(self.model_picker)
        for widget in (self.model_label, self.model_picker):
            widget.setVisible(False)
            row.addWidget(widget)
        self.state_label = QLabel()
        theme.set_muted_text(self.state_label)
        row.addWidget(self.state_label, 1)
        self.clear_button = QPushButton("&New chat")
        self.clear_button.clicked.connect(self.clear)
        self.stop_button = QPushButton("Sto&p")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        self.send_button = QPushButton("&Send")
        self.send_button.setToolTip("Send (Enter or Ctrl+Enter)")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        for button in (self.clear_button, self.stop_button, self.send_button):
            button.setMinimumWidth(84)
            row.addWidget(button)
        root.addLayout(row)

        # Ctrl+Enter sends from anywhere in the window (the transcript, a
        # button), not only from the input box; Esc stops a running answer.
        self.shortcuts: list[QShortcut] = []
        for keys, slot in ((QKeySequence("Ctrl+Return"), self._send_from_shortcut),
                           (QKeySequence("Ctrl+Enter"), self._send_from_shortcut),
                           (QKeySequence(Qt.Key.Key_Escape), self._on_escape)):
            shortcut = QShortcut(keys, self)
            shortcut.activated.connect(slot)
            self.shortcuts.append(shortcut)

        client.status_changed.connect(self._on_status)
        self._set_state(f"Talking to {client.api_url}")
        self._render()

    # ----- actions -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.stream is not None

    def send(self, text: str | None = None) -> bool:
        text = (text if isinstance(text, str) else self.input.toPlainText()).strip()
        if not text or self.busy:
            return False
        self.input.clear()
        self._follow = True
        self.history.append({"role": "user", "content": text})
        self.turns.append(Turn("user", text))
        answer = Turn("assistant", pending=True, meta="waiting for the service…")
        self.turns.append(answer)
        self._answer = answer
        stream = ChatStream(self.client, list(self.history), max_tokens=self.max_tokens,
                            temperature=self.temperature, model=self.chosen_model(), parent=self)
        self.stream = stream
        # Bound methods, not lambdas holding the stream: a closure that keeps a
        # deleted QObject's wrapper alive upsets PySide at exit.
        stream.routed.connect(self._on_routed)
        stream.delta.connect(self._on_delta)
        stream.finished.connect(self._on_finished)
        stream.failed.connect(self._on_failed)
        stream.start()
        self._update_banner(self.client.last_status)
        self.stop_button.setEnabled(True)
        self.send_button.setEnabled(False)
        self._set_state("Sent; waiting for the first token…")
        self._render()
        return True

    def _send_from_shortcut(self) -> None:
        self.send()

    def _on_escape(self) -> None:
        # Only a running answer: an idle Esc must not hide or clear anything.
        if self.busy:
            self.stop()

    def stop(self) -> None:
        if self.stream is not None:
            self._set_state("Stopping…")
            self.stream.stop()

    def cancel_request(self, request_id: str) -> None:
        """A banner row's Cancel: exactly the request of that row."""
        if request_id == self.request_id:
            self.stop()
            return

        def done(ok: bool, code: int, data: Any, message: str) -> None:
            if not ok:
                self.banner.cancel_failed(request_id)
                self._set_state(f"Cancel failed: {message}")

        self.client.cancel(request_id, done)

    def clear(self) -> None:
        if self.busy:
            self.stop()
            return
        self.turns.clear()
        self.history.clear()
        self.banner.set_banner(None)
        self._render(keep_selection=False)

    @property
    def request_id(self) -> str | None:
        return self.stream.request_id if self.stream is not None else None

    # ----- stream events -----------------------------------------------------------------

    def _on_routed(self, route: dict) -> None:
        answer = self._answer
        answer.route = route
        answer.meta = self._route_line(answer)
        self._set_state(f"Generating on the {str(route.get('served_by') or '?').upper()}…")
        self._needs_full_render = True
        self._schedule_render()

    def _on_delta(self, text: str) -> None:
        self._answer.text += text
        self._schedule_render()

    @staticmethod
    def _route_line(answer: Turn, progress: str = "", took_s: float | None = None) -> str:
        route = answer.route
        return vm.route_line(route.get("served_by"), route.get("reason"), route.get("fallback_model"),
                             progress=progress, took_s=took_s)

    def _took(self, answer: Turn) -> float:
        return time.monotonic() - answer.started

    def _on_finished(self, reason: str) -> None:
        stream, answer = self.stream, self._answer
        if stream is None:
            return
        answer.pending = False
        answer.meta = self._route_line(answer, took_s=self._took(answer))
        if reason == "length":
            answer.meta += " · stopped at max_tokens"
        self.history.append({"role": "assistant", "content": answer.text})
        self._end(stream, "ok", "Ready")

    def _on_failed(self, message: str, code: str) -> None:
        stream, answer = self.stream, self._answer
        if stream is None:
            return
        route = answer.route
        answer.pending = False
        stopped = code == "request_canceled" or stream.stopping
        if route:
            answer.meta = self._route_line(answer, took_s=self._took(answer))
        else:
            answer.meta = ""
        if stopped:
            answer.error = "Stopped."
        else:
            answer.error = message
        if answer.text:
            # Keep what was said: the next turn builds on what the user saw.
            self.history.append({"role": "assistant", "content": answer.text})
        else:
            # Nothing came back: forget the question, so a retry isn't a double.
            if self.history and self.history[-1]["role"] == "user":
                self.history.pop()
        self._end(stream, "stopped" if stopped else "failed", "Stopped" if stopped else "The last request failed")

    def _end(self, stream: ChatStream, outcome: str, state: str) -> None:
        self.stream = None
        for signal in (stream.routed, stream.delta, stream.finished, stream.failed):
            signal.disconnect()
        stream.deleteLater()
        self.stop_button.setEnabled(False)
        self.send_button.setEnabled(True)
        self._set_state(state)
        self._update_banner(self.client.last_status)
        self._render()
        self.answer_finished.emit(outcome)

    def chosen_model(self) -> str | None:
        """The picked model's name; None (the default model) while there is no choice."""
        return self.model_picker.currentText() or None if self.model_picker.count() > 1 else None

    def _update_models(self, status: dict) -> None:
        names = vm.model_names(status)
        current = [self.model_picker.itemText(i) for i in range(self.model_picker.count())]
        if names and names != current:
            chosen = self.model_picker.currentText()
            self.model_picker.blockSignals(True)
            self.model_picker.clear()
            self.model_picker.addItems(names)
            if chosen in names:
                self.model_picker.setCurrentText(chosen)
            self.model_picker.blockSignals(False)
        for widget in (self.model_label, self.model_picker):
            widget.setVisible(len(names) > 1)

    def _on_status(self, status: dict) -> None:
        self._update_models(status)
        self._update_banner(status)
        if self.stream is None:
            return
        own = next((r for r in status.get("requests") or () if r.get("id") == self.stream.request_id), None)
        answer = self._answer
        if own is not None and answer.pending and answer.route:
            # The estimate was made at admission; what is left of it changes every poll.
            meta = self._route_line(answer, progress=vm.time_left_text(own))
            if meta != answer.meta:
                answer.meta = meta
                self._needs_full_render = True
                self._schedule_render()
        if not self.stream.status_code:
            if own is not None and own.get("state") == "queued":
                lane = str(own.get("path") or "").upper()
                self._set_state(f"Waiting in the {lane} queue, {vm._ordinal(own.get('queue_position') or 1)} in line…")

    def _update_banner(self, status: dict | None) -> None:
        self.banner.set_banner(vm.degraded_banner(status, own_request_id=self.request_id, only_own=True)
                               if status else None)

    # ----- rendering ---------------------------------------------------------------------

    def _set_state(self, text: str) -> None:
        set_text(self.state_label, text)

    def _schedule_render(self) -> None:
        # Tokens can come faster than a repaint is worth: draw at most every 50 ms.
        if not self._render_pending:
            self._render_pending = True
            QTimer.singleShot(50, self, self._show_changes)

    def _user_scrolled(self, _action: int) -> None:
        bar = self.transcript.verticalScrollBar()
        QTimer.singleShot(0, self, lambda: setattr(self, "_follow", bar.value() >= bar.maximum() - 4))

    def _show_changes(self) -> None:
        self._render_pending = False
        if self._needs_full_render or not self._append_answer_text():
            self._render()

    def _append_answer_text(self) -> bool:
        """Insert only the answer's new text; False if the document has no
        place for it (the answer's first text replaces the '…' placeholder)."""
        cursor = self._answer_end
        if cursor is None:
            return False
        fragment = self._answer.text[self._answer_chars_shown:]
        if fragment:
            # A line separator, as <br> renders: a newline would start a new block.
            cursor.insertText(fragment.replace("\n", "\u2028"))
            self._answer_chars_shown = len(self._answer.text)
            if self._follow:
                bar = self.transcript.verticalScrollBar()
                bar.setValue(bar.maximum())
        return True

    def _render(self, *, keep_selection: bool = True) -> None:
        self._render_pending = False
        self._needs_full_render = False
        bar = self.transcript.verticalScrollBar()
        keep = bar.value()
        # Earlier turns render the same each time, so a selection in them
        # keeps its positions across a redraw (a route line update, a new turn).
        selected = self.transcript.textCursor()
        selection = (selected.anchor(), selected.position()) if keep_selection and selected.hasSelection() else None
        self.transcript.setHtml(render_html(self.turns, colors.chat_colors(theme.current_palette())))
        document = self.transcript.document()
        self._answer_end = self._find_answer_end() if self.turns and self.turns[-1] is self._answer else None
        self._answer_chars_shown = len(self._answer.text)
        if selection is not None and max(selection) < document.characterCount():
            restored = QTextCursor(document)
            restored.setPosition(selection[0])
            restored.setPosition(selection[1], QTextCursor.MoveMode.KeepAnchor)
            self.transcript.setTextCursor(restored)
        if self._follow:
            if selection is None:
                self.transcript.moveCursor(QTextCursor.MoveOperation.End)
            bar.setValue(bar.maximum())
        else:
            bar.setValue(keep)

    def _find_answer_end(self) -> QTextCursor | None:
        """A cursor just before the streaming answer's end mark; None when
        the answer has no text to follow yet."""
        answer = self._answer
        if not (answer.pending and answer.text):
            return None
        document = self.transcript.document()
        mark = document.find(ANSWER_END_MARK, document.characterCount(), QTextDocument.FindFlag.FindBackward)
        if mark.isNull():
            return None
        cursor = QTextCursor(document)
        # Typing here takes the format of the character before: the answer's text, not the mark's.
        cursor.setPosition(mark.selectionStart())
        return cursor

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        if self._follow:
            bar = self.transcript.verticalScrollBar()
            QTimer.singleShot(0, self, lambda: bar.setValue(bar.maximum()))

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.WindowActivate:
            self.input.setFocus()
        return super().event(event)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt name
        super().changeEvent(event)
        # The transcript's colours are in its HTML: draw it again in the new palette.
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "shortcuts"):  # not while still being built
            self.banner.apply_colors()
            theme.recolor_muted(self)
            self._render()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        # Closing only hides: the conversation stays for the session.
        event.ignore()
        self.hide()


# Ends a streaming answer's text; new text goes in just before it.
ANSWER_END_MARK = "\u25ae"


def render_html(turns: list[Turn], palette: colors.ChatColors | None = None) -> str:
    """The transcript as HTML, in `palette` (by default the light theme's)."""
    c = palette or colors.chat_colors(colors.LIGHT)
    css = theme.css
    if not turns:
        return (f'<p style="color:{css(c.placeholder)}; margin-top:40px" align="center">'
                'Chat with the model behind this service.<br>Answers say which path served them and why.</p>')
    parts = []
    for turn in turns:
        if turn.role == "user":
            parts.append(
                '<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:10px"><tr>'
                '<td width="18%"></td>'
                f'<td bgcolor="{css(c.user_bubble)}" style="padding:8px 10px; color:{css(c.user_text)}">'
                f'{_text_html(turn.text)}</td></tr></table>')
        else:
            body = _text_html(turn.text) if turn.text else ""
            if turn.pending:
                body += f'<span style="color:{css(c.meta_text)}">{ANSWER_END_MARK}</span>' if turn.text else \
                    f'<span style="color:{css(c.meta_text)}"><i>…</i></span>'
            if turn.error:
                body += (('<br>' if body else '')
                         + f'<span style="color:{css(c.error_text)}"><b>{html.escape(turn.error)}</b></span>')
            meta = (f'<div style="color:{css(c.meta_text)}; font-size:small; margin-top:4px">'
                    f'{html.escape(turn.meta)}</div>' if turn.meta else "")
            parts.append(
                '<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:10px"><tr>'
                f'<td bgcolor="{css(c.answer_bubble)}" style="padding:8px 10px; color:{css(c.answer_text)}">'
                f'{body}{meta}</td><td width="12%"></td></tr></table>')
    return "".join(parts)


def _text_html(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")
