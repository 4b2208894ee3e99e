"""The chat's composer: what the next question is sent with. The box it is
written in, the images attached to it (from the Image… picker, or pasted
into the box), the system prompt, and the model that answers."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QIODevice, QMimeData, QObject, Qt, Signal
from PySide6.QtGui import QImage, QKeyEvent
from PySide6.QtWidgets import QComboBox, QFileDialog, QLabel, QPlainTextEdit, QPushButton, QToolButton, QVBoxLayout, QWidget

from . import theme
from .conversations import image_data_uri
from .widgets import as_written, plain_label


def png_bytes(image: QImage) -> bytes:
    """A pasted image, encoded as PNG to send."""
    buffer = QBuffer()
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(buffer.data())


class InputBox(QPlainTextEdit):
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


class Composer(QObject):
    """The next question's text and images. It makes the widgets; the window
    lays them out (the attachments share a row with the window's buttons)."""

    refused = Signal(str)  # why an image was not attached, for the state line

    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self._window = window  # the file picker's parent
        # Images attached to the next question (data: URIs), from the picker or a paste.
        self.attachments: list[str] = []
        self.input = InputBox()
        self.input.setPlaceholderText("Ask something. Enter or Ctrl+Enter sends, Shift+Enter adds a line, "
                                      "Esc stops an answer.")
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 3 + 16)
        self.input.image_pasted.connect(self._on_image_pasted)
        self.attach_button = QPushButton("&Image…")
        self.attach_button.setToolTip("Attach an image to the next question (or paste one into the box); "
                                      "the model must have a vision projector")
        self.attach_button.clicked.connect(self._pick_image)
        self.attachments_label = plain_label()
        theme.set_muted_text(self.attachments_label)
        self.remove_attachments_button = QToolButton()
        self.remove_attachments_button.setText("✕")
        self.remove_attachments_button.setToolTip("Remove the attached images")
        self.remove_attachments_button.setAccessibleName("Remove the attached images")
        self.remove_attachments_button.clicked.connect(self.clear_attachments)

    def take_attachments(self) -> list[str]:
        """The attached images, for the question being sent; none are left attached."""
        taken, self.attachments = self.attachments, []
        self.show_attachments()
        return taken

    def attach_image(self, raw: bytes) -> bool:
        """Attach an image file's bytes to the next question; False (and the
        reason, as `refused`) for what the service would refuse."""
        try:
            self.attachments.append(image_data_uri(raw))
        except ValueError as refused:
            self.refused.emit(f"Not attached: {refused}")
            return False
        self.show_attachments()
        return True

    def clear_attachments(self) -> None:
        self.attachments = []
        self.show_attachments()

    def show_attachments(self) -> None:
        count = len(self.attachments)
        self.attachments_label.setText(f"{count} image{'s' if count != 1 else ''} attached" if count else "")
        self.remove_attachments_button.setVisible(bool(count))

    def _pick_image(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self._window, "Attach an image", "",
                                              "Images (*.png *.jpg *.jpeg *.gif *.bmp);;All files (*)")
        if not path:
            return
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            self.refused.emit(f"Could not read {Path(path).name}: {exc.strerror or exc}")
            return
        self.attach_image(raw)

    def _on_image_pasted(self, image: QImage) -> None:
        if not image.isNull():
            self.attach_image(png_bytes(image))


class SystemPromptBox(QWidget):
    """The system prompt: sent first, saved with the conversation; hidden until asked for."""

    def __init__(self) -> None:
        super().__init__()
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(2)
        self.edit = QPlainTextEdit()
        self.edit.setPlaceholderText("For example: Answer briefly, in plain English.")
        self.edit.setTabChangesFocus(True)
        self.edit.setFixedHeight(self.edit.fontMetrics().lineSpacing() * 2 + 16)
        label = QLabel("S&ystem prompt (sent first, saved with the conversation):")
        label.setBuddy(self.edit)
        theme.set_muted_text(label)
        box.addWidget(label)
        box.addWidget(self.edit)
        self.setVisible(False)

    def show_prompt(self, shown: bool) -> None:
        self.setVisible(shown)
        if shown:
            self.edit.setFocus()


class ModelPicker(QComboBox):
    """Which library model answers; shown (with its `label`) once the service has more than one."""

    def __init__(self) -> None:
        super().__init__()
        self.setToolTip("The model that answers the next message")
        # As wide as a short name: an 80-character GGUF name would widen the
        # window; the list that drops down shows the names whole.
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(24)
        self.currentTextChanged.connect(lambda name: self.setToolTip(as_written(name)))
        self.label = QLabel("&Model:")
        self.label.setBuddy(self)
        for widget in (self.label, self):
            widget.setVisible(False)

    def chosen(self) -> str | None:
        """The picked model's name; None (the default model) while there is no choice."""
        return self.currentText() or None if self.count() > 1 else None

    def show_models(self, names: list[str]) -> None:
        """The library's models, as /status lists them; the choice stays if its model does."""
        current = [self.itemText(i) for i in range(self.count())]
        if names and names != current:
            chosen = self.currentText()
            self.blockSignals(True)
            self.clear()
            self.addItems(names)
            if chosen in names:
                self.setCurrentText(chosen)
            self.blockSignals(False)
            self.setToolTip(as_written(self.currentText()))
        for widget in (self.label, self):
            widget.setVisible(len(names) > 1)
