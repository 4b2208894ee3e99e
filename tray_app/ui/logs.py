"""The tray's "View logs…": the tray app's log and each worker's, tailed,
with a filter, and the text selectable (Ctrl+C copies the selection).

The files are read directly (the service, in this process or another, logs
to this machine). A poll reads what was appended, and only while the window
is shown: a closed viewer costs nothing. Which file, the filter and the
reading are tray_app/ui/logtail.py, without Qt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from PySide6.QtCore import QEvent, Qt, QTimer, QUrl
from PySide6.QtGui import QDesktopServices, QFontDatabase, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget,
)

from . import theme
from . import viewmodel as vm
from .icons import state_icon
from .logtail import MAX_LINES, TAIL_BYTES, LogSource, LogTail, count_text, filter_lines, log_sources, worker_logs_in
from .widgets import plain_label
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

POLL_MS = 500


class LogViewer(QWidget):
    """One window for all the logs; set_status() keeps its list of workers current."""

    def __init__(self, app_log: Path, status: Mapping[str, Any] | None = None, *, poll_ms: int = POLL_MS,
                 max_lines: int = MAX_LINES, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.app_log = Path(app_log)
        self.max_lines = max_lines
        self._status = status
        self.sources: list[LogSource] = []
        self.tail: LogTail | None = None
        self._shown = 0
        self.setWindowTitle("tray-app: logs")
        self.setWindowIcon(state_icon(vm.GPU))
        self.resize(960, 600)

        root = QVBoxLayout(self)
        top = QHBoxLayout()
        self.source_box = QComboBox()
        self.source_box.setToolTip("Which log: the tray app's own, or a llama.cpp worker's")
        self.source_box.setMinimumContentsLength(24)
        self.source_box.currentIndexChanged.connect(self._on_source_chosen)
        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("only lines containing this (any case)")
        self.filter_edit.setToolTip("Show only the lines that contain this text, ignoring case (Ctrl+F)")
        self.filter_edit.setClearButtonEnabled(True)
        # The combo box grows to any width it is given; the filter must stay wide
        # enough to read what was typed.
        self.filter_edit.setMinimumWidth(240)
        self.source_box.setMaximumWidth(420)
        self.filter_edit.textChanged.connect(self._render_all)
        self.count_label = plain_label()
        theme.set_muted_text(self.count_label)
        for text, buddy, stretch in (("&Source:", self.source_box, 0), ("F&ilter:", self.filter_edit, 1)):
            label = QLabel(text)
            label.setBuddy(buddy)
            top.addWidget(label)
            top.addWidget(buddy, stretch)
        top.addWidget(self.count_label)
        root.addLayout(top)

        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                          | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.view.setUndoRedoEnabled(False)
        self.view.setMaximumBlockCount(max_lines)
        self.view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.view.setToolTip("Select text and press Ctrl+C to copy it")
        root.addWidget(self.view, 1)

        bottom = QHBoxLayout()
        self.path_label = plain_label()  # a file's path
        theme.set_muted_text(self.path_label)
        self.path_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        bottom.addWidget(self.path_label, 1)
        self.follow_box = QCheckBox("&Follow the end")
        self.follow_box.setToolTip("Keep the newest lines in view as they are written")
        self.follow_box.setChecked(True)
        self.follow_box.toggled.connect(self._on_follow)
        self.copy_button = QPushButton("&Copy all shown")
        self.copy_button.setToolTip("Copy every line shown (after the filter) to the clipboard")
        self.copy_button.clicked.connect(self.copy_shown)
        self.folder_button = QPushButton("&Open folder")
        self.folder_button.setToolTip("Open the folder this log is in")
        self.folder_button.clicked.connect(self.open_folder)
        for widget in (self.follow_box, self.copy_button, self.folder_button):
            bottom.addWidget(widget)
        root.addLayout(bottom)

        self.timer = QTimer(self)
        self.timer.setInterval(poll_ms)
        self.timer.timeout.connect(self.poll)
        self.shortcuts: list[QShortcut] = []
        for keys, slot in ((QKeySequence(Qt.Key.Key_Escape), self.close),
                           (QKeySequence(QKeySequence.StandardKey.Find), self._focus_filter)):
            shortcut = QShortcut(keys, self)
            shortcut.activated.connect(slot)
            self.shortcuts.append(shortcut)
        self._update_sources()

    # ----- public ------------------------------------------------------------------------

    @property
    def source(self) -> LogSource | None:
        index = self.source_box.currentIndex()
        return self.sources[index] if 0 <= index < len(self.sources) else None

    def set_status(self, status: Mapping[str, Any] | None) -> None:
        """The latest /status; the list of logs follows it while the window is shown."""
        self._status = status
        if self.isVisible():
            self._update_sources()

    def choose(self, path: Path) -> bool:
        """Show the log at `path`, if it is one of the sources."""
        for index, source in enumerate(self.sources):
            if source.path == Path(path):
                self.source_box.setCurrentIndex(index)
                return True
        return False

    def poll(self) -> None:
        """Read what was appended to the log shown."""
        if self.tail is None:
            return
        update = self.tail.poll()
        if update.reset:
            self._render_all()
        elif update.new:
            self._append(update.new)

    def shown_text(self) -> str:
        return self.view.toPlainText()

    def copy_shown(self) -> None:
        QGuiApplication.clipboard().setText(self.shown_text())

    def open_folder(self) -> None:
        source = self.source
        if source is None:
            return
        folder = source.path.parent
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            QGuiApplication.clipboard().setText(str(folder))
            self.path_label.setText(f"{folder} (no file manager answered; the path is on the clipboard)")

    # ----- events ------------------------------------------------------------------------

    def showEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().showEvent(event)
        self._update_sources()
        self.poll()
        self.timer.start()

    def hideEvent(self, event) -> None:  # noqa: N802 - Qt name
        # Nothing is read while the window is away: the tray's idle cost stays as it was.
        self.timer.stop()
        super().hideEvent(event)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt name
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "shortcuts"):  # not while still being built
            theme.recolor_muted(self)

    # ----- inside ------------------------------------------------------------------------

    def _update_sources(self) -> None:
        sources = log_sources(self._status, self.app_log, worker_logs_in(self.app_log.parent))
        if sources == self.sources:
            return
        current = self.source
        self.sources = sources
        self.source_box.blockSignals(True)
        self.source_box.clear()
        for index, source in enumerate(sources):
            self.source_box.addItem(source.label)
            self.source_box.setItemData(index, str(source.path), Qt.ItemDataRole.ToolTipRole)
        paths = [s.path for s in sources]
        self.source_box.setCurrentIndex(paths.index(current.path) if current is not None and current.path in paths
                                        else 0)
        self.source_box.blockSignals(False)
        if self.source != current:
            self._on_source_chosen()

    def _on_source_chosen(self, _index: int = 0) -> None:
        source = self.source
        if source is None or (self.tail is not None and self.tail.path == source.path):
            return
        self.tail = LogTail(source.path, tail_bytes=TAIL_BYTES, max_lines=self.max_lines)
        self.view.clear()
        self._shown = 0
        self.poll()

    def _render_all(self, _filter: str = "") -> None:
        tail = self.tail
        if tail is None:
            return
        message = tail.message()
        shown = [] if message else filter_lines(tail.lines, self.filter_edit.text())
        self.view.setPlaceholderText(message or ("No line matches the filter" if tail.lines
                                                 else f"Nothing in {tail.path.name} yet"))
        self.view.setPlainText("\n".join(shown))
        self._shown = len(shown)
        where = str(tail.path) + (f" (its last {TAIL_BYTES // (1 << 20)} MiB)" if tail.truncated else "")
        self.path_label.setText(where)
        self._after_change(scroll=None)

    def _append(self, new: list[str]) -> None:
        shown = filter_lines(new, self.filter_edit.text())
        if shown:
            bar = self.view.verticalScrollBar()
            scroll = bar.value()
            self.view.appendPlainText("\n".join(shown))
            self._shown = min(self._shown + len(shown), self.max_lines)
            self._after_change(scroll=scroll)
        else:
            self._after_change(scroll=None)

    def _after_change(self, scroll: int | None) -> None:
        tail = self.tail
        kept = len(tail.lines) if tail is not None and tail.message() is None else 0
        self.count_label.setText(count_text(self._shown, kept, bool(self.filter_edit.text())) if kept else "")
        bar = self.view.verticalScrollBar()
        if self.follow_box.isChecked():
            bar.setValue(bar.maximum())
        elif scroll is not None:
            bar.setValue(scroll)  # appending would pull a view at the bottom along

    def _on_follow(self, on: bool) -> None:
        if on:
            bar = self.view.verticalScrollBar()
            bar.setValue(bar.maximum())

    def _focus_filter(self) -> None:
        self.filter_edit.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.filter_edit.selectAll()
