"""The tray's windows: the headroom panel, the chat, the log viewer, the
download dialog and Settings. Each is made on first use (most sessions open
few of them) and brought to the front when asked for."""

from __future__ import annotations

from typing import Callable

import shiboken6

from PySide6.QtCore import QEvent, QObject, Signal
from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import QMenu, QToolButton, QWidget

from ..core.config import Config, log_dir
from . import viewmodel as vm
from .client import ServiceClient

APP_LOG_NAME = "tray-app.log"


def raise_window(window: QWidget) -> None:
    window.show()
    window.raise_()
    window.activateWindow()


class TrayWindows(QObject):
    """Makes, shows and raises the tray's windows. `config` and
    `service_starting` are read when a window is made, so one made after a
    restart sees the new values."""

    # The panel or the chat was shown or hidden: how often to poll may change.
    visibility_changed = Signal()
    # The panel's close button, in a desktop without a tray: that quits.
    panel_closed = Signal()
    # Settings were saved: (the new config, the changes as saved).
    settings_saved = Signal(object, object)

    def __init__(self, client: ServiceClient, history: vm.History, *, config: Callable[[], Config],
                 service_starting: Callable[[], bool], settings_can_apply: Callable[[], bool],
                 panel_actions: tuple[QAction, ...], more_menu: QMenu, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.history = history
        self._config = config
        self._service_starting = service_starting
        self._settings_can_apply = settings_can_apply
        self._panel_actions = panel_actions
        self._more_menu = more_menu
        self.panel_window = None
        self.chat_window = None
        self.logs_window = None
        self.download_dialog = None
        self.settings_dialog = None

    def panel(self):
        if self.panel_window is None:
            from .panel import HeadroomPanel

            panel = HeadroomPanel(self.client, self.history, floor_mib=self._config().cpu.ram_floor_mib,
                                  actions=self._panel_actions)
            more = QToolButton()
            more.setText("&More ▾")
            more.setToolTip("Choose or download a model, view the logs or open their folder, copy the API URL, quit")
            more.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0px; }")
            more.setMenu(self._more_menu)
            more.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
            more.setMinimumHeight(28)
            panel.buttons.insertWidget(panel.buttons.count() - 1, more)
            panel.service_starting = self._service_starting()
            panel.closed.connect(self.panel_closed)
            panel.installEventFilter(self)
            self.panel_window = panel
        return self.panel_window

    def chat(self):
        if self.chat_window is None:
            from .chat import ChatWindow
            from .conversations import default_dir

            self.chat_window = ChatWindow(self.client, conversations_dir=default_dir())
            self.chat_window.installEventFilter(self)
        return self.chat_window

    def logs(self):
        if self.logs_window is None:
            from .logs import LogViewer

            self.logs_window = LogViewer(log_dir() / APP_LOG_NAME, self.client.last_status)
            self.client.status_changed.connect(self.logs_window.set_status)
        return self.logs_window

    def show_panel(self) -> None:
        raise_window(self.panel())

    def show_chat(self) -> None:
        raise_window(self.chat())

    def show_logs(self) -> None:
        raise_window(self.logs())

    def show_download(self) -> None:
        if self.download_dialog is None:
            from .download import DownloadDialog

            config = self._config()
            self.download_dialog = DownloadDialog(self.client, config.models_folder(),
                                                  ram_floor_mib=config.cpu.ram_floor_mib,
                                                  reserve_mib=config.gpu.reserve_mib)
        raise_window(self.download_dialog)

    def show_settings(self) -> None:
        from .settings import SettingsDialog

        if self.settings_dialog is not None and self.settings_dialog.isVisible():
            raise_window(self.settings_dialog)
            return
        dialog = SettingsDialog(self._config(), can_apply=self._settings_can_apply())
        dialog.saved.connect(self.settings_saved)
        self.settings_dialog = dialog
        raise_window(dialog)

    # ----- what every open window shows --------------------------------------------------

    def watched_open(self) -> bool:
        """Whether the panel or the chat, the windows showing live numbers, is on screen.
        A window Qt has already destroyed (the X server went away under the
        app, which then quits) is not: asking it would raise."""
        return any(window is not None and shiboken6.isValid(window) and window.isVisible()
                   for window in (self.panel_window, self.chat_window))

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        # Qt sends Show and Hide once isVisible() says the new state.
        if event.type() in (QEvent.Type.Show, QEvent.Type.Hide):
            self.visibility_changed.emit()
        return False

    def show_state_icon(self, icon: QIcon) -> None:
        for window in (self.panel_window, self.chat_window, self.logs_window):
            if window is not None:
                window.setWindowIcon(icon)

    def show_service_starting(self, starting: bool) -> None:
        if self.panel_window is not None:
            self.panel_window.service_starting = starting

    def show_ram_floor(self, floor_mib: int) -> None:
        if self.panel_window is not None:
            self.panel_window.floor_mib = floor_mib

    def hide_for_quit(self) -> None:
        for window in (self.panel_window, self.chat_window, self.settings_dialog, self.logs_window):
            if window is not None:
                window.hide()
