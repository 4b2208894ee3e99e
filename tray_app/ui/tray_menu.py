"""The tray's menu: its actions, the Models submenu and the panel's "More"
menu, and how a /status reads in them.

The actions are built here but not connected: what each one does is wired
by the controller (`connect_action`), so this module only says what the menu
shows. The same QAction serves the tray menu and the panel's buttons, which
is why one object owns them.
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu

from ..desktop import autostart
from . import viewmodel as vm
from .icons import state_icon
from .widgets import as_written


def as_menu_text(text: str) -> str:
    """`text` (a model's, a peer's or an app's name in it) as a menu shows it:
    a menu takes '&' for the Alt+letter mark, so "Q&A" would read "QA"."""
    return text.replace("&", "&&")


def connect_action(action: QAction, slot: Callable[..., Any]) -> None:
    """A checkable action says its new state (toggled); any other, that it was chosen."""
    (action.toggled if action.isCheckable() else action.triggered).connect(slot)


def set_checked_quietly(action: QAction, checked: bool) -> None:
    """Show a state the service (or the desktop) reports without running the
    action's command again."""
    if action.isChecked() != checked:
        action.blockSignals(True)
        action.setChecked(checked)
        action.blockSignals(False)


class TrayMenu(QObject):
    """The tray menu's actions and menus, showing the service's state."""

    # A model's Load (True) or Unload (False) was chosen in the Models submenu.
    model_load_requested = Signal(str, bool)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        # The state, at the top of the menu; it opens the panel, which says more.
        self.state_action = self._action("Starting", tip="Open the headroom panel")
        bold = self.state_action.font()
        bold.setBold(True)
        self.state_action.setFont(bold)
        # What fits right now, under the state: not every tray host shows tooltips.
        self.headroom_action = QAction(vm.menu_headroom_text(None), self)
        self.headroom_action.setEnabled(False)
        self.headroom_action.setToolTip("Free memory above the VRAM reserve and the RAM floor")
        # Where the GPU model is when it is not simply loaded (idle, given to a game); hidden otherwise.
        self.residency_action = QAction("", self)
        self.residency_action.setEnabled(False)
        self.residency_action.setVisible(False)
        # Each '&' marks the action's Alt+letter: unique within the tray menu,
        # and within the panel's buttons (Open chat, Force CPU, Restart, Settings, More).
        self.open_panel_action = self._action("Open headroom &panel",
                                              tip="Memory headroom, workers and the last 5 minutes")
        self.open_chat_action = self._action("Open &chat",
                                             tip="Chat with the served model; answers say which path served them")
        self.force_cpu_action = self._action("&Force CPU (pause the GPU path)", checkable=True,
                                             tip="Send every request to the CPU worker until this is unchecked")
        self.give_back_action = self._action(vm.give_back_label(None),
                                             tip="Unload the GPU model so a game or another app gets the VRAM; "
                                                 "the CPU answers until you take it again")
        self.restart_action = self._action("&Restart workers",
                                           tip="Stop and start both workers (asks first if requests are running)")
        self.choose_model_action = self._action("Choose &model…",
                                                tip="Pick a GGUF model file; the service restarts with it")
        self.download_action = self._action("&Download model…",
                                            tip="Download a GGUF from Hugging Face into the models folder; "
                                                "it is served as soon as it is verified")
        self.view_logs_action = self._action("&View logs…",
                                             tip="The tray app's and each worker's log, as they are written, "
                                                 "with a filter")
        self.open_logs_action = self._action("Open &logs folder",
                                             tip="The folder with the service's and the workers' logs")
        self.copy_url_action = self._action("Copy API &URL",
                                            tip="Copy the OpenAI-compatible base URL to the clipboard")
        self.settings_action = self._action("&Settings…",
                                            tip="Model paths, context sizes, VRAM reserve, port, GPU layers")
        self.autostart_action = self._action("Start on lo&gin", checkable=True,
                                             tip="Start the tray app when you log in to this desktop")
        self.show_start_on_login(autostart.is_enabled())
        self.quit_action = self._action("&Quit", tip="Stop the workers and quit")
        # The library's models, each with Load and Unload; shown once there is more than one.
        self.models_menu = QMenu("M&odels")
        self.models_menu.setToolTipsVisible(True)
        self._models_shown: tuple = ()
        self.menu = self._build_tray_menu()
        self.more_menu = self._build_more_menu()

    def _action(self, text: str, *, checkable: bool = False, tip: str = "") -> QAction:
        action = QAction(text, self)
        # A button showing the action (the panel's) takes its iconText, which
        # Qt would otherwise strip of the '&': keep the Alt+letter there too.
        if "&" in text:
            action.setIconText(text)
        action.setCheckable(checkable)
        if tip:
            action.setToolTip(tip)
        return action

    def _build_tray_menu(self) -> QMenu:
        menu = QMenu()
        # Menus hide their actions' tooltips unless told otherwise.
        menu.setToolTipsVisible(True)
        menu.addAction(self.state_action)
        menu.addAction(self.headroom_action)
        menu.addAction(self.residency_action)
        menu.addSeparator()
        for action in (self.open_panel_action, self.open_chat_action):
            menu.addAction(action)
        self.models_menu_action = menu.addMenu(self.models_menu)
        self.models_menu_action.setToolTip("Each model's place and memory; load or unload one")
        self.models_menu_action.setVisible(False)
        menu.addSeparator()
        for action in (self.force_cpu_action, self.give_back_action, self.restart_action, self.choose_model_action,
                       self.download_action):
            menu.addAction(action)
        menu.addSeparator()
        for action in (self.view_logs_action, self.open_logs_action, self.copy_url_action, self.settings_action,
                       self.autostart_action):
            menu.addAction(action)
        menu.addSeparator()
        menu.addAction(self.quit_action)
        return menu

    def _build_more_menu(self) -> QMenu:
        """The panel's "More" button: what has no button of its own."""
        menu = QMenu()
        menu.setToolTipsVisible(True)
        for action in (self.choose_model_action, self.download_action, self.view_logs_action, self.open_logs_action,
                       self.copy_url_action):
            menu.addAction(action)
        menu.addSeparator()
        menu.addAction(self.quit_action)
        return menu

    # ----- what the menu shows -----------------------------------------------------------

    def show_kind(self, kind: str) -> None:
        self.state_action.setText(vm.STATE_TITLES[kind])
        self.state_action.setIcon(state_icon(kind))

    def show_start_on_login(self, enabled: bool) -> None:
        set_checked_quietly(self.autostart_action, enabled)

    def show_status(self, status: dict, floor_mib: int) -> None:
        """One /status in the menu; each text is set only when it changed, so
        an open menu doesn't flicker every second."""
        title = as_menu_text(vm.state_title(status))  # a busy GPU's overflow is not called degraded
        if self.state_action.text() != title:
            self.state_action.setText(title)
        headroom = vm.menu_headroom_text(status, floor_mib)
        if self.headroom_action.text() != headroom:
            self.headroom_action.setText(headroom)
        # Without a GPU path there is nothing to pause (the menu and the panel's button).
        self.force_cpu_action.setEnabled(vm.cpu_only(status) is None)
        set_checked_quietly(self.force_cpu_action, bool((status.get("service") or {}).get("gpu_paused")))
        residency = vm.residency_text(status)
        self.residency_action.setVisible(residency is not None)
        residency = as_menu_text(residency) if residency is not None else None  # names another app
        if residency is not None and self.residency_action.text() != residency:
            self.residency_action.setText(residency)
        label = vm.give_back_label(status)
        if self.give_back_action.text() != label:
            self.give_back_action.setText(label)
        self.give_back_action.setEnabled(vm.residency_state(status) is not None)
        self._show_models(status)

    def _show_models(self, status: dict) -> None:
        """The Models submenu: rebuilt only when what it shows changes."""
        views = vm.model_views(status)
        shown = tuple((v.label, v.can_load, v.can_unload, v.tooltip) for v in views)
        self.models_menu_action.setVisible(len(views) > 1)
        if shown == self._models_shown:
            return
        self._models_shown = shown
        self.models_menu.clear()
        for view in views:
            submenu = self.models_menu.addMenu(as_menu_text(view.label))
            submenu.setToolTipsVisible(True)
            submenu.menuAction().setToolTip(as_written(view.tooltip))
            load = submenu.addAction("&Load on the GPU")
            load.setEnabled(view.can_load)
            load.setToolTip("Load it now (other idle models are unloaded if it needs their memory)")
            load.setData((view.name, True))
            load.triggered.connect(self._on_model_action)
            unload = submenu.addAction("&Unload")
            unload.setEnabled(view.can_unload)
            unload.setToolTip("Give its memory back now; it loads again on its next request"
                              if view.busy == 0 else f"{view.busy} request(s) are using it")
            unload.setData((view.name, False))
            unload.triggered.connect(self._on_model_action)

    def _on_model_action(self) -> None:
        name, loaded = self.sender().data()
        self.model_load_requested.emit(name, loaded)
