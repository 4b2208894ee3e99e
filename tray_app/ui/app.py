"""`tray-app` on a desktop: the service in-process plus a system tray icon.

The controller only reads the client's snapshots and sends commands over
HTTP; the in-process service runner is there to start, restart (after Settings) and
stop the service. Without a system tray, the headroom panel opens as a
normal window and says why.
"""

from __future__ import annotations

import html
import logging
import os
import signal
import socket
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QEvent, QObject, QSocketNotifier, QTimer, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QApplication, QMenu, QMessageBox, QSystemTrayIcon, QToolButton, QWidget

from ..desktop import autostart
from ..core.config import Config, ConfigError, log_dir
from ..core.base.files import PrivateRotatingFileHandler, make_private_dir
from . import viewmodel as vm
from .client import ServiceClient
from .service_runner import ServiceRunner, base_url_for
from .icons import state_icon
from .poll_rate import poll_interval_ms
from .widgets import as_written

log = logging.getLogger(__name__)

NOTIFY_MS = 8000
APP_LOG_NAME = "tray-app.log"
QUIT_TIMEOUT_MS = 60_000
NO_TRAY_NOTE = ("This desktop has no system tray, so tray-app runs as this window instead of a tray icon. "
                "Every tray action is in the buttons below; closing this window stops the service and quits.")



def notification_body(message: str, platform: str = sys.platform) -> str:
    """A notification's body as written. On Linux the notification server may
    read the body as markup (the freedesktop spec's body-markup), and a body
    holds model, peer and app names from elsewhere: escaped, a name like
    "<img src=...>" shows as text instead of loading anything."""
    return html.escape(message, quote=False) if platform.startswith("linux") else message


class TrayController(QObject):
    """Tray icon, menu, windows and notifications, driven by a ServiceClient."""

    state_changed = Signal(str)        # icon kind
    notified = Signal(str, str, str)   # (kind, title, message)
    quitting = Signal()

    def __init__(self, client: ServiceClient, config: Config, *, runner: ServiceRunner | None = None,
                 tray_available: bool | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.config = config
        self.runner = runner
        self.history = vm.History()
        self.degraded_notifier = vm.DegradedNotifier()
        self.residency_notifier = vm.ResidencyNotifier()
        self.kind: str | None = None
        self.tooltip = ""
        self.notices: list[tuple[str, str, str]] = []
        self._quitting = False
        self._exited = False
        # What ends the process once the service is down; tests swap it out.
        self.exit_app: Callable[[], None] = _quit_application
        self._panel = None
        self._chat = None
        self._download = None
        self._settings = None
        self._logs = None
        self.model_check = None  # the BackgroundCall reading a chosen model file, while it runs
        # The last /status (None: no answer), for how often to ask again.
        self._rate_status: dict | None = None

        self._build_actions()
        if tray_available is None:
            tray_available = QSystemTrayIcon.isSystemTrayAvailable()
        self.tray: QSystemTrayIcon | None = None
        if tray_available:
            self.tray = QSystemTrayIcon(state_icon(vm.STARTING), self)
            self.tray.setContextMenu(self.menu)
            self.tray.activated.connect(self._on_activated)
            # A notification is about the service's state: clicking it shows the details.
            self.tray.messageClicked.connect(self.show_panel)
            self.tray.setToolTip("tray-app: starting")

        client.status_changed.connect(self._on_status)
        client.unreachable.connect(self._on_unreachable)
        client.command_finished.connect(self._on_command)
        if runner is not None:
            runner.started.connect(client.poll_now)
            runner.failed.connect(self._on_runner_failed)
        self._apply_state(vm.STARTING if self._runner_starting() else vm.DOWN,
                          vm.tooltip_text(None, service_starting=self._runner_starting()))

    # ----- setup -------------------------------------------------------------------------

    def _action(self, text: str, slot: Callable[..., Any], *, checkable: bool = False, tip: str = "") -> QAction:
        action = QAction(text, self)
        # A button showing the action (the panel's) takes its iconText, which
        # Qt would otherwise strip of the '&': keep the Alt+letter there too.
        if "&" in text:
            action.setIconText(text)
        action.setCheckable(checkable)
        if tip:
            action.setToolTip(tip)
        (action.toggled if checkable else action.triggered).connect(slot)
        return action

    def _build_actions(self) -> None:
        # The state, at the top of the menu; it opens the panel, which says more.
        self.state_action = self._action("Starting", self.show_panel, tip="Open the headroom panel")
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
        self.open_panel_action = self._action("Open headroom &panel", self.show_panel,
                                              tip="Memory headroom, workers and the last 5 minutes")
        self.open_chat_action = self._action("Open &chat", self.show_chat,
                                             tip="Chat with the served model; answers say which path served them")
        self.force_cpu_action = self._action("&Force CPU (pause the GPU path)", self._on_force_cpu, checkable=True,
                                             tip="Send every request to the CPU worker until this is unchecked")
        self.give_back_action = self._action(vm.give_back_label(None), self.toggle_give_back,
                                             tip="Unload the GPU model so a game or another app gets the VRAM; "
                                                 "the CPU answers until you take it again")
        self.restart_action = self._action("&Restart workers", self.restart_workers,
                                           tip="Stop and start both workers (asks first if requests are running)")
        self.choose_model_action = self._action("Choose &model…", self.choose_model,
                                                tip="Pick a GGUF model file; the service restarts with it")
        self.download_action = self._action("&Download model…", self.show_download,
                                            tip="Download a GGUF from Hugging Face into the models folder; "
                                                "it is served as soon as it is verified")
        self.view_logs_action = self._action("&View logs…", self.show_logs,
                                             tip="The tray app's and each worker's log, as they are written, "
                                                 "with a filter")
        self.open_logs_action = self._action("Open &logs folder", self.open_logs,
                                             tip="The folder with the service's and the workers' logs")
        self.copy_url_action = self._action("Copy API &URL", self.copy_api_url,
                                            tip="Copy the OpenAI-compatible base URL to the clipboard")
        self.settings_action = self._action("&Settings…", self.show_settings,
                                            tip="Model paths, context sizes, VRAM reserve, port, GPU layers")
        self.autostart_action = self._action("Start on lo&gin", self.set_start_on_login, checkable=True,
                                             tip="Start the tray app when you log in to this desktop")
        self.autostart_action.blockSignals(True)
        self.autostart_action.setChecked(autostart.is_enabled())
        self.autostart_action.blockSignals(False)
        self.quit_action = self._action("&Quit", self.quit, tip="Stop the workers and quit")
        # The library's models, each with Load and Unload; shown once there is more than one.
        self.models_menu = QMenu("M&odels")
        self.models_menu.setToolTipsVisible(True)
        self._models_shown: tuple = ()
        self.menu = QMenu()
        # Menus hide their actions' tooltips unless told otherwise.
        self.menu.setToolTipsVisible(True)
        self.menu.addAction(self.state_action)
        self.menu.addAction(self.headroom_action)
        self.menu.addAction(self.residency_action)
        self.menu.addSeparator()
        for action in (self.open_panel_action, self.open_chat_action):
            self.menu.addAction(action)
        self.models_menu_action = self.menu.addMenu(self.models_menu)
        self.models_menu_action.setToolTip("Each model's place and memory; load or unload one")
        self.models_menu_action.setVisible(False)
        self.menu.addSeparator()
        for action in (self.force_cpu_action, self.give_back_action, self.restart_action, self.choose_model_action,
                       self.download_action):
            self.menu.addAction(action)
        self.menu.addSeparator()
        for action in (self.view_logs_action, self.open_logs_action, self.copy_url_action, self.settings_action,
                       self.autostart_action):
            self.menu.addAction(action)
        self.menu.addSeparator()
        self.menu.addAction(self.quit_action)
        # The panel's "More" button: what has no button of its own.
        self.more_menu = QMenu()
        self.more_menu.setToolTipsVisible(True)
        for action in (self.choose_model_action, self.download_action, self.view_logs_action, self.open_logs_action,
                       self.copy_url_action):
            self.more_menu.addAction(action)
        self.more_menu.addSeparator()
        self.more_menu.addAction(self.quit_action)

    def start(self) -> None:
        if self._runner_starting():
            self._apply_state(vm.STARTING, vm.tooltip_text(None, service_starting=True))
        if self.tray is not None:
            self.tray.show()
        else:
            panel = self.panel()
            panel.set_no_tray_reason(NO_TRAY_NOTE)
            panel.close_quits = True
            self.show_panel()
        self.client.start()

    # ----- windows -----------------------------------------------------------------------

    def panel(self):
        if self._panel is None:
            from .panel import HeadroomPanel

            self._panel = HeadroomPanel(self.client, self.history, floor_mib=self.config.cpu.ram_floor_mib,
                                        actions=(self.open_chat_action, self.force_cpu_action, self.restart_action,
                                                 self.settings_action))
            more = QToolButton()
            more.setText("&More ▾")
            more.setToolTip("Choose or download a model, view the logs or open their folder, copy the API URL, quit")
            more.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0px; }")
            more.setMenu(self.more_menu)
            more.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
            more.setMinimumHeight(28)
            self._panel.buttons.insertWidget(self._panel.buttons.count() - 1, more)
            self._panel.service_starting = self._runner_starting()
            self._panel.closed.connect(self.quit)
            self._panel.installEventFilter(self)
        return self._panel

    def chat(self):
        if self._chat is None:
            from .chat import ChatWindow
            from .conversations import default_dir

            self._chat = ChatWindow(self.client, conversations_dir=default_dir())
            self._chat.installEventFilter(self)
        return self._chat

    def logs(self):
        if self._logs is None:
            from .logs import LogViewer

            self._logs = LogViewer(log_dir() / APP_LOG_NAME, self.client.last_status)
            self.client.status_changed.connect(self._logs.set_status)
        return self._logs

    def show_panel(self) -> None:
        _raise(self.panel())

    def show_logs(self) -> None:
        _raise(self.logs())

    def show_chat(self) -> None:
        _raise(self.chat())

    def show_download(self) -> None:
        if self._download is None:
            from .download import DownloadDialog

            self._download = DownloadDialog(self.client, self.config.models_folder(),
                                            ram_floor_mib=self.config.cpu.ram_floor_mib,
                                            reserve_mib=self.config.gpu.reserve_mib)
        _raise(self._download)

    def show_settings(self) -> None:
        from .settings import SettingsDialog

        if self._settings is not None and self._settings.isVisible():
            _raise(self._settings)
            return
        dialog = SettingsDialog(self.config, can_apply=self.runner is not None)
        dialog.saved.connect(self._apply_config)
        self._settings = dialog
        _raise(dialog)

    # ----- commands ----------------------------------------------------------------------

    def _on_force_cpu(self, checked: bool) -> None:
        self.client.set_gpu_paused(checked)

    def toggle_give_back(self) -> None:
        """Give the GPU back now, or use it again once given."""
        given = vm.residency_state(self.client.last_status) in vm.GIVEN_STATES
        self.client.give_gpu_back(not given)

    def restart_workers(self) -> None:
        if self._confirm_interruption("Restarting the workers"):
            self.client.restart_workers()

    def _confirm_interruption(self, action: str) -> bool:
        """Ask before `action` stops requests the last /status showed; an idle
        service needs no dialog."""
        question = vm.interruption_warning(self.client.last_status, action)
        if question is None:
            return True
        answer = QMessageBox.question(None, "tray-app: stop the running requests?", question,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def choose_model(self) -> None:
        from ..core.memory.gguf_info import read_model_info
        from .background import BackgroundCall
        from .settings import choose_model_file

        path = choose_model_file(None, self.config.model.path)
        if not path:
            return
        call: BackgroundCall | None = None

        def on_done(future: Future) -> None:
            self._on_model_checked(call, path, future)

        # A stranger's file can take seconds to read: not on the GUI thread.
        call = BackgroundCall(lambda: read_model_info(path), on_done)
        self.model_check = call

    def _on_model_checked(self, call: object, path: str, future: Future) -> None:
        from ..core.memory.gguf_info import ModelFileError
        from .settings import save_changes

        if call is not self.model_check:
            return  # another model was chosen meanwhile: its check decides
        self.model_check = None
        try:
            future.result()
        except ModelFileError as exc:
            # The message may quote the file's own metadata.
            QMessageBox.warning(None, "tray-app: not a usable model", as_written(str(exc)))
            return
        # Asked only now, once the file is known to be usable: the restart is
        # what stops requests, and only a hosted service is restarted here.
        if self.runner is not None and not self._confirm_interruption("Switching the model"):
            return
        try:
            new_config, where = save_changes(self.config, {"model": {"path": path}})
        except (ConfigError, OSError) as exc:
            QMessageBox.warning(None, "tray-app: model not saved", as_written(str(exc)))
            return
        self._apply_config(new_config, {"model": {"path": path}})

    def _apply_config(self, new_config: Config, changes: dict) -> None:
        self.config = new_config
        if self._panel is not None:
            self._panel.floor_mib = new_config.cpu.ram_floor_mib
        where = new_config.source
        if self.runner is None:
            self.notify("settings", "Settings saved", f"Saved to {where}. Restart the service to apply them.")
            return
        self.runner.restart(new_config)
        self.client.set_base_url(base_url_for(new_config))
        self.degraded_notifier = vm.DegradedNotifier()
        self.residency_notifier = vm.ResidencyNotifier()
        self._apply_state(vm.STARTING, vm.tooltip_text(None, service_starting=True))
        self.notify("settings", "Settings saved", f"Saved to {where}; restarting the service.")

    def open_logs(self) -> None:
        folder = self._logs_folder()
        make_private_dir(folder)
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            QGuiApplication.clipboard().setText(str(folder))
            self.notify("logs", "Logs folder", f"{folder}\n(no file manager answered; the path is on the clipboard)")

    def _logs_folder(self) -> Path:
        for worker in (self.client.last_status or {}).get("workers") or ():
            if worker.get("log"):
                candidate = Path(worker["log"]).parent
                if candidate.is_dir():
                    return candidate
        return log_dir()

    def set_start_on_login(self, enabled: bool) -> None:
        try:
            if enabled:
                autostart.enable()
            else:
                autostart.disable()
        except OSError as exc:
            self.notify("autostart", "Start on login could not be changed", str(exc))
        self.autostart_action.blockSignals(True)
        self.autostart_action.setChecked(autostart.is_enabled())
        self.autostart_action.blockSignals(False)

    def copy_api_url(self) -> None:
        QGuiApplication.clipboard().setText(self.client.api_url)
        self.notify("copied", "API URL copied", self.client.api_url)

    def quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        self.quitting.emit()
        log.info("quitting: stopping the service and its workers")
        for window in (self._panel, self._chat, self._settings, self._logs):
            if window is not None:
                window.hide()
        self.client.stop()
        if self.tray is not None:
            self.tray.setIcon(state_icon(vm.STARTING))
            self.tray.setToolTip("tray-app: stopping the workers…")
        if self.runner is None or not self.runner.is_alive():
            self._after_stop()
            return
        self.runner.stopped.connect(self._after_stop)
        self.runner.stop()
        QTimer.singleShot(QUIT_TIMEOUT_MS, self, self._after_stop)

    def _after_stop(self) -> None:
        if self._exited:
            return
        self._exited = True
        if self.tray is not None:
            self.tray.hide()
        self.exit_app()

    # ----- status ------------------------------------------------------------------------

    def _runner_starting(self) -> bool:
        return self.runner is not None and self.runner.starting

    # ----- how often to poll ---------------------------------------------------------------

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        """The panel or the chat was shown or hidden: poll at the rate that
        fits (Qt sends Show and Hide once isVisible() says the new state)."""
        if event.type() in (QEvent.Type.Show, QEvent.Type.Hide):
            self._update_poll_rate()
        return False

    def windows_open(self) -> bool:
        return any(window is not None and window.isVisible() for window in (self._panel, self._chat))

    def _update_poll_rate(self) -> None:
        interval = poll_interval_ms(window_open=self.windows_open(), status=self._rate_status)
        sooner = interval < self.client.interval_ms
        self.client.set_interval_ms(interval)
        if sooner and not self._quitting:
            self.client.poll_now()  # a window just opened: fresh numbers now, not at the next slow tick

    def _on_status(self, status: dict) -> None:
        if self._quitting:
            return
        self._rate_status = status
        self._update_poll_rate()
        self.history.add(status)
        kind = vm.icon_kind(status)
        self._apply_state(kind, vm.tooltip_text(status, floor_mib=self.config.cpu.ram_floor_mib))
        title = as_menu_text(vm.state_title(status))  # a busy GPU's overflow is not called degraded
        if self.state_action.text() != title:
            self.state_action.setText(title)
        headroom = vm.menu_headroom_text(status, self.config.cpu.ram_floor_mib)
        if self.headroom_action.text() != headroom:
            self.headroom_action.setText(headroom)
        # Without a GPU path there is nothing to pause (the menu and the panel's button).
        self.force_cpu_action.setEnabled(vm.cpu_only(status) is None)
        paused = bool((status.get("service") or {}).get("gpu_paused"))
        if self.force_cpu_action.isChecked() != paused:
            self.force_cpu_action.blockSignals(True)
            self.force_cpu_action.setChecked(paused)
            self.force_cpu_action.blockSignals(False)
        residency = vm.residency_text(status)
        self.residency_action.setVisible(residency is not None)
        residency = as_menu_text(residency) if residency is not None else None  # names another app
        if residency is not None and self.residency_action.text() != residency:
            self.residency_action.setText(residency)
        label = vm.give_back_label(status)
        if self.give_back_action.text() != label:
            self.give_back_action.setText(label)
        self.give_back_action.setEnabled(vm.residency_state(status) is not None)
        self._render_models(status)
        for notifier in (self.residency_notifier, self.degraded_notifier):
            notice = notifier.update(status)
            if notice is not None:
                self.notify(notice.kind, notice.title, notice.message)

    def _render_models(self, status: dict) -> None:
        """The Models submenu: rebuilt only when what it shows changes, so an
        open menu doesn't flicker every second."""
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
        self.client.set_model_loaded(name, loaded)

    def _on_unreachable(self, message: str) -> None:
        if self._quitting:
            return
        self._rate_status = None
        self._update_poll_rate()
        starting = self._runner_starting()
        error = (self.runner.error if self.runner is not None and self.runner.error else None) or message
        self._apply_state(vm.STARTING if starting else vm.DOWN,
                          vm.tooltip_text(None, error=None if starting else error, service_starting=starting))
        if self._panel is not None:
            self._panel.service_starting = starting

    def _on_runner_failed(self, message: str) -> None:
        self._apply_state(vm.DOWN, vm.tooltip_text(None, error=message))
        if self._panel is not None:
            self._panel.service_starting = False
        self.notify("down", "tray-app: the service is down", message)

    def _on_command(self, what: str, ok: bool, message: str) -> None:
        if ok or what.startswith("cancel"):
            return  # a failed cancel is shown where it was asked for
        self.notify("error", f"Could not {what}", message)
        if self.force_cpu_action.isChecked() != bool(((self.client.last_status or {}).get("service") or {})
                                                     .get("gpu_paused")):
            # The command didn't take: show what the service says, not what was clicked.
            self.force_cpu_action.blockSignals(True)
            self.force_cpu_action.toggle()
            self.force_cpu_action.blockSignals(False)

    def _apply_state(self, kind: str, tooltip: str) -> None:
        if self._panel is not None:
            self._panel.service_starting = self._runner_starting()
        if kind != self.kind:
            self.kind = kind
            self.state_action.setText(vm.STATE_TITLES[kind])
            self.state_action.setIcon(state_icon(kind))
            if self.tray is not None:
                self.tray.setIcon(state_icon(kind))
            for window in (self._panel, self._chat, self._logs):
                if window is not None:
                    window.setWindowIcon(state_icon(kind))
            self.state_changed.emit(kind)
        if tooltip != self.tooltip:
            self.tooltip = tooltip
            if self.tray is not None:
                self.tray.setToolTip(as_written(tooltip))

    def notify(self, kind: str, title: str, message: str) -> None:
        log.info("notice: %s: %s", title, message.replace("\n", " "))
        self.notices.append((kind, title, message))
        if self.tray is not None and self.tray.isVisible() and self.tray.supportsMessages():
            icon = QSystemTrayIcon.MessageIcon.Warning if kind in ("degraded_start", "down", "error") \
                else QSystemTrayIcon.MessageIcon.Information
            self.tray.showMessage(title, notification_body(message), icon, NOTIFY_MS)
        self.notified.emit(kind, title, message)

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            panel = self.panel()
            # A click toggles only a panel the user is looking at; one buried
            # under other windows is brought up instead of hidden.
            if panel.isVisible() and panel.isActiveWindow() and reason == QSystemTrayIcon.ActivationReason.Trigger:
                panel.hide()
            else:
                self.show_panel()
        elif reason == QSystemTrayIcon.ActivationReason.MiddleClick:
            self.show_chat()


def as_menu_text(text: str) -> str:
    """`text` (a model's, a peer's or an app's name in it) as a menu shows it:
    a menu takes '&' for the Alt+letter mark, so "Q&A" would read "QA"."""
    return text.replace("&", "&&")


def _quit_application() -> None:
    app = QApplication.instance()
    if app is not None:
        app.quit()


def _raise(window: QWidget) -> None:
    window.show()
    window.raise_()
    window.activateWindow()


# ----- the entry point -------------------------------------------------------------------

def _setup_logging(level: str) -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        folder = log_dir()  # made private (0700) if it is new
        handler = PrivateRotatingFileHandler(folder / APP_LOG_NAME, maxBytes=2_000_000, backupCount=3)
        handler.setFormatter(logging.Formatter(fmt))
        logging.getLogger().addHandler(handler)
    except OSError as exc:
        log.warning("no log file: %s", exc)


def _install_signal_handlers(controller: TrayController) -> QSocketNotifier | None:
    """SIGINT/SIGTERM quit cleanly (workers stopped), with no polling timer."""
    try:
        reader, writer = socket.socketpair()
    except OSError:
        return None
    reader.setblocking(False)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read, controller)

    def woke() -> None:
        try:
            reader.recv(64)
        except OSError:
            pass
        controller.quit()

    notifier.activated.connect(woke)
    notifier._sockets = (reader, writer)  # type: ignore[attr-defined] - keep them open
    return notifier


def _no_display() -> str | None:
    if sys.platform.startswith("linux") and not os.environ.get("QT_QPA_PLATFORM") \
            and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        return "no display (neither DISPLAY nor WAYLAND_DISPLAY is set)"
    return None


def run_tray(config: Config, log_level: str = "INFO") -> int:
    problem = _no_display()
    if problem:
        # Qt would abort the process; say what to do instead.
        print(f"tray-app: error: {problem}; run `tray-app serve` for the headless service", file=sys.stderr)
        return 2
    _setup_logging(log_level)
    from . import qtcompat

    if qtcompat.ACTIVE:
        log.info("%s", qtcompat.describe())
    app = QApplication.instance() or QApplication(sys.argv[:1])
    shots = os.environ.get("TRAY_APP_SCREENSHOT_DIR")
    if shots and os.environ.get("TRAY_APP_SCREENSHOT_THEME") == "dark":
        # The dark-theme screenshots: set before any window picks its colours.
        from .theme import use_dark_fusion

        use_dark_fusion(app)
    app.setApplicationName("tray-app")
    app.setApplicationDisplayName("tray-app")
    app.setQuitOnLastWindowClosed(False)
    app.setWindowIcon(state_icon(vm.GPU))
    runner = ServiceRunner(config, log_level)
    client = ServiceClient(base_url_for(config), api_key=config.server.api_key or None)
    controller = TrayController(client, config, runner=runner)
    if controller.tray is None:
        log.warning("no system tray on this desktop: the headroom panel opens as a window")
    notifier = _install_signal_handlers(controller)  # noqa: F841 - kept alive until exit
    runner.start()
    controller.start()
    opened = os.environ.get("TRAY_APP_OPEN", "")
    if "panel" in opened:
        controller.show_panel()
    if "chat" in opened:
        controller.show_chat()
    if "logs" in opened:
        controller.show_logs()
    if shots:
        from .shots import ScreenshotTour

        tour = ScreenshotTour(controller, Path(shots))  # noqa: F841 - lives as long as the app
        tour.start()
    print(f"tray-app: serving on {client.api_url} ({'tray icon' if controller.tray else 'window, no system tray'})",
          file=sys.stderr, flush=True)
    code = app.exec()
    if not runner.stop_and_wait(timeout=60):
        log.error("the service did not stop within 60 s")
        code = code or 1
    return code
