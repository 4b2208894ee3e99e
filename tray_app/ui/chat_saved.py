"""The chat window's saved conversations: the picker row, and saving,
opening and deleting a conversation (the files are `conversations.py`'s).

A mixin of `ChatWindow`: saving reads the window's turns, history and
system prompt, and opening one puts them back, so it works on the window's
own state rather than a copy of it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QMenu, QMessageBox, QPushButton, QToolButton

from .chat_transcript import Turn
from .conversations import Conversation, ConversationStore

if TYPE_CHECKING:
    from PySide6.QtWidgets import QPlainTextEdit, QWidget

    from .chat_transcript import ChatTranscript
    from .widgets import DegradedBanner

    _WindowBase = QWidget  # the type checker sees the widget this is mixed into
else:
    _WindowBase = object

log = logging.getLogger(__name__)


class SavedConversations(_WindowBase):
    """What ChatWindow keeps of its conversations; see the module's docstring."""

    # The window's parts this reads and writes.
    store: ConversationStore | None
    conversation: Conversation
    _saved: bool  # whether self.conversation has a file yet
    history: list[dict[str, Any]]
    transcript: ChatTranscript
    banner: DegradedBanner
    system_edit: QPlainTextEdit
    copy_last_action: QAction

    turns: list[Turn]
    busy: bool

    if TYPE_CHECKING:  # the window's
        def _set_state(self, text: str) -> None: ...
        def _update_buttons(self) -> None: ...
        def _render(self, *, keep_selection: bool = True) -> None: ...
        def _start_new(self) -> None: ...
        def clear(self) -> None: ...

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
        self.copy_last_action = self.transcript.copy_last_action
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
        self.transcript.follow = True
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
