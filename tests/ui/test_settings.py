"""The settings dialog: bad values get a message next to their field and are
not saved; good ones are written to the config file (and only they)."""

from __future__ import annotations

import sys
import threading
import tomllib
from pathlib import Path

import pytest

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLineEdit, QSpinBox

from tray_app.core.config import apply_overrides, bundled_model_path, load_config
from tray_app.ui import viewmodel as vm
from tray_app.ui.settings import SettingsDialog

FILE_TEXT = "[gpu]\nreserve_mib = 300\n"


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(FILE_TEXT)
    return path


@pytest.fixture
def dialog(qtbot, config_file: Path):
    # This run also has a command-line override, which must not end up in the file.
    config = apply_overrides(load_config(config_file), {"gpu": {"simulate_mib": 2048}})
    dialog = SettingsDialog(config)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def save(qtbot, dialog) -> bool:
    """Press Save and wait for its answer: the values are checked off the GUI thread."""
    with qtbot.waitSignal(dialog.save_finished, timeout=10_000) as finished:
        dialog.save()
    return finished.args[0]


# Numbers can't be typed out of range any more (spin boxes, tested below);
# the viewmodel's checks of such text are in test_viewmodel.py.
@pytest.mark.parametrize(("field", "value", "message"), [
    ("model_path", "/no/such/model.gguf", "model file /no/such/model.gguf does not exist"),
    ("fallback_path", sys.executable, "is not a GGUF file"),
])
def test_an_invalid_value_is_shown_next_to_its_field_and_not_saved(qtbot, dialog, config_file, field, value,
                                                                   message) -> None:
    saved: list = []
    dialog.saved.connect(lambda *args: saved.append(args))
    dialog.edits[field].setText(value)
    assert save(qtbot, dialog) is False
    error = dialog.errors[field]
    assert error.isVisible()
    assert message in error.text()
    # Only that field complains.
    assert [name for name, label in dialog.errors.items() if label.isVisible()] == [field]
    assert dialog.isVisible()
    assert saved == []
    assert config_file.read_text() == FILE_TEXT
    # Editing the field clears its message.
    dialog.edits[field].setFocus()
    qtbot.keyClick(dialog.edits[field], "1")
    assert not error.isVisible()


def test_several_bad_fields_each_get_their_own_message(qtbot, dialog, config_file) -> None:
    dialog.edits["model_path"].setText("/no/such/model.gguf")
    dialog.edits["fallback_path"].setText(sys.executable)
    assert save(qtbot, dialog) is False
    assert "does not exist" in dialog.errors["model_path"].text()
    assert "is not a GGUF file" in dialog.errors["fallback_path"].text()
    assert not dialog.errors["cpu_ctx"].isVisible()
    assert config_file.read_text() == FILE_TEXT


def test_numbers_are_spin_boxes_within_the_config_bounds(qtbot, dialog, config_file) -> None:
    numbers = [f for f in vm.SETTINGS_FIELDS if f.kind == "int"]
    assert {f.name for f in numbers} == {"gpu_ctx", "cpu_ctx", "reserve", "gpu_layers", "port", "idle_unload"}
    for field in numbers:
        box = dialog.edits[field.name]
        assert isinstance(box, QSpinBox), field.name
        assert (box.minimum(), box.maximum()) == vm.setting_bounds(field)
    # [gpu|cpu] n_ctx: 0 sizes the context from memory, and the box says so.
    assert (dialog.edits["gpu_ctx"].minimum(), dialog.edits["cpu_ctx"].minimum()) == (0, 0)
    assert dialog.edits["gpu_ctx"].specialValueText() == dialog.edits["cpu_ctx"].specialValueText() == "auto"
    assert dialog.edits["reserve"].minimum() == 0
    assert (dialog.edits["port"].minimum(), dialog.edits["port"].maximum()) == (1, 65535)
    assert dialog.edits["gpu_layers"].minimum() == -1
    assert dialog.edits["gpu_layers"].specialValueText()  # -1 means all: it says so
    assert dialog.edits["idle_unload"].specialValueText() == "never (0)"
    assert dialog.edits["idle_unload"].value() == 300
    assert dialog.edits["gpu_ctx"].maximum() == 2**31 - 1  # llama.cpp takes a C int
    assert all(isinstance(dialog.edits[f.name], QLineEdit) for f in vm.SETTINGS_FIELDS if f.kind == "path")
    # Typing past a bound, or letters, can't produce a value the config refuses.
    port = dialog.edits["port"]
    port.setFocus()
    port.selectAll()
    qtbot.keyClicks(port, "99999x")
    qtbot.keyClick(port, Qt.Key.Key_Return)
    assert 1 <= port.value() <= 65535
    context = dialog.edits["gpu_ctx"]
    context.setFocus()
    context.selectAll()
    qtbot.keyClicks(context, "10")
    context.interpretText()
    context.clearFocus()
    # 10 is inside the box's range (0 = auto) but no context: the field's error says what is.
    assert context.value() == 10
    errors = vm.validate_settings(dialog.config, dialog.values())[1]
    assert "0 (sized from memory) or at least 64" in errors["gpu_ctx"]


def test_a_field_label_moves_the_focus_to_its_input(dialog) -> None:
    from PySide6.QtWidgets import QLabel

    labels = {label.buddy().objectName(): label.text() for label in dialog.findChildren(QLabel) if label.buddy()}
    assert labels == {f.name: f.label for f in vm.SETTINGS_FIELDS}
    letters = [label.lower().split("&")[1][0] for label in labels.values()]
    assert len(set(letters)) == len(letters)  # each Alt+letter is unique


def test_valid_changes_are_saved_and_handed_on(qtbot, dialog, config_file) -> None:
    model = str(bundled_model_path())
    dialog.edits["cpu_ctx"].setValue(1024)
    dialog.edits["port"].setValue(18999)
    dialog.edits["model_path"].setText(model)
    with qtbot.waitSignal(dialog.saved, timeout=5000) as saved:
        assert save(qtbot, dialog) is True
    new_config, changes = saved.args
    assert changes == {"cpu": {"n_ctx": 1024}, "server": {"port": 18999}, "model": {"path": model}}
    assert new_config.cpu.n_ctx == 1024 and new_config.server.port == 18999
    assert new_config.gpu.simulate_mib == 2048  # the running config keeps this run's flags
    on_disk = tomllib.loads(config_file.read_text())
    assert on_disk["cpu"]["n_ctx"] == 1024
    assert on_disk["server"]["port"] == 18999
    assert on_disk["model"]["path"] == model
    assert on_disk["gpu"]["reserve_mib"] == 300        # kept from the file
    assert on_disk["gpu"]["simulate_mib"] == 0          # the flag was not written
    assert config_file.stat().st_mode & 0o777 == 0o600
    assert not dialog.isVisible()


def test_saving_nothing_changed_writes_nothing(qtbot, dialog, config_file) -> None:
    saved: list = []
    dialog.saved.connect(lambda *args: saved.append(args))
    assert save(qtbot, dialog) is True
    assert saved == []
    assert config_file.read_text() == FILE_TEXT


def test_without_a_file_it_saves_to_the_default_place(qtbot, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    from tray_app.core.config import Config, default_config_path

    dialog = SettingsDialog(Config())
    qtbot.addWidget(dialog)
    assert str(default_config_path()) in dialog.note.text()
    dialog.edits["gpu_ctx"].setValue(2048)
    assert save(qtbot, dialog) is True
    assert tomllib.loads(default_config_path().read_text())["gpu"]["n_ctx"] == 2048


def test_model_files_are_read_off_the_gui_thread(qtbot, dialog, config_file, parser_threads) -> None:
    # A stranger's model file can take seconds to read; the GUI must not wait for it.
    dialog.edits["model_path"].setText(str(bundled_model_path()))
    dialog.edits["fallback_path"].setText(sys.executable)
    assert save(qtbot, dialog) is False
    assert len(parser_threads) == 2
    assert threading.main_thread() not in parser_threads
    assert "is not a GGUF file" in dialog.errors["fallback_path"].text()
    assert not dialog.errors["model_path"].isVisible()
    assert config_file.read_text() == FILE_TEXT


def test_save_cannot_be_pressed_again_while_checking(qtbot, dialog, config_file) -> None:
    dialog.edits["model_path"].setText(str(bundled_model_path()))
    with qtbot.waitSignal(dialog.save_finished, timeout=10_000) as finished:
        dialog.save()
        check = dialog.pending_check
        assert check is not None and not dialog.save_button.isEnabled()
        dialog.save()  # a second press joins the check under way
        assert dialog.pending_check is check
    assert finished.args == [True]
    assert dialog.save_button.isEnabled()
    assert tomllib.loads(config_file.read_text())["model"]["path"] == str(bundled_model_path())


def test_cancel_while_checking_saves_nothing(qtbot, dialog, config_file) -> None:
    outcomes: list = []
    dialog.saved.connect(lambda *args: outcomes.append(("saved", args)))
    dialog.save_finished.connect(lambda ok: outcomes.append(("finished", ok)))
    dialog.edits["port"].setValue(18998)
    dialog.save()
    check = dialog.pending_check
    # The answer reaches the GUI thread only through its event loop, so it
    # cannot arrive before this reject().
    with qtbot.waitSignal(check.delivered, timeout=10_000):
        dialog.reject()
    assert outcomes == []
    assert config_file.read_text() == FILE_TEXT
    assert dialog.pending_check is None and dialog.save_button.isEnabled()


def test_values_edited_while_checking_are_checked_again(qtbot, dialog, config_file) -> None:
    dialog.edits["port"].setValue(18998)
    with qtbot.waitSignal(dialog.save_finished, timeout=10_000) as finished:
        dialog.save()
        # Typed before the first check could answer (it answers through the event loop).
        dialog.edits["model_path"].setText("/no/such/model.gguf")
    assert finished.args == [False]
    assert "does not exist" in dialog.errors["model_path"].text()
    assert config_file.read_text() == FILE_TEXT



def test_giving_vram_to_games_and_the_idle_unload_are_saved(qtbot, dialog, config_file) -> None:
    from PySide6.QtWidgets import QCheckBox

    box = dialog.edits["yield"]
    assert isinstance(box, QCheckBox) and box.isChecked()  # on by default
    box.setChecked(False)
    dialog.edits["idle_unload"].setValue(0)
    overrides, errors = vm.validate_settings(dialog.config, dialog.values())
    assert errors == {}
    assert overrides["gpu"]["yield_to_other_apps"] is False and overrides["gpu"]["idle_unload_s"] == 0
