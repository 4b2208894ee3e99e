"""The settings dialog's API keys: listed with their scope, models, limit and
creation; added (the raw key shown once, with Copy) and revoked (after a
confirmation) in the keys file the service reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMessageBox

from tray_app.core.config import load_config
from tray_app.core.access.keys import KeyStore
from tray_app.ui import theme
from tray_app.ui.settings import SettingsDialog


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(tmp_path / "keys.json")


def open_settings(qtbot, tmp_path: Path, store: KeyStore) -> SettingsDialog:
    config_file = tmp_path / "config.toml"
    config_file.write_text("[gpu]\nreserve_mib = 300\n")
    dialog = SettingsDialog(load_config(config_file), keys=store)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def rows(dialog: SettingsDialog) -> list[list[str]]:
    table = dialog.keys.table
    return [[table.topLevelItem(i).text(c) for c in range(table.columnCount())]
            for i in range(table.topLevelItemCount())]


def test_keys_are_listed_with_scope_models_limit_and_creation(qtbot, tmp_path, store):
    store.add("notes-app", "inference", ("SmolLM2", "qwen"), 2, now=1_780_000_000)
    store.add("ops", "admin", now=1_780_000_000)
    dialog = open_settings(qtbot, tmp_path, store)
    listed = rows(dialog)
    assert [row[:4] for row in listed] == [["notes-app", "inference", "SmolLM2, qwen", "2 at once"],
                                            ["ops", "admin", "every model", "no limit"]]
    assert all(row[4].startswith("2026-") for row in listed)
    assert not dialog.keys.revoke_button.isEnabled()  # nothing selected yet


def test_adding_a_key_shows_it_once_with_copy_and_stores_only_its_hash(qtbot, tmp_path, store):
    dialog = open_settings(qtbot, tmp_path, store)
    assert rows(dialog)[0][0] == "No keys yet"
    qtbot.mouseClick(dialog.keys.add_button, Qt.MouseButton.LeftButton)
    add = dialog.keys.add_dialog
    assert add is not None and add.isVisible()
    qtbot.keyClicks(add.name, "open-webui")
    add.scope.setCurrentIndex(add.scope.findData("admin"))
    qtbot.keyClicks(add.models, "SmolLM2, SmolLM2 ,qwen")
    add.limit.setValue(3)
    add.accept()
    shown = dialog.keys.new_key_dialog
    assert shown is not None and shown.isVisible() and not add.isVisible()
    raw = shown.key.text()
    assert raw.startswith("tak_") and shown.key.isReadOnly()
    key = store.match(raw)
    assert key is not None and (key.name, key.scope, key.models, key.max_concurrency) == (
        "open-webui", "admin", ("SmolLM2", "qwen"), 3)
    assert raw not in (tmp_path / "keys.json").read_text()
    qtbot.mouseClick(shown.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == raw and shown.copy_button.text() == "Copied"
    assert [row[:4] for row in rows(dialog)] == [["open-webui", "admin", "SmolLM2, qwen", "3 at once"]]


@pytest.mark.parametrize(("name", "problem"), [("tray", "the tray's own key"), ("bad name!", "must be 1-64"),
                                               ("taken", "exists")])
def test_a_key_that_cant_be_added_says_why_and_the_dialog_stays(qtbot, tmp_path, store, name, problem):
    store.add("taken")
    dialog = open_settings(qtbot, tmp_path, store)
    dialog.keys.start_add()
    add = dialog.keys.add_dialog
    qtbot.keyClicks(add.name, name)
    add.accept()
    assert add.isVisible() and add.error.isVisible() and problem in add.error.text()
    assert dialog.keys.new_key_dialog is None and set(store.keys()) == {"taken"}


def test_revoking_asks_first_and_cancel_keeps_the_key(qtbot, tmp_path, store):
    store.add("old-app")
    store.add("kept")
    dialog = open_settings(qtbot, tmp_path, store)
    table = dialog.keys.table
    table.setCurrentItem(table.findItems("old-app", Qt.MatchFlag.MatchExactly)[0])
    assert dialog.keys.revoke_button.isEnabled()
    qtbot.mouseClick(dialog.keys.revoke_button, Qt.MouseButton.LeftButton)
    box = dialog.keys.confirm_revoke
    assert box is not None and box.isVisible() and "old-app" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert set(store.keys()) == {"old-app", "kept"}
    qtbot.mouseClick(dialog.keys.revoke_button, Qt.MouseButton.LeftButton)
    box = dialog.keys.confirm_revoke
    next(b for b in box.buttons() if box.buttonRole(b) == QMessageBox.ButtonRole.DestructiveRole).click()
    assert set(store.keys()) == {"kept"}
    assert [row[0] for row in rows(dialog)] == ["kept"]


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_the_keys_section_renders_in_light_and_dark(qtbot, qapp, tmp_path, store, dark):
    store.add("open-webui", "inference", ("SmolLM2-135M-Instruct.Q4_1",), 2, now=1_780_000_000)
    store.add("phone", "inference", now=1_780_000_000)
    store.add("household-admin", "admin", now=1_780_000_000)
    style, palette = qapp.style().name(), qapp.palette()
    if dark:
        theme.use_dark_fusion(qapp)
    try:
        dialog = open_settings(qtbot, tmp_path, store)
        image = dialog.keys.grab().toImage()
        assert not image.isNull() and image.save(str(tmp_path / "keys.png"))
        # The table's text is readable on its background in either theme.
        table = dialog.keys.table
        text, base = theme.rgb(table.palette().text().color()), theme.rgb(table.palette().base().color())
        from tray_app.ui import colors
        assert colors.contrast_ratio(text, base) >= colors.TEXT_CONTRAST
    finally:
        qapp.setStyle(style)
        qapp.setPalette(palette)
