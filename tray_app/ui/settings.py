"""The settings dialog: model paths, context caps, reserve, port, GPU layers.

Each value is checked with the core's own rules (apply_overrides, and
read_model_info for model files) on a worker thread, since reading a model
header can take seconds; a bad one gets its message next to its field and
nothing is saved. Save writes only the changed keys into the config
file (so command-line flags of this run are not persisted) and hands the new
config to whoever restarts the service.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import shiboken6
from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractSpinBox, QCheckBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
    QPushButton, QSpinBox, QVBoxLayout, QWidget,
)

from ..core.config import Config, ConfigError, apply_overrides, default_config_path, load_config, save_config
from . import colors
from . import theme
from . import viewmodel as vm
from .background import BackgroundCall
from .icons import state_icon
from .widgets import plain_label
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

GGUF_FILTER = "GGUF models (*.gguf);;All files (*)"


def choose_model_file(parent: QWidget | None, start: str = "") -> str:
    path, _ = QFileDialog.getOpenFileName(parent, "Choose a model (GGUF)", start or str(Path.home()), GGUF_FILTER)
    return path


def save_changes(config: Config, changes: dict[str, dict[str, Any]]) -> tuple[Config, Path]:
    """Write `changes` into the config file this run came from (or the default
    one) and return (the running config with the changes, the file)."""
    target = config.source or default_config_path()
    on_disk = load_config(target) if target.exists() else Config(source=target)
    written = save_config(apply_overrides(on_disk, changes), target)
    return apply_overrides(config, changes), written


class SettingsDialog(QDialog):
    # (the new config, the changed keys) after a successful save
    saved = Signal(object, object)
    # Once a save() has been checked: True if it saved (or had nothing to save), False if not.
    save_finished = Signal(bool)

    def __init__(self, config: Config, *, can_apply: bool = True, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.config = config
        # The check of the values save() was called with, while it runs.
        self.pending_check: BackgroundCall | None = None
        self.setWindowTitle("tray-app: settings")
        self.setWindowIcon(state_icon(vm.GPU))
        self.setMinimumWidth(620)
        root = QVBoxLayout(self)
        root.setSpacing(10)
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
        form.setVerticalSpacing(8)
        # One input per field: a line for a path, a spin box for a number.
        self.edits: dict[str, QLineEdit | QSpinBox | QCheckBox] = {}
        self.errors: dict[str, QLabel] = {}
        values = vm.settings_values(config)
        error_color = colors.status_color("error", theme.current_palette().window)
        for field in vm.SETTINGS_FIELDS:
            if field.kind == "int":
                edit = self._number_box(field, values[field.name])
            elif field.kind == "check":
                edit = self._check_box(field, values[field.name])
            else:
                edit = self._path_line(field, values[field.name])
            edit.setObjectName(field.name)
            edit.setToolTip(field.help)
            error = plain_label()  # may quote what was typed
            error.setObjectName(f"{field.name}_error")
            error.setWordWrap(True)
            theme.set_text_color(error, error_color)
            error.hide()
            help_label = QLabel(field.help)
            help_label.setWordWrap(True)
            small = help_label.font()
            small.setPointSizeF(small.pointSizeF() * 0.9)
            help_label.setFont(small)
            theme.set_muted_text(help_label)
            cell = QVBoxLayout()
            cell.setSpacing(2)
            line = QHBoxLayout()
            line.addWidget(edit, 1)
            if field.kind == "path":
                browse = QPushButton("Browse…")
                browse.clicked.connect(lambda _=False, e=edit: self._browse(e))
                line.addWidget(browse)
            else:
                # A spin box stays narrow; the stretch lets the row (and the
                # help text under it) still take the dialog's whole width.
                line.addStretch(1)
            cell.addLayout(line)
            cell.addWidget(error)
            cell.addWidget(help_label)
            label = QLabel(field.label)
            label.setBuddy(edit)  # its Alt+letter moves the focus to the input
            form.addRow(label, cell)
            self.edits[field.name] = edit
            self.errors[field.name] = error
        root.addLayout(form)
        self.form_error = plain_label()
        theme.set_text_color(self.form_error, error_color)
        self.form_error.setWordWrap(True)
        self.form_error.hide()
        root.addWidget(self.form_error)
        where = config.source or default_config_path()
        note = f"Saved to {where}. Changes restart the service and its workers."
        if not can_apply:
            note = f"Saved to {where}. Restart the service to apply the changes."
        self.note = plain_label(note)
        self.note.setWordWrap(True)
        theme.set_muted_text(self.note)
        root.addWidget(self.note)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        self.save_button.setText("&Save and restart" if can_apply else "&Save")
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        root.addWidget(buttons)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt name
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "note"):  # not while still being built
            error_color = colors.status_color("error", theme.current_palette().window)
            for label in (*self.errors.values(), self.form_error):
                theme.set_text_color(label, error_color)
            theme.recolor_muted(self)

    def _path_line(self, field: vm.SettingField, value: str) -> QLineEdit:
        edit = QLineEdit(value)
        edit.setPlaceholderText("bundled SmolLM2-135M-Instruct" if field.name == "model_path" else "same as the model")
        edit.textEdited.connect(lambda _text, name=field.name: self._clear_error(name))
        return edit

    def _check_box(self, field: vm.SettingField, value: str) -> QCheckBox:
        box = QCheckBox()
        box.setChecked(value == "true")
        box.toggled.connect(lambda _checked, name=field.name: self._clear_error(name))
        return box

    def _number_box(self, field: vm.SettingField, value: str) -> QSpinBox:
        """A spin box within the bounds the config enforces: an out-of-range
        or non-numeric value cannot be typed in the first place."""
        box = QSpinBox()
        low, high = vm.setting_bounds(field)
        box.setRange(low, high)
        box.setValue(min(max(int(value), low), high))
        if field.minimum_text:
            box.setSpecialValueText(field.minimum_text)
        box.setAccelerated(True)
        box.setCorrectionMode(QAbstractSpinBox.CorrectionMode.CorrectToNearestValue)
        # As wide as a typical value needs, not as wide as 2,147,483,647.
        box.setMinimumWidth(box.fontMetrics().horizontalAdvance("0" * 9) + 40)
        box.setMaximumWidth(box.fontMetrics().horizontalAdvance("0" * 12) + 40)
        box.valueChanged.connect(lambda _value, name=field.name: self._clear_error(name))
        return box

    def values(self) -> dict[str, str]:
        """Every field as text, which is what the viewmodel checks."""
        return {name: _text_of(edit) for name, edit in self.edits.items()}

    def _browse(self, edit: QLineEdit) -> None:
        path = choose_model_file(self, edit.text())
        if path:
            edit.setText(path)
            self._clear_error(edit.objectName())

    def _clear_error(self, name: str) -> None:
        self.errors[name].hide()
        self.form_error.hide()

    def show_errors(self, errors: dict[str, str]) -> None:
        for name, label in self.errors.items():
            message = errors.get(name)
            label.setText(message or "")
            label.setVisible(bool(message))
        self.form_error.setText(errors.get("_form", ""))
        self.form_error.setVisible("_form" in errors)
        for name in self.edits:
            if name in errors:
                self.edits[name].setFocus()
                break

    def save(self) -> None:
        """Check the values off the GUI thread, then save them or show what is
        wrong; `save_finished` tells which."""
        if self.pending_check is not None:
            return  # Save pressed again: the check under way answers for both
        self.save_button.setEnabled(False)
        self._check(self.values())

    def _check(self, values: dict[str, str]) -> None:
        config = self.config
        call: BackgroundCall | None = None

        def on_done(future: Future) -> None:
            self._on_checked(call, values, future)

        call = BackgroundCall(lambda: vm.validate_settings(config, values), on_done)
        self.pending_check = call

    def _on_checked(self, call: BackgroundCall | None, values: dict[str, str], future: Future) -> None:
        if not shiboken6.isValid(self) or call is not self.pending_check:
            return  # the dialog was cancelled (or deleted) while the check ran
        if self.values() != values:
            self._check(self.values())  # edited while being checked: the new values are the ones to save
            return
        self.pending_check = None
        self.save_button.setEnabled(True)
        self.save_finished.emit(self._save_checked(*future.result()))

    def reject(self) -> None:
        self.pending_check = None  # its answer no longer matters
        self.save_button.setEnabled(True)
        super().reject()

    def _save_checked(self, overrides: dict[str, dict[str, Any]], errors: dict[str, str]) -> bool:
        if errors:
            self.show_errors(errors)
            return False
        self.show_errors({})
        changes = vm.changed_overrides(self.config, overrides)
        if not changes:
            self.accept()
            return True
        try:
            new_config, _ = save_changes(self.config, changes)
        except (ConfigError, OSError) as exc:
            self.show_errors({"_form": f"not saved: {exc}"})
            return False
        self.config = new_config
        self.saved.emit(new_config, changes)
        self.accept()
        return True


def _text_of(edit: QLineEdit | QSpinBox | QCheckBox) -> str:
    if isinstance(edit, QSpinBox):
        return str(edit.value())
    if isinstance(edit, QCheckBox):
        return "true" if edit.isChecked() else "false"
    return edit.text()
