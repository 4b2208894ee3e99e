"""The log viewer on real files: tailing with follow, the filter, rotation,
a missing file, copying, switching logs, and no polling while hidden.
No service needed: the viewer is given /status snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QApplication, QCheckBox, QLabel, QPushButton

from tests.status_sample import conforming
from tray_app.core.config import Config
from tray_app.ui import windows as windows_module
from tray_app.ui.app import TrayController
from tray_app.ui.client import ServiceClient
from tray_app.ui.logs import LogViewer

DEAD_URL = "http://127.0.0.1:9"  # never started: the tests feed snapshots
WAIT_MS = 5000


def status_with_workers(folder: Path) -> dict:
    return conforming({"service": {"model": "qwen"},
                       "workers": [{"role": "gpu", "log": str(folder / "gpu-worker.log")},
                                   {"role": "cpu", "log": str(folder / "cpu-worker.log")}],
                       "models": [{"name": "qwen", "logs": {"gpu": str(folder / "gpu-worker.log"),
                                                            "cpu": str(folder / "cpu-worker.log")}}]})


def append(path: Path, *lines: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.writelines(f"{line}\n" for line in lines)


@pytest.fixture
def app_log(tmp_path: Path) -> Path:
    path = tmp_path / "tray-app.log"
    append(path, *(f"start line {i}" for i in range(300)))
    return path


@pytest.fixture
def viewer(qtbot, app_log: Path):
    def make(status: dict | None = None) -> LogViewer:
        window = LogViewer(app_log, status, poll_ms=20)
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        return window

    return make


def shown_lines(window: LogViewer) -> list[str]:
    text = window.shown_text()
    return text.split("\n") if text else []


def test_appended_lines_appear_and_follow_keeps_the_end_in_view(qtbot, viewer, app_log) -> None:
    window = viewer()
    assert window.source.label == "Tray app" and window.follow_box.isChecked()
    assert shown_lines(window)[-1] == "start line 299" and window.count_label.text() == "300 lines"
    append(app_log, "a new line", "and another")
    qtbot.waitUntil(lambda: shown_lines(window)[-1] == "and another", timeout=WAIT_MS)
    assert window.count_label.text() == "302 lines"
    bar = window.view.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == bar.maximum()


def test_without_follow_the_view_stays_where_it_is(qtbot, viewer, app_log) -> None:
    window = viewer()
    window.follow_box.setChecked(False)
    bar = window.view.verticalScrollBar()
    bar.setValue(bar.maximum())  # at the end, where appending would pull the view along
    at = bar.value()
    append(app_log, *(f"more {i}" for i in range(100)))
    qtbot.waitUntil(lambda: shown_lines(window)[-1] == "more 99", timeout=WAIT_MS)
    assert bar.value() == at < bar.maximum()
    window.follow_box.setChecked(True)
    assert bar.value() == bar.maximum()


def test_the_filter_shows_only_matching_lines_and_counts_them(qtbot, viewer, app_log) -> None:
    window = viewer()
    window.filter_edit.setText("LINE 29")  # any case: 29, 290-299
    assert shown_lines(window) == ["start line 29", *(f"start line {i}" for i in range(290, 300))]
    assert window.count_label.text() == "11 of 300 lines"
    # New lines go through the same filter.
    append(app_log, "unrelated", "Line 29 again")
    qtbot.waitUntil(lambda: window.count_label.text() == "12 of 302 lines", timeout=WAIT_MS)
    assert shown_lines(window)[-1] == "Line 29 again"
    window.filter_edit.setText("nothing like this")
    assert shown_lines(window) == [] and window.count_label.text() == "0 of 302 lines"
    assert window.view.placeholderText() == "No line matches the filter"
    window.filter_edit.clear()
    assert len(shown_lines(window)) == 302


def test_a_truncated_or_rotated_log_is_read_again(qtbot, viewer, app_log) -> None:
    window = viewer()
    app_log.write_text("after truncation\n")
    qtbot.waitUntil(lambda: shown_lines(window) == ["after truncation"], timeout=WAIT_MS)
    app_log.rename(app_log.with_suffix(".log.1"))
    append(app_log, "rotated 1", "rotated 2")
    qtbot.waitUntil(lambda: shown_lines(window) == ["rotated 1", "rotated 2"], timeout=WAIT_MS)
    assert window.count_label.text() == "2 lines"


def test_a_missing_log_says_so_until_it_is_written(qtbot, tmp_path) -> None:
    missing = tmp_path / "none" / "tray-app.log"
    window = LogViewer(missing, poll_ms=20)
    qtbot.addWidget(window)
    window.show()
    assert shown_lines(window) == [] and window.view.placeholderText() == f"No log yet at {missing}"
    assert window.count_label.text() == ""
    missing.parent.mkdir()
    append(missing, "first words")
    qtbot.waitUntil(lambda: shown_lines(window) == ["first words"], timeout=WAIT_MS)
    assert window.path_label.text() == str(missing)


def test_ctrl_c_copies_the_selection_and_the_button_copies_all_shown(qtbot, viewer) -> None:
    window = viewer()
    window.activateWindow()
    window.view.setFocus()
    cursor = window.view.textCursor()
    cursor.movePosition(QTextCursor.MoveOperation.Start)
    cursor.movePosition(QTextCursor.MoveOperation.Down, QTextCursor.MoveMode.KeepAnchor, 2)
    cursor.movePosition(QTextCursor.MoveOperation.EndOfLine, QTextCursor.MoveMode.KeepAnchor)
    window.view.setTextCursor(cursor)
    clipboard = QApplication.clipboard()
    clipboard.clear()
    qtbot.keyClick(window.view, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    assert clipboard.text() == "start line 0\nstart line 1\nstart line 2"
    window.filter_edit.setText("line 29")
    window.copy_button.click()
    assert clipboard.text().split("\n") == shown_lines(window) and len(shown_lines(window)) == 11


def test_switching_to_a_worker_log_and_new_workers_from_status(qtbot, viewer, tmp_path) -> None:
    append(tmp_path / "gpu-worker.log", "llama server listening", "slot 0: prompt done")
    window = viewer(status_with_workers(tmp_path))
    labels = [window.source_box.itemText(i) for i in range(window.source_box.count())]
    assert labels == ["Tray app", "GPU worker", "CPU worker"]
    window.source_box.setCurrentIndex(1)
    assert shown_lines(window) == ["llama server listening", "slot 0: prompt done"]
    assert window.path_label.text() == str(tmp_path / "gpu-worker.log")
    window.source_box.setCurrentIndex(2)
    assert window.view.placeholderText() == f"No log yet at {tmp_path / 'cpu-worker.log'}"
    # A second model's workers: labelled by model; what is shown stays chosen.
    status = status_with_workers(tmp_path)
    status["models"].append({"name": "llama", "logs": {"cpu": str(tmp_path / "cpu-llama-worker.log")}})
    window.set_status(status)
    labels = [window.source_box.itemText(i) for i in range(window.source_box.count())]
    assert labels == ["Tray app", "GPU worker (qwen)", "CPU worker (qwen)", "CPU worker (llama)"]
    assert window.source.label == "CPU worker (qwen)"
    assert window.source_box.itemData(3, Qt.ItemDataRole.ToolTipRole) == str(tmp_path / "cpu-llama-worker.log")


def test_nothing_is_polled_while_the_window_is_hidden(qtbot, viewer, app_log) -> None:
    window = viewer()
    assert window.timer.isActive()
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=WAIT_MS)
    qtbot.keyClick(window.filter_edit, Qt.Key.Key_Escape)  # Esc closes, from any field
    assert not window.isVisible() and not window.timer.isActive()
    append(app_log, "written while hidden")
    window.set_status(status_with_workers(app_log.parent))  # kept, not acted on, while hidden
    assert window.source_box.count() == 1
    qtbot.wait(100)
    assert shown_lines(window)[-1] == "start line 299"
    window.show()
    assert window.timer.isActive() and window.source_box.count() == 3
    assert shown_lines(window)[-1] == "written while hidden"


def test_alt_letters_are_unique_and_everything_has_a_tooltip(viewer) -> None:
    window = viewer()
    texts = [w.text() for kind in (QLabel, QPushButton, QCheckBox) for w in window.findChildren(kind)
             if "&" in w.text()]
    letters = [t.lower().split("&")[1][0] for t in texts]
    assert len(texts) == 5 and len(set(letters)) == 5, texts
    for widget in (window.source_box, window.filter_edit, window.view, window.follow_box, window.copy_button,
                   window.folder_button):
        assert widget.toolTip()


def test_the_tray_menu_opens_one_viewer_fed_by_the_status(qtbot, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(windows_module, "log_dir", lambda: tmp_path)
    append(tmp_path / "tray-app.log", "tray started")
    client = ServiceClient(DEAD_URL)
    controller = TrayController(client, Config(), tray_available=False)
    assert controller.tray_menu.view_logs_action in controller.tray_menu.menu.actions()
    assert controller.tray_menu.view_logs_action in controller.tray_menu.more_menu.actions()
    controller.tray_menu.view_logs_action.trigger()
    window = controller.windows.logs_window
    qtbot.addWidget(window)
    assert window.isVisible() and shown_lines(window) == ["tray started"]
    client.status_changed.emit(status_with_workers(tmp_path))
    assert window.source_box.count() == 3
    controller.windows.show_logs()
    assert controller.windows.logs() is window
    window.hide()
