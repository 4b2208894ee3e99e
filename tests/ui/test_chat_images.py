"""The chat window attaches images (the picker's bytes, or a paste), shows
them in the question, sends them to a real service whose model has the tiny
projector, and keeps them in the saved conversation."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QMimeData, QUrl
from PySide6.QtGui import QColor, QImage, QTextDocument

from tests.integration.test_images import DATA_URI, PNG, image_service
from tray_app.ui.chat import ChatWindow, image_name

from .conftest import chat_window

pytestmark = pytest.mark.integration

WAIT_MS = 120_000


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    with image_service(tmp_path_factory, "chat-images", cpu_sees=True) as service:
        yield service


@pytest.fixture
def chat(qtbot, seeing, tmp_path):
    seeing.reset()
    with chat_window(qtbot, seeing.url, tmp_path / "conversations", max_tokens=8, temperature=0) as window:
        yield window


def test_an_attached_image_is_shown_sent_and_kept(qtbot, chat, tmp_path) -> None:
    assert chat.attach_image(PNG)
    assert chat.attachments_label.text() == "1 image attached"
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as finished:
        assert chat.send("What is in the picture?")
    assert finished.args == ["ok"]
    assert chat.attachments == [] and chat.attachments_label.text() == ""
    assert chat.history[0] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URI}}, {"type": "text", "text": "What is in the picture?"}]}
    assert chat.turns[-1].meta.startswith("served by GPU")
    shown = chat.transcript.document().resource(QTextDocument.ResourceType.ImageResource, QUrl(image_name(0, 0)))
    assert isinstance(shown, QImage) and shown.width() == 8

    # Reopened, the conversation shows the image and would send it again.
    again = ChatWindow(chat.client, conversations_dir=tmp_path / "conversations")
    qtbot.addWidget(again)
    assert again.open_conversation(chat.conversation.id)
    assert again.turns[0].images == [DATA_URI]
    assert again.history[0] == chat.history[0]


def test_a_pasted_image_is_attached_not_typed(chat) -> None:
    pasted = QImage(4, 4, QImage.Format.Format_RGB32)
    pasted.fill(QColor("blue"))
    mime = QMimeData()
    mime.setImageData(pasted)
    assert chat.input.canInsertFromMimeData(mime)
    chat.input.insertFromMimeData(mime)
    assert len(chat.attachments) == 1 and chat.attachments[0].startswith("data:image/png;base64,")
    assert chat.input.toPlainText() == ""


def test_a_file_that_is_not_an_image_is_not_attached(chat) -> None:
    assert not chat.attach_image(b"%PDF-1.7 not an image")
    assert chat.attachments == [] and "Not attached" in chat.state_label.text()
