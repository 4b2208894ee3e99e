"""The chat window: a client of the service's own OpenAI-compatible port.

It keeps the conversation and sends all of it each turn, streaming the
answer (`chat_stream.ChatStream`) into the transcript (`chat_transcript`);
the question is written in the composer (`chat_composer`: the input box and
attached images) and conversations are saved and opened again by
`chat_saved`. Stop (and the degraded banner's Cancel) cancels exactly its
own request with DELETE /v1/requests/{id}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QPoint, Qt, Signal
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import QHBoxLayout, QMenu, QPushButton, QVBoxLayout, QWidget

from . import theme
from . import viewmodel as vm
from .chat_composer import Composer, ModelPicker, SystemPromptBox
from .chat_answer import Answering
from .chat_saved import SavedConversations
from .chat_stream import ChatStream, speed_text, tokens_per_second
from .chat_transcript import ChatTranscript, Turn, image_name, render_html
from .client import ServiceClient
from .conversations import Conversation, ConversationStore
from .icons import state_icon
from .widgets import DegradedBanner, plain_label, set_text
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

# Other modules and the tests import these from here.
__all__ = ["ChatStream", "ChatWindow", "Turn", "image_name", "render_html", "speed_text", "tokens_per_second"]


class ChatWindow(Answering, SavedConversations, QWidget):
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
        self.history: list[dict[str, Any]] = []
        self.stream: ChatStream | None = None
        self.store = ConversationStore(conversations_dir) if conversations_dir is not None else None
        self.conversation = Conversation()
        self._saved = False  # whether self.conversation has a file yet
        # The turns and the streaming answer are the transcript's; the window reads and replaces them.
        self.transcript = ChatTranscript()
        self.transcript.copied.connect(self._on_copied)
        self.composer = Composer(self)
        self.composer.refused.connect(self._set_state)
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
        root.addWidget(self.transcript, 1)

        self.input = self.composer.input
        self.input.submit.connect(self.send)
        root.addWidget(self.input)
        root.addLayout(self._build_controls_row())

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
        self.composer.show_attachments()
        self._update_buttons()
        self._render()

    def _build_controls_row(self) -> QHBoxLayout:
        """Under the input: the attached images, the model, the state line and the buttons."""
        row = QHBoxLayout()
        self.attach_button = self.composer.attach_button
        self.attachments_label = self.composer.attachments_label
        self.remove_attachments_button = self.composer.remove_attachments_button
        for widget in (self.attach_button, self.attachments_label, self.remove_attachments_button):
            row.addWidget(widget)
        self.model_picker = ModelPicker()
        self.model_label = self.model_picker.label
        for widget in (self.model_label, self.model_picker):
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
        return row

    def _build_system_box(self) -> QWidget:
        self.system_box = SystemPromptBox()
        self.system_edit = self.system_box.edit
        self.system_prompt_action.toggled.connect(self.system_box.show_prompt)
        return self.system_box

    # ----- the transcript's: the turns, the answer, drawing and copying --------------------

    @property
    def turns(self) -> list[Turn]:
        return self.transcript.turns

    @turns.setter
    def turns(self, turns: list[Turn]) -> None:
        self.transcript.turns = turns

    @property
    def _answer(self) -> Turn:
        """The latest answer: streaming while it is pending."""
        return self.transcript.answer

    @_answer.setter
    def _answer(self, answer: Turn) -> None:
        self.transcript.answer = answer

    def _render(self, *, keep_selection: bool = True) -> None:
        self.transcript.render(keep_selection=keep_selection)

    def _schedule_render(self) -> None:
        self.transcript.schedule_render()

    def _on_copied(self, what: str) -> None:
        self._set_state(f"Copied {what}")

    def context_menu(self, pos: QPoint) -> QMenu:
        """The transcript's menu at `pos` (its viewport's coordinates)."""
        return self.transcript.context_menu(pos)

    def last_answer(self) -> Turn | None:
        return self.transcript.last_answer()

    def copy_last_answer(self) -> None:
        self.transcript.copy_last_answer()

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
        question = Turn("user", text, images=self.composer.take_attachments())
        self.history.append(question.question)
        self.turns.append(question)
        self._ask()
        return True

    @property
    def attachments(self) -> list[str]:
        """The images attached to the next question, as data: URIs."""
        return self.composer.attachments

    def attach_image(self, raw: bytes) -> bool:
        return self.composer.attach_image(raw)

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

    def _send_from_shortcut(self) -> None:
        self.send()

    def _on_escape(self) -> None:
        # Only a running answer: an idle Esc must not hide or clear anything.
        if self.busy:
            self.stop()

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

    def _update_buttons(self) -> None:
        busy = self.busy
        self.stop_button.setEnabled(busy)
        self.send_button.setEnabled(not busy)
        self.regenerate_button.setEnabled(self.can_regenerate())
        self.conversation_picker.setEnabled(not busy)
        self.delete_action.setEnabled(not busy and self._saved)
        self.copy_last_action.setEnabled(self.transcript.last_answer() is not None)

    def chosen_model(self) -> str | None:
        """The picked model's name; None (the default model) while there is no choice."""
        return self.model_picker.chosen()

    def _on_status(self, status: dict) -> None:
        self.model_picker.show_models(vm.model_names(status))
        self._update_banner(status)
        self._follow_own_request(status)

    def _update_banner(self, status: dict | None) -> None:
        self.banner.set_banner(vm.degraded_banner(status, own_request_id=self.request_id, only_own=True)
                               if status else None)

    # ----- the state line, and the window's Qt events ----------------------------------------

    def _set_state(self, text: str) -> None:
        set_text(self.state_label, text)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        self.transcript.keep_end_in_view()

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
