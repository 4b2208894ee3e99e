"""The settings dialog: model paths, context caps, reserve, port, GPU layers,
and the service's API keys (added and revoked at once, not on Save).

Each value is checked with the core's own rules (apply_overrides, and
read_model_info for model files) on a worker thread, since reading a model
header can take seconds; a bad one gets its message next to its field and
nothing is saved. Save writes only the changed keys into the config
file (so command-line flags of this run are not persisted) and hands the new
config to whoever restarts the service.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable

import shiboken6
from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QAbstractSpinBox, QCheckBox, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
    QHBoxLayout, QHeaderView, QLabel, QLineEdit, QMessageBox, QPushButton, QSpinBox, QTabWidget, QTreeWidget,
    QTreeWidgetItem, QVBoxLayout, QWidget,
)

from ..core.config import Config, ConfigError, apply_overrides, default_config_path, load_config, save_config
from ..core.access.keys import ApiKey, KeyProblem, KeyStore
from ..core.api.security import effective_api_key
from . import colors
from . import theme
from . import viewmodel as vm
from .background import BackgroundCall
from .icons import state_icon
from .widgets import as_written, plain_label
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

    def __init__(self, config: Config, *, can_apply: bool = True, keys: KeyStore | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.config = config
        # The check of the values save() was called with, while it runs.
        self.pending_check: BackgroundCall | None = None
        self.setWindowTitle("tray-app: settings")
        self.setWindowIcon(state_icon(vm.GPU))
        self.setMinimumWidth(620)
        outer = QVBoxLayout(self)
        # Two tabs: the service's settings (saved with Save, then a restart)
        # and its API keys (changed at once), so neither squeezes the other
        # on a short screen.
        self.tabs = QTabWidget()
        outer.addWidget(self.tabs)
        service_tab = QWidget()
        root = QVBoxLayout(service_tab)
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
        root.addStretch(1)
        self.tabs.addTab(service_tab, "&Service")
        self.keys = KeysSection(keys or KeyStore(), self,
                                legacy_key_set=bool(effective_api_key(config.server.api_key)))
        self.tabs.addTab(self.keys, "API &keys")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        self.save_button.setText("&Save and restart" if can_apply else "&Save")
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        outer.addWidget(buttons)

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


# ----- API keys ---------------------------------------------------------------------------------
# The named keys of this computer's service (core/access/keys.py), managed here as
# `tray-app keys` does from a shell: the tray's service runs in this process
# and reads the same keys file (re-read on its mtime), so a key added or
# revoked here counts on the service's next request, without Save.

NO_LIMIT_TEXT = "no limit"
MODELS_COLUMN = 2
# Room between columns sized to their contents: without it a long name runs into its scope.
COLUMN_GAP_PX = 18


def key_rows(keys: Iterable[ApiKey]) -> list[tuple[str, str, str, str, str]]:
    """(name, scope, models, limit, created) of each key, by name, as the table shows them."""
    rows = []
    for key in sorted(keys, key=lambda key: key.name.lower()):
        models = ", ".join(key.models) if key.models else "every model"
        limit = f"{key.max_concurrency} at once" if key.max_concurrency is not None else NO_LIMIT_TEXT
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(key.created)) if key.created else "unknown"
        rows.append((key.name, key.scope, models, limit, created))
    return rows


def models_from_text(text: str) -> tuple[str, ...]:
    """The models field: names separated by commas; empty for every model."""
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))


class AddKeyDialog(QDialog):
    """Name, scope, models and concurrency of a new key. The section adds it
    when this is accepted, and shows a problem here (it stays open) if the
    key store refuses it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("tray-app: add an API key")
        form = QFormLayout(self)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
        self.name = QLineEdit()
        self.name.setObjectName("key_name")
        self.name.setPlaceholderText("the app's name, e.g. open-webui")
        self.scope = QComboBox()
        self.scope.setObjectName("key_scope")
        self.scope.addItem("inference: uses the API", "inference")
        self.scope.addItem("admin: also the controls (GPU, models, restart, others' cancel)", "admin")
        self.models = QLineEdit()
        self.models.setObjectName("key_models")
        self.models.setPlaceholderText("every model")
        self.models.setToolTip("The models this key may use, as /v1/models names them, separated by commas; "
                               "empty: every model")
        self.limit = QSpinBox()
        self.limit.setObjectName("key_limit")
        self.limit.setRange(0, 1024)
        self.limit.setSpecialValueText(NO_LIMIT_TEXT)  # 0
        self.error = plain_label()  # quotes the name that was typed
        self.error.setObjectName("key_error")
        self.error.setWordWrap(True)
        theme.set_text_color(self.error, colors.status_color("error", theme.current_palette().window))
        self.error.hide()
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("&Add key")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        for label, field in (("&Name", self.name), ("&Scope", self.scope), ("&Models", self.models),
                             ("Max &concurrent requests", self.limit)):
            title = QLabel(label)
            title.setBuddy(field)
            form.addRow(title, field)
            if field is self.models:
                hint = QLabel("Names as /v1/models lists them, separated by commas; empty: every model")
                theme.set_muted_text(hint)
                form.addRow("", hint)
        form.addRow(self.error)
        form.addRow(buttons)
        self.name.textEdited.connect(lambda _text: self.error.hide())

    def values(self) -> tuple[str, str, tuple[str, ...], int | None]:
        """(name, scope, models, max_concurrency) as the key store takes them."""
        limit = self.limit.value()
        return self.name.text().strip(), self.scope.currentData(), models_from_text(self.models.text()), limit or None

    def show_error(self, message: str) -> None:
        self.error.setText(message)
        self.error.show()
        self.name.setFocus()


class NewKeyDialog(QDialog):
    """A new key, shown this once: only its hash is kept."""

    def __init__(self, name: str, raw_key: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("tray-app: new API key")
        layout = QVBoxLayout(self)
        note = plain_label(f"The key for {name!r}. Copy it into the app now: only its hash is stored, so it "
                           "can't be shown again (revoke it and add a new one if it is lost).")
        note.setWordWrap(True)
        layout.addWidget(note)
        line = QHBoxLayout()
        self.key = QLineEdit(raw_key)
        self.key.setObjectName("new_key")
        self.key.setReadOnly(True)
        self.key.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.key.setMinimumWidth(self.key.fontMetrics().horizontalAdvance(raw_key) + 24)
        self.key.selectAll()
        self.copy_button = QPushButton("&Copy")
        self.copy_button.setObjectName("copy_key")
        self.copy_button.clicked.connect(self.copy)
        line.addWidget(self.key, 1)
        line.addWidget(self.copy_button)
        layout.addLayout(line)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.key.text())
        self.copy_button.setText("Copied")


class KeysSection(QWidget):
    """The keys table with Add and Revoke (the settings' "API keys" tab).
    Dialogs open without blocking (open(), not exec()); each is kept on the
    section while it is up."""

    changed = Signal()  # a key was added or revoked

    def __init__(self, store: KeyStore, parent: QWidget | None = None, legacy_key_set: bool = False) -> None:
        super().__init__(parent)
        self.store = store
        self.legacy_key_set = legacy_key_set  # [server] api_key: the last named admin key may go
        self.add_dialog: AddKeyDialog | None = None
        self.new_key_dialog: NewKeyDialog | None = None
        self.confirm_revoke: QMessageBox | None = None
        layout = QVBoxLayout(self)
        about = QLabel("A key per app: an inference key uses the API, an admin key also the controls. "
                       "Changes here take effect at once; the service reads the same keys file.")
        about.setWordWrap(True)
        theme.set_muted_text(about)
        layout.addWidget(about)
        self.table = QTreeWidget()
        self.table.setObjectName("keys_table")
        self.table.setHeaderLabels(["Name", "Scope", "Models", "Limit", "Created"])
        self.table.setRootIsDecorated(False)
        self.table.setUniformRowHeights(True)
        self.table.setAllColumnsShowFocus(True)
        self.table.header().setStretchLastSection(False)
        self.table.header().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.table.header().setSectionResizeMode(MODELS_COLUMN, QHeaderView.ResizeMode.Stretch)
        self.table.setMinimumHeight(self.table.fontMetrics().height() * 7)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        layout.addWidget(self.table)
        self.problem = plain_label()  # the keys file's own words when it is broken
        self.problem.setObjectName("keys_problem")
        self.problem.setWordWrap(True)
        theme.set_text_color(self.problem, colors.status_color("error", theme.current_palette().window))
        self.problem.hide()
        layout.addWidget(self.problem)
        buttons = QHBoxLayout()
        self.add_button = QPushButton("&Add key…")
        self.add_button.setObjectName("add_key")
        self.add_button.clicked.connect(self.start_add)
        self.revoke_button = QPushButton("&Revoke…")
        self.revoke_button.setObjectName("revoke_key")
        self.revoke_button.clicked.connect(self.start_revoke)
        buttons.addWidget(self.add_button)
        buttons.addWidget(self.revoke_button)
        buttons.addStretch(1)
        layout.addLayout(buttons)
        self.refresh()

    def refresh(self) -> None:
        self.table.clear()
        try:
            keys = self.store.keys().values()
        except KeyProblem as problem:
            self.problem.setText(f"The keys file can't be read: {problem}")
            self.problem.show()
            self.add_button.setEnabled(False)
            keys = []
        else:
            self.problem.hide()
            self.add_button.setEnabled(True)
        for row in key_rows(keys):
            item = QTreeWidgetItem(list(row))
            item.setToolTip(2, as_written(row[2]))
            self.table.addTopLevelItem(item)
        if not self.table.topLevelItemCount():
            placeholder = QTreeWidgetItem(["No keys yet", "", "", "", ""])
            placeholder.setFlags(Qt.ItemFlag.NoItemFlags)
            self.table.addTopLevelItem(placeholder)
        for column in range(self.table.columnCount()):
            if column != MODELS_COLUMN:
                self.table.resizeColumnToContents(column)
                self.table.setColumnWidth(column, self.table.columnWidth(column) + COLUMN_GAP_PX)
        self._selection_changed()

    def selected_name(self) -> str | None:
        items = self.table.selectedItems()
        return items[0].text(0) if items else None

    def _selection_changed(self) -> None:
        self.revoke_button.setEnabled(self.selected_name() is not None)

    # ----- add ---------------------------------------------------------------------------------

    def start_add(self) -> None:
        dialog = AddKeyDialog(self)
        dialog.accepted.connect(self._add)
        self.add_dialog = dialog
        dialog.open()

    def _add(self) -> None:
        dialog = self.add_dialog
        assert dialog is not None
        name, scope, models, limit = dialog.values()
        try:
            raw = self.store.add(name, scope, models, limit)
        except (KeyProblem, OSError) as problem:  # OSError: the keys file can't be written
            dialog.show_error(str(problem))
            dialog.open()  # accepted closed it: again, with the problem shown
            return
        self.add_dialog = None
        self.refresh()
        self.changed.emit()
        self.new_key_dialog = NewKeyDialog(name, raw, self)
        self.new_key_dialog.open()

    # ----- revoke ------------------------------------------------------------------------------

    def start_revoke(self) -> None:
        name = self.selected_name()
        if name is None:
            return
        box = QMessageBox(QMessageBox.Icon.Warning, "tray-app: revoke an API key",
                          as_written(f"Revoke the key {name!r}? Apps using it are refused from their next "
                                     "request; this can't be undone."),
                          QMessageBox.StandardButton.Cancel, self)
        revoke = box.addButton("&Revoke", QMessageBox.ButtonRole.DestructiveRole)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.buttonClicked.connect(lambda button: self._revoke(name) if button is revoke else None)
        self.confirm_revoke = box
        box.open()

    def _revoke(self, name: str) -> None:
        self.confirm_revoke = None
        try:
            self.store.revoke(name, other_admin=self.legacy_key_set)
        except (KeyProblem, OSError) as problem:  # revoked meanwhile (a shell, the web page), or not writable
            self.refresh()
            self.problem.setText(str(problem))
            self.problem.show()
            return
        self.refresh()
        self.changed.emit()
