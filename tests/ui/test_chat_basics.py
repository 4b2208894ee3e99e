"""The chat's basics, with the test playing the service: Markdown answers,
copying, tokens per second, Regenerate, the system prompt, and saved
conversations (in tmp_path, never the real data folder)."""

from __future__ import annotations

import json
import re
import time

import pytest
from PySide6.QtCore import QUrl, Qt
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QMessageBox

from tray_app.ui import colors, markdown, theme
from tray_app.ui import viewmodel as vm
from tray_app.ui.chat import ChatStream, ChatWindow, Turn, speed_text, tokens_per_second
from tray_app.ui.client import ServiceClient

from . import test_keyboard_and_themes
from .test_keyboard_and_themes import DEAD_URL, activate

dark_palette = test_keyboard_and_themes.dark_palette  # the fixture, shared

ROUTE = {"served_by": "gpu", "reason": "gpu_ready", "fallback_model": None}
ANSWER = ("Use **slicing**:\n\n```python\nbackwards = items[::-1]\n```\n\nOr this:\n\n"
          "```\nitems.reverse()\n```\n<b>not bold</b>")


@pytest.fixture
def started(monkeypatch) -> list[ChatStream]:
    """ChatStream.start sends nothing: the test plays the service."""
    streams: list[ChatStream] = []
    monkeypatch.setattr(ChatStream, "start", lambda self: streams.append(self))
    return streams


def make_chat(qtbot, folder=None) -> ChatWindow:
    chat = ChatWindow(ServiceClient(DEAD_URL), conversations_dir=folder)
    qtbot.addWidget(chat)
    chat.show()
    return chat


@pytest.fixture
def chat(qtbot, tmp_path, started) -> ChatWindow:
    return make_chat(qtbot, tmp_path / "conversations")


def answer(chat: ChatWindow, text: str, *, tokens: int | None = None, seconds: float | None = None) -> None:
    """The service's side of one answer: routed, the text in chunks, usage, [DONE]."""
    stream = chat.stream
    chat._on_routed(ROUTE)
    for piece in re.findall(r"\S+\s*|\s+", text):
        stream._handle({"choices": [{"delta": {"content": piece}}]})
    if seconds is not None:
        stream.first_token_at = time.monotonic() - seconds
    stream._handle({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    if tokens is not None:
        stream._handle({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens,
                                                 "total_tokens": tokens + 9}})
    stream._handle(vm.DONE)


def ask(chat: ChatWindow, question: str, reply: str = ANSWER, **kwargs) -> None:
    assert chat.send(question)
    answer(chat, reply, **kwargs)


# ----- Markdown -------------------------------------------------------------------------------

def test_a_finished_answer_is_drawn_as_markdown_and_streams_as_plain_text(qtbot, chat) -> None:
    chat.send("How do I reverse a list?")
    chat._on_routed(ROUTE)
    chat._on_delta("Use **slicing**:\n\n```python\nbackwards")
    qtbot.waitUntil(lambda: "backwards" in chat.transcript.toPlainText())
    assert "**slicing**" in chat.transcript.toPlainText()  # still the text as it came
    chat._on_delta(" = items[::-1]\n```\n<b>not bold</b>")
    chat.stream._handle(vm.DONE)
    text = chat.transcript.toPlainText()
    assert "Use slicing:" in text and "```" not in text and "<b>not bold</b>" in text
    document = chat.transcript.document()
    bold = document.find("slicing")
    assert bold.charFormat().fontWeight() >= 600
    code = document.find("backwards = items[::-1]")
    assert "monospace" in code.charFormat().fontFamilies() or code.charFormat().fontFixedPitch()
    table = code.currentTable()
    expected = colors.to_hex(markdown.markdown_colors(colors.chat_colors(theme.current_palette())).code_background)
    assert table is not None and table.format().background().color().name() == expected
    # The model's HTML is text: no bold run made of it.
    assert not document.find("not bold").charFormat().fontWeight() > 400


def test_a_finished_answer_is_drawn_as_markdown_once_not_on_every_redraw(qtbot, chat, monkeypatch) -> None:
    drawn: list[str] = []
    real = markdown.to_html
    monkeypatch.setattr(markdown, "to_html", lambda text, palette: drawn.append(text) or real(text, palette))
    # A text of this test's own: no other test's drawing is in the cache.
    first = f"{ANSWER}\n\nfirst answer of {id(chat)}"
    ask(chat, "How do I reverse a list?", first)
    assert drawn == [first]
    # The next question and its streamed answer redraw the transcript many
    # times; the finished answer above is drawn from what was kept.
    second = f"second answer of {id(chat)}"
    ask(chat, "And a tuple?", second)
    chat._render()
    assert drawn == [first, second]
    assert "backwards = items[::-1]" in chat.transcript.toPlainText()


def test_links_open_only_for_the_web_and_mail(qtbot, chat, monkeypatch) -> None:
    opened: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(lambda url: opened.append(url.toString()) or True))
    for url in ("https://example.org/", "javascript:alert(1)", "file:///etc/passwd", "mailto:me@example.org"):
        chat.transcript.anchorClicked.emit(QUrl(url))
    assert opened == ["https://example.org/", "mailto:me@example.org"]


@pytest.mark.usefixtures("dark_palette")
def test_under_a_dark_palette_code_blocks_are_dark_too(qtbot, started) -> None:
    chat = make_chat(qtbot)
    chat.turns = [Turn("user", "code?"), Turn("assistant", "```\n" + "x = 1\n" * 12 + "```")]
    chat._render()
    code = chat.transcript.document().find("x = 1")
    background = theme.rgb(code.currentTable().format().background().color())
    assert colors.is_dark(background)
    assert colors.contrast_ratio(theme.rgb(code.charFormat().foreground().color()), background) >= 4.5


# ----- copying --------------------------------------------------------------------------------

def point_at(chat: ChatWindow, text: str):
    cursor = chat.transcript.document().find(text)
    assert not cursor.isNull(), text
    return chat.transcript.cursorRect(cursor).center()


def menu_texts(menu) -> list[str]:
    return [a.text() for a in menu.actions() if not a.isSeparator()]


def test_the_context_menu_copies_a_message_or_a_code_block(qtbot, chat) -> None:
    ask(chat, "How do I reverse a list?")
    clipboard = QApplication.clipboard()
    # On the answer's prose: the whole message, as its Markdown source.
    menu = chat.context_menu(point_at(chat, "Or this"))
    assert "Copy &message" in menu_texts(menu) and "Copy &code block" not in menu_texts(menu)
    next(a for a in menu.actions() if a.text() == "Copy &message").trigger()
    assert clipboard.text() == ANSWER
    # On the second code block: that block's code, without its fences.
    menu = chat.context_menu(point_at(chat, "items.reverse()"))
    next(a for a in menu.actions() if a.text() == "Copy &code block").trigger()
    assert clipboard.text() == "items.reverse()"
    menu = chat.context_menu(point_at(chat, "backwards"))
    next(a for a in menu.actions() if a.text() == "Copy &code block").trigger()
    assert clipboard.text() == "backwards = items[::-1]"
    # On the question: the question.
    menu = chat.context_menu(point_at(chat, "How do I reverse"))
    next(a for a in menu.actions() if a.text() == "Copy &message").trigger()
    assert clipboard.text() == "How do I reverse a list?"
    assert chat.state_label.text() == "Copied the message"


def test_ctrl_shift_c_copies_the_last_answer(qtbot, chat) -> None:
    assert not chat.copy_last_action.isEnabled()  # nothing to copy yet
    ask(chat, "first", "the first answer")
    ask(chat, "second", "the **second** answer")
    activate(qtbot, chat)
    QApplication.clipboard().clear()
    qtbot.keyClick(chat.input, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert QApplication.clipboard().text() == "the **second** answer"


# ----- tokens per second ----------------------------------------------------------------------

def test_the_answer_line_says_tokens_per_second_from_the_servers_count(qtbot, chat) -> None:
    ask(chat, "Count.", "one two three", tokens=41, seconds=2.0)
    assert re.fullmatch(r"served by GPU · .* · took .+ · 20 tok/s", chat.turns[-1].meta), chat.turns[-1].meta
    assert "20 tok/s" in chat.transcript.toPlainText()


def test_without_usage_the_chunks_are_counted(qtbot, chat) -> None:
    chat.send("Count.")
    stream = chat.stream
    answer(chat, "a b c d e f g h i j k", seconds=1.0)  # 11 chunks, no usage chunk
    assert stream.completion_tokens is None and stream.tokens == 11
    assert chat.turns[-1].meta.endswith(" · 10 tok/s")


def test_tokens_per_second_counts_from_the_first_token() -> None:
    assert tokens_per_second(11, 100.0, 102.0) == 5.0
    assert tokens_per_second(1, 100.0, 102.0) is None and tokens_per_second(5, None, 1.0) is None
    assert speed_text(11, 100.0, 102.0) == "5.0 tok/s" and speed_text(101, 0.0, 2.0) == "50 tok/s"
    assert speed_text(0, None, 1.0) == ""


def test_the_request_asks_for_usage(monkeypatch) -> None:
    client = ServiceClient(DEAD_URL)
    bodies: list[dict] = []

    class Posted(Exception):
        pass

    def post(request, data):
        bodies.append(json.loads(bytes(data.data())))
        raise Posted

    monkeypatch.setattr(client.nam, "post", post)
    with pytest.raises(Posted):
        ChatStream(client, [{"role": "user", "content": "hi"}]).start()
    assert bodies[0]["stream_options"] == {"include_usage": True}


# ----- Regenerate -----------------------------------------------------------------------------

def test_regenerate_drops_the_last_answer_and_asks_again(qtbot, chat, started) -> None:
    assert not chat.regenerate_button.isEnabled()
    ask(chat, "first", "answer one")
    ask(chat, "second", "answer two")
    assert chat.regenerate_button.isEnabled()
    qtbot.mouseClick(chat.regenerate_button, Qt.MouseButton.LeftButton)
    assert chat.busy and not chat.regenerate_button.isEnabled()
    assert [t.text for t in chat.turns] == ["first", "answer one", "second", ""]
    assert started[-1].messages == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer one"},
                                    {"role": "user", "content": "second"}]
    answer(chat, "answer two, again")
    assert [m["content"] for m in chat.history] == ["first", "answer one", "second", "answer two, again"]
    assert chat.transcript.toPlainText().count("answer two") == 1


def test_ctrl_r_regenerates_an_answer_that_failed_with_nothing(qtbot, chat, started) -> None:
    ask(chat, "first", "answer one")
    chat.send("second")
    chat.stream._handle({"error": {"message": "the GPU worker crashed", "code": "worker_crashed"}})
    assert chat.history[-1] == {"role": "assistant", "content": "answer one"}  # the question was taken out
    activate(qtbot, chat)
    qtbot.keyClick(chat.input, Qt.Key.Key_R, Qt.KeyboardModifier.ControlModifier)
    assert chat.busy
    assert [m["content"] for m in started[-1].messages] == ["first", "answer one", "second"]
    # Busy: no second regeneration.
    assert not chat.regenerate()


# ----- the system prompt ----------------------------------------------------------------------

def test_the_system_prompt_is_sent_first_and_saved(qtbot, chat, started, tmp_path) -> None:
    assert not chat.system_box.isVisible()
    chat.system_prompt_action.trigger()
    assert chat.system_box.isVisible()
    chat.system_edit.setPlainText("Answer like a pirate.")
    ask(chat, "Hello?", "Arr.")
    assert started[-1].messages[0] == {"role": "system", "content": "Answer like a pirate."}
    assert [m["role"] for m in chat.history] == ["user", "assistant"]  # the prompt is not part of the history
    saved = json.loads(next((tmp_path / "conversations").glob("*.json")).read_text())
    assert saved["system_prompt"] == "Answer like a pirate."
    # No prompt: no system message.
    chat.system_edit.clear()
    ask(chat, "Again?", "Yes.")
    assert started[-1].messages[0]["role"] == "user"


# ----- saved conversations --------------------------------------------------------------------

def test_conversations_are_saved_listed_reopened_and_deleted(qtbot, tmp_path, started, monkeypatch) -> None:
    folder = tmp_path / "conversations"
    chat = make_chat(qtbot, folder)
    assert chat.conversation_picker.isVisible() and chat.conversation_picker.currentText() == "New conversation"
    chat.system_edit.setPlainText("Be brief.")
    ask(chat, "What is a lighthouse?", "A **tower** with a light.")
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and chat.conversation_picker.currentText() == "What is a lighthouse?"
    chat.clear()  # New chat
    assert chat.turns == [] and chat.conversation_picker.currentText() == "New conversation"
    ask(chat, "And a harbour?", "A sheltered place for ships.")
    assert len(list(folder.glob("*.json"))) == 2

    # A new window on the same folder (the next session) lists both, newest first, and opens either.
    again = make_chat(qtbot, folder)
    titles = [again.conversation_picker.itemText(i) for i in range(again.conversation_picker.count())]
    assert titles == ["New conversation", "And a harbour?", "What is a lighthouse?"]
    again.conversation_picker.activated.emit(2)
    assert [t.text for t in again.turns] == ["What is a lighthouse?", "A **tower** with a light."]
    assert again.history[-1] == {"role": "assistant", "content": "A **tower** with a light."}
    assert again.system_edit.toPlainText() == "Be brief." and again.system_box.isVisible()
    assert "tower with a light" in again.transcript.toPlainText() and again.regenerate_button.isEnabled()
    # It goes on in the same file.
    ask(again, "How tall?", "Tall.")
    assert len(list(folder.glob("*.json"))) == 2

    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *args: QMessageBox.StandardButton.No))
    assert not again.delete_conversation() and len(list(folder.glob("*.json"))) == 2
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *args: QMessageBox.StandardButton.Yes))
    again.delete_action.trigger()
    assert len(list(folder.glob("*.json"))) == 1 and again.turns == []
    assert again.conversation_picker.currentText() == "New conversation" and not again.delete_action.isEnabled()


def test_damaged_files_do_not_stop_the_window(qtbot, tmp_path, started) -> None:
    folder = tmp_path / "conversations"
    folder.mkdir()
    (folder / "broken.json").write_text("{half a file")
    (folder / "foreign.json").write_text(json.dumps({"messages": "not ours"}))
    chat = make_chat(qtbot, folder)
    assert chat.conversation_picker.count() == 1  # only "New conversation"
    assert not chat.open_conversation("broken") and chat.turns == []
    assert "could not be read" in chat.state_label.text()


def test_without_a_folder_nothing_is_saved_and_there_is_nothing_to_pick(qtbot, started) -> None:
    chat = make_chat(qtbot)
    assert chat.store is None and not chat.conversation_picker.isVisible()
    ask(chat, "hi", "hello")
    assert not chat.save()


def test_the_picker_and_delete_wait_while_answering(qtbot, chat) -> None:
    ask(chat, "first", "one")
    chat.send("second")
    assert not chat.conversation_picker.isEnabled() and not chat.delete_action.isEnabled()
    answer(chat, "two")
    assert chat.conversation_picker.isEnabled() and chat.delete_action.isEnabled()
