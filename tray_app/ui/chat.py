"""The chat window: a client of the service's own OpenAI-compatible port.

It streams with QNetworkAccessManager (readyRead -> SSE lines), so the GUI
never waits; it sends its own X-Request-Id, so Stop (and the degraded
banner's Cancel) can cancel exactly its own request with
DELETE /v1/requests/{id}.
"""

from __future__ import annotations

import functools
import html
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QBuffer, QByteArray, QEvent, QIODevice, QMimeData, QObject, QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QAction, QCloseEvent, QDesktopServices, QImage, QKeyEvent, QKeySequence, QShortcut, QTextCursor, QTextDocument,
    QTextFrame,
)
from PySide6.QtNetwork import QNetworkReply, QNetworkRequest
from PySide6.QtWidgets import (
    QApplication, QComboBox, QFileDialog, QHBoxLayout, QLabel, QMenu, QMessageBox, QPlainTextEdit, QPushButton,
    QTextBrowser, QToolButton, QVBoxLayout, QWidget,
)

from . import colors
from . import markdown
from . import theme
from . import viewmodel as vm
from .client import ServiceClient
from .conversations import Conversation, ConversationStore, image_bytes, image_data_uri, user_content
from .icons import state_icon
from .widgets import DegradedBanner, plain_label, as_written, set_text
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

STOP_GRACE_MS = 3000

log = logging.getLogger(__name__)


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
        # For the answer's speed: the server's token count when it sends one
        # (stream_options.include_usage), else the chunks that carried text.
        self.completion_tokens: int | None = None
        self.chunks = 0
        self.first_token_at: float | None = None
        self.ended_at: float | None = None

    def start(self) -> None:
        request = self.client.request("/v1/chat/completions", timeout_ms=0)
        request.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
        request.setRawHeader(b"Accept", b"text/event-stream")
        request.setRawHeader(b"X-Request-Id", self.request_id.encode())
        request.setRawHeader(b"X-Client-Name", self.client_name.encode())
        body: dict[str, Any] = {"messages": self.messages, "stream": True,
                                "stream_options": {"include_usage": True}}
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
                "request_id": h.get("x-request-id"), "peer": h.get("x-peer")}

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
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if text:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.chunks += 1
                self.text.append(text)
                self.delta.emit(text)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def speed_text(self) -> str:
        """'42 tok/s', or "" before two tokens came."""
        return speed_text(self.tokens, self.first_token_at, self.ended_at or time.monotonic())

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
        self.ended_at = time.monotonic()
        self._release_reply()
        self.finished.emit(reason)

    def _fail(self, message: str, code: str) -> None:
        self.done = True
        self.ended_at = time.monotonic()
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


def tokens_per_second(tokens: int, first: float | None, end: float) -> float | None:
    """Decoding speed: the tokens after the first over the time since it came
    (the wait for the first token is the queue and the prompt, not decoding)."""
    if first is None or tokens < 2 or end <= first:
        return None
    return (tokens - 1) / (end - first)


def speed_text(tokens: int, first: float | None, end: float) -> str:
    rate = tokens_per_second(tokens, first, end)
    if rate is None:
        return ""
    # Whole numbers from 10 up; one decimal below, where it still tells apart.
    return f"{rate:.0f} tok/s" if rate >= 9.95 else f"{rate:.1f} tok/s"


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


def png_bytes(image: QImage) -> bytes:
    """A pasted image, encoded as PNG to send."""
    buffer = QBuffer()
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(buffer.data())


class _InputBox(QPlainTextEdit):
    """Enter sends; Shift+Enter starts a new line. A pasted image is attached, not typed."""

    submit = Signal()
    image_pasted = Signal(QImage)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # noqa: N802 - Qt name
        return source.hasImage() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # noqa: N802 - Qt name
        if source.hasImage():
            self.image_pasted.emit(QImage(source.imageData()))
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt name
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submit.emit()
            return
        super().keyPressEvent(event)


class ChatWindow(QWidget):
    """Keeps the conversation; sends all of it each turn. With a
    `conversations_dir`, each conversation is saved there after every answer
    and can be opened again; without one it lasts for the session."""

    answer_finished = Signal(str)   # "ok", "stopped" or "failed"

    def __init__(self, client: ServiceClient, *, max_tokens: int | None = None, temperature: float | None = None,
                 conversations_dir: Path | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.max_tokens = max_tokens
        # None: the server's default sampling.
        self.temperature = temperature
        self.turns: list[Turn] = []
        self.history: list[dict[str, Any]] = []
        # Images attached to the next question (data: URIs), from the picker or a paste.
        self.attachments: list[str] = []
        self.stream: ChatStream | None = None
        self.store = ConversationStore(conversations_dir) if conversations_dir is not None else None
        self.conversation = Conversation()
        self._saved = False  # whether self.conversation has a file yet
        self._answer = Turn("assistant")
        self._render_pending = False
        # Streaming appends to the document in place (a transcript-wide setHtml
        # per chunk grows with the conversation and drops the user's
        # selection); the whole transcript is drawn again only when more than
        # the answer's text changed. A finished answer is drawn as Markdown.
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
        root.addLayout(self._build_conversation_row())
        root.addWidget(self._build_system_box())

        self.transcript = QTextBrowser()
        self.transcript.setOpenExternalLinks(False)
        self.transcript.setOpenLinks(False)
        self.transcript.anchorClicked.connect(self._open_link)
        self.transcript.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.transcript.customContextMenuRequested.connect(self._show_context_menu)
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
        self.input.image_pasted.connect(self._on_image_pasted)
        root.addWidget(self.input)

        row = QHBoxLayout()
        self.attach_button = QPushButton("&Image…")
        self.attach_button.setToolTip("Attach an image to the next question (or paste one into the box); "
                                      "the model must have a vision projector")
        self.attach_button.clicked.connect(self._pick_image)
        row.addWidget(self.attach_button)
        self.attachments_label = plain_label()
        theme.set_muted_text(self.attachments_label)
        row.addWidget(self.attachments_label)
        self.remove_attachments_button = QToolButton()
        self.remove_attachments_button.setText("✕")
        self.remove_attachments_button.setToolTip("Remove the attached images")
        self.remove_attachments_button.setAccessibleName("Remove the attached images")
        self.remove_attachments_button.clicked.connect(self.clear_attachments)
        row.addWidget(self.remove_attachments_button)
        # Which library model answers; shown once the service has more than one.
        self.model_picker = QComboBox()
        self.model_picker.setToolTip("The model that answers the next message")
        # As wide as a short name: an 80-character GGUF name would widen the
        # window; the list that drops down shows the names whole.
        self.model_picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_picker.setMinimumContentsLength(24)
        self.model_picker.currentTextChanged.connect(lambda name: self.model_picker.setToolTip(as_written(name)))
        self.model_label = QLabel("&Model:")
        self.model_label.setBuddy(self.model_picker)
        for widget in (self.model_label, self.model_picker):
            widget.setVisible(False)
            row.addWidget(widget)
        self.state_label = plain_label()  # says what the service answered
        theme.set_muted_text(self.state_label)
        row.addWidget(self.state_label, 1)
        self.regenerate_button = QPushButton("&Regenerate")
        self.regenerate_button.setToolTip("Answer the last question again, in place of the last answer (Ctrl+R)")
        self.regenerate_button.clicked.connect(self.regenerate)
        self.stop_button = QPushButton("Sto&p")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.send_button = QPushButton("&Send")
        self.send_button.setToolTip("Send (Enter or Ctrl+Enter)")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        for button in (self.regenerate_button, self.stop_button, self.send_button):
            button.setMinimumWidth(84)
            row.addWidget(button)
        root.addLayout(row)

        # Ctrl+Enter sends from anywhere in the window (the transcript, a
        # button), not only from the input box; Esc stops a running answer.
        self.shortcuts: list[QShortcut] = []
        for keys, slot in ((QKeySequence("Ctrl+Return"), self._send_from_shortcut),
                           (QKeySequence("Ctrl+Enter"), self._send_from_shortcut),
                           (QKeySequence("Ctrl+R"), self._regenerate_from_shortcut),
                           (QKeySequence(Qt.Key.Key_Escape), self._on_escape)):
            shortcut = QShortcut(keys, self)
            shortcut.activated.connect(slot)
            self.shortcuts.append(shortcut)

        client.status_changed.connect(self._on_status)
        self._set_state(f"Talking to {client.api_url}")
        self._refresh_conversations()
        self._show_attachments()
        self._update_buttons()
        self._render()

    def _build_conversation_row(self) -> QHBoxLayout:
        """The saved conversations, New chat, and a More menu for what is used less."""
        row = QHBoxLayout()
        self.conversation_picker = QComboBox()
        self.conversation_picker.setToolTip("Open a saved conversation (each is saved after every answer)")
        self.conversation_picker.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.conversation_picker.setMinimumContentsLength(20)
        self.conversation_picker.activated.connect(self._on_conversation_picked)
        self.conversation_label = QLabel("C&onversation:")
        self.conversation_label.setBuddy(self.conversation_picker)
        row.addWidget(self.conversation_label)
        row.addWidget(self.conversation_picker, 1)
        if self.store is None:  # nowhere to save: nothing to pick
            self.conversation_label.hide()
            self.conversation_picker.hide()
            row.addStretch(1)
        self.clear_button = QPushButton("&New chat")
        self.clear_button.setToolTip("Start a new conversation; this one stays saved")
        self.clear_button.setMinimumWidth(84)
        self.clear_button.clicked.connect(self.clear)
        row.addWidget(self.clear_button)

        self.system_prompt_action = QAction("&System prompt", self)
        self.system_prompt_action.setCheckable(True)
        self.system_prompt_action.setToolTip("Show the system prompt: sent first, as the 'system' message, "
                                             "and saved with the conversation")
        self.copy_last_action = QAction("Copy las&t answer", self)
        self.copy_last_action.setShortcut(QKeySequence("Ctrl+Shift+C"))
        self.copy_last_action.setToolTip("Copy the last answer's text, as Markdown (Ctrl+Shift+C)")
        self.copy_last_action.triggered.connect(self.copy_last_answer)
        self.addAction(self.copy_last_action)  # the shortcut works with the menu closed
        self.delete_action = QAction("&Delete this conversation…", self)
        self.delete_action.setToolTip("Delete this conversation's saved file")
        self.delete_action.triggered.connect(self.delete_conversation)
        self.more_menu = QMenu(self)
        self.more_menu.setToolTipsVisible(True)
        self.more_menu.addAction(self.system_prompt_action)
        self.more_menu.addAction(self.copy_last_action)
        if self.store is not None:
            self.more_menu.addSeparator()
            self.more_menu.addAction(self.delete_action)
        self.more_button = QToolButton()
        self.more_button.setText("⋯")
        self.more_button.setToolTip("More: the system prompt, copy the last answer, delete this conversation")
        self.more_button.setAccessibleName("More")
        self.more_button.setMenu(self.more_menu)
        self.more_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.more_button.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0px; }")
        row.addWidget(self.more_button)
        return row

    def _build_system_box(self) -> QWidget:
        self.system_box = QWidget()
        box = QVBoxLayout(self.system_box)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(2)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("For example: Answer briefly, in plain English.")
        self.system_edit.setTabChangesFocus(True)
        self.system_edit.setFixedHeight(self.system_edit.fontMetrics().lineSpacing() * 2 + 16)
        label = QLabel("S&ystem prompt (sent first, saved with the conversation):")
        label.setBuddy(self.system_edit)
        theme.set_muted_text(label)
        box.addWidget(label)
        box.addWidget(self.system_edit)
        self.system_box.setVisible(False)
        self.system_prompt_action.toggled.connect(self._show_system_prompt)
        return self.system_box

    # ----- actions -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.stream is not None

    def system_prompt(self) -> str:
        return self.system_edit.toPlainText().strip()

    def messages(self) -> list[dict[str, Any]]:
        """What the next request sends: the system prompt, if any, then the conversation."""
        prompt = self.system_prompt()
        return ([{"role": "system", "content": prompt}] if prompt else []) + [dict(m) for m in self.history]

    def send(self, text: str | None = None) -> bool:
        text = (text if isinstance(text, str) else self.input.toPlainText()).strip()
        if (not text and not self.attachments) or self.busy:
            return False
        self.input.clear()
        question = Turn("user", text, images=self.attachments)
        self.attachments = []
        self._show_attachments()
        self.history.append(question.question)
        self.turns.append(question)
        self._ask()
        return True

    def attach_image(self, raw: bytes) -> bool:
        """Attach an image file's bytes to the next question; False (and the
        reason on the state line) for what the service would refuse."""
        try:
            self.attachments.append(image_data_uri(raw))
        except ValueError as refused:
            self._set_state(f"Not attached: {refused}")
            return False
        self._show_attachments()
        return True

    def clear_attachments(self) -> None:
        self.attachments = []
        self._show_attachments()

    def _show_attachments(self) -> None:
        count = len(self.attachments)
        self.attachments_label.setText(f"{count} image{'s' if count != 1 else ''} attached" if count else "")
        self.remove_attachments_button.setVisible(bool(count))

    def _pick_image(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Attach an image", "",
                                              "Images (*.png *.jpg *.jpeg *.gif *.bmp);;All files (*)")
        if not path:
            return
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            self._set_state(f"Could not read {Path(path).name}: {exc.strerror or exc}")
            return
        self.attach_image(raw)

    def _on_image_pasted(self, image: QImage) -> None:
        if not image.isNull():
            self.attach_image(png_bytes(image))

    def can_regenerate(self) -> bool:
        return (not self.busy and len(self.turns) >= 2 and self.turns[-1].role == "assistant"
                and self.turns[-2].role == "user")

    def regenerate(self) -> bool:
        """Drop the last answer and ask the same question again."""
        if not self.can_regenerate():
            return False
        answer = self.turns.pop()
        question = self.turns[-1].question
        # The dropped answer is in the history if it said anything; a failed
        # one that said nothing took its question out (see _on_failed).
        if self.history[-2:] == [question, {"role": "assistant", "content": answer.text}]:
            self.history.pop()
        elif self.history[-1:] != [question]:
            self.history.append(question)
        self._ask()
        return True

    def _regenerate_from_shortcut(self) -> None:
        self.regenerate()

    def _ask(self) -> None:
        """Start the answer to the conversation as it stands (ending with a question)."""
        self._follow = True
        answer = Turn("assistant", pending=True, meta="waiting for the service…")
        self.turns.append(answer)
        self._answer = answer
        stream = ChatStream(self.client, self.messages(), max_tokens=self.max_tokens,
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
        self._update_buttons()
        self._set_state("Sent; waiting for the first token…")
        self._render()

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
        """New chat: the current conversation stays saved; the system prompt carries over."""
        if self.busy:
            self.stop()
            return
        self.save()
        self._start_new()

    def _start_new(self) -> None:
        self.turns = []
        self.history = []
        self.conversation = Conversation()
        self._saved = False
        self.banner.set_banner(None)
        self._refresh_conversations()
        self._update_buttons()
        self._render(keep_selection=False)

    @property
    def request_id(self) -> str | None:
        return self.stream.request_id if self.stream is not None else None

    # ----- copying -------------------------------------------------------------------------

    def _copy(self, text: str, what: str) -> None:
        QApplication.clipboard().setText(text)
        self._set_state(f"Copied {what}")

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
        """(the turn, the code block in it or None) at `pos` in the transcript's viewport.

        Each turn is one top-level table of the document, and each code block
        of a drawn answer one table inside it, in markdown.code_blocks' order."""
        cursor = self.transcript.cursorForPosition(pos)
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
        """The transcript's menu at `pos` (viewport coordinates): the text
        browser's own (copy the selection, a link), then copying a message."""
        offset = QPoint(self.transcript.horizontalScrollBar().value(), self.transcript.verticalScrollBar().value())
        menu = self.transcript.createStandardContextMenu(pos + offset)
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
        menu.exec(self.transcript.viewport().mapToGlobal(pos))
        menu.deleteLater()

    def _open_link(self, url: QUrl) -> None:
        # markdown.py links only these; a check here too, as the page is the model's words.
        if url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    # ----- saved conversations -----------------------------------------------------------

    def save(self) -> bool:
        """Write the conversation to its file; nothing without a folder, before
        the first question, or mid-answer (the answer's end saves it)."""
        if self.store is None or not self.turns or self.busy:
            return False
        conversation = self.conversation
        conversation.turns = [t.record() for t in self.turns]
        conversation.messages = [dict(m) for m in self.history]
        conversation.system_prompt = self.system_edit.toPlainText()
        try:
            self.store.save(conversation)
        except OSError as exc:
            log.warning("cannot save the conversation %s: %s", conversation.id, exc)
            self._set_state(f"Could not save the conversation: {exc.strerror or exc}")
            return False
        self._saved = True
        self._refresh_conversations()
        return True

    def open_conversation(self, conversation_id: str) -> bool:
        if self.store is None or self.busy:
            return False
        if self._saved and conversation_id == self.conversation.id:
            return True
        conversation = self.store.load(conversation_id)
        if conversation is None:
            self._set_state("That conversation could not be read; the log says why")
            self._refresh_conversations()
            return False
        self.save()  # the one left behind (its system prompt may have changed since its last answer)
        self.conversation = conversation
        self._saved = True
        self.turns = [Turn(t["role"], t["text"], meta=t["meta"], error=t["error"], images=t.get("images", []))
                      for t in conversation.turns]
        self.history = [dict(m) for m in conversation.messages if m["role"] != "system"]
        self.system_edit.setPlainText(conversation.system_prompt)
        if conversation.system_prompt.strip():
            self.system_prompt_action.setChecked(True)
        self._follow = True
        self.banner.set_banner(None)
        self._refresh_conversations()
        self._update_buttons()
        self._set_state(f"Opened “{conversation.title}”")
        self._render(keep_selection=False)
        return True

    def delete_conversation(self) -> bool:
        """Delete the open conversation's file, after asking; a new one starts."""
        if self.store is None or self.busy or not self._saved:
            return False
        title = self.conversation.title
        answer = QMessageBox.question(self, "Delete the conversation", f"Delete “{title}”? This cannot be undone.")
        if answer != QMessageBox.StandardButton.Yes:
            return False
        self.store.delete(self.conversation.id)
        self._start_new()
        self._set_state(f"Deleted “{title}”")
        return True

    def _refresh_conversations(self) -> None:
        if self.store is None:
            return
        picker = self.conversation_picker
        picker.clear()
        if not self._saved:
            picker.addItem("New conversation", None)
        for summary in self.store.list():
            picker.addItem(summary.title, summary.id)
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.updated))
            picker.setItemData(picker.count() - 1, f"{summary.title}\nsaved {when}", Qt.ItemDataRole.ToolTipRole)
        picker.setCurrentIndex(max(picker.findData(self.conversation.id) if self._saved else 0, 0))

    def _on_conversation_picked(self, index: int) -> None:
        conversation_id = self.conversation_picker.itemData(index)
        if conversation_id:
            self.open_conversation(conversation_id)

    def _show_system_prompt(self, shown: bool) -> None:
        self.system_box.setVisible(shown)
        if shown:
            self.system_edit.setFocus()

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
    def _route_line(answer: Turn, progress: str = "", took_s: float | None = None, speed: str = "") -> str:
        route = answer.route
        line = vm.route_line(route.get("served_by"), route.get("reason"), route.get("fallback_model"),
                             progress=progress, took_s=took_s, peer=route.get("peer"))
        return f"{line} · {speed}" if speed else line

    def _took(self, answer: Turn) -> float:
        return time.monotonic() - answer.started

    def _on_finished(self, reason: str) -> None:
        stream, answer = self.stream, self._answer
        if stream is None:
            return
        answer.pending = False
        answer.meta = self._route_line(answer, took_s=self._took(answer), speed=stream.speed_text())
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
            answer.meta = self._route_line(answer, took_s=self._took(answer), speed=stream.speed_text())
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
        self._set_state(state)
        self.save()
        self._update_buttons()
        self._update_banner(self.client.last_status)
        self._render()
        self.answer_finished.emit(outcome)

    def _update_buttons(self) -> None:
        busy = self.busy
        self.stop_button.setEnabled(busy)
        self.send_button.setEnabled(not busy)
        self.regenerate_button.setEnabled(self.can_regenerate())
        self.conversation_picker.setEnabled(not busy)
        self.delete_action.setEnabled(not busy and self._saved)
        self.copy_last_action.setEnabled(self.last_answer() is not None)

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
            self.model_picker.setToolTip(as_written(self.model_picker.currentText()))
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
                # Each poll: the line is rewritten in place, not the whole transcript redrawn.
                if self._needs_full_render or not self._replace_answer_meta(meta):
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
        document = self.transcript.document()
        for index, turn in enumerate(self.turns):
            for number, uri in enumerate(turn.images):
                document.addResource(QTextDocument.ResourceType.ImageResource, QUrl(image_name(index, number)),
                                     QImage.fromData(image_bytes(uri)))
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

    def _replace_answer_meta(self, meta: str) -> bool:
        """Put `meta` in place of the streaming answer's route line; False if
        the document has no such line (drawn before the answer was routed)."""
        answer = self._answer
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
        answer = self._answer
        if not (answer.pending and answer.text):
            return None
        # Typing here takes the format of the character before: the answer's text, not the mark's.
        return self._cursor_at_last(ANSWER_END_MARK, after=False)

    def _cursor_at_last(self, mark: str, *, after: bool) -> QTextCursor | None:
        """A cursor just before (or after) the document's last `mark`; None without one."""
        document = self.transcript.document()
        found = document.find(mark, document.characterCount(), QTextDocument.FindFlag.FindBackward)
        if found.isNull():
            return None
        cursor = QTextCursor(document)
        cursor.setPosition(found.selectionEnd() if after else found.selectionStart())
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
        # Closing only hides: the conversation stays for the session (and is
        # saved, with a system prompt edited since its last answer).
        event.ignore()
        self.save()
        self.hide()


# Ends a streaming answer's text; new text goes in just before it.
ANSWER_END_MARK = "\u25ae"
# Starts a streaming answer's route line (a word joiner: not seen), so that
# each poll's "about 12 s left" replaces the line alone.
ANSWER_META_MARK = "\u2060"


THUMBNAIL_PX = 96


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
            # The images as thumbnails, from the resources _render adds under these names.
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
