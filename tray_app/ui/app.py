"""`tray-app` on a desktop: the service in-process plus a system tray icon.

The controller only reads the client's snapshots and sends commands over
HTTP; the in-process service runner is there to start, restart (after Settings) and
stop the service. Without a system tray, the headroom panel opens as a
normal window and says why.

The controller wires its parts, each a module of its own: the menu and its
actions (`tray_menu.py`), the windows (`windows.py`), the notifications
(`notifications.py`), what the commands do (`tray_commands.py`) and the
process's setup (`startup.py`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from ..core.config import Config
from . import viewmodel as vm
from .client import ServiceClient
from .icons import state_icon
from .notifications import Notifications
from .poll_rate import poll_interval_ms
from .service_runner import ServiceRunner, base_url_for
from .startup import no_display, quit_on_signals, setup_logging
from .tray_commands import TrayCommands
from .tray_menu import TrayMenu, connect_action, set_checked_quietly
from .widgets import as_written
from .windows import TrayWindows

log = logging.getLogger(__name__)

QUIT_TIMEOUT_MS = 60_000
NO_TRAY_NOTE = ("This desktop has no system tray, so tray-app runs as this window instead of a tray icon. "
                "Every tray action is in the buttons below; closing this window stops the service and quits.")


class TrayController(QObject):
    """Wires the tray's parts to the service: each /status goes to the tray
    icon, the menu, the notifications and the poll rate; the menu's actions go
    to the windows and the commands; the runner's start, failure and restart
    show as the tray's state. It owns that state (`kind`, `tooltip`), the
    config in use and the order of quitting."""

    state_changed = Signal(str)        # icon kind
    quitting = Signal()

    def __init__(self, client: ServiceClient, config: Config, *, runner: ServiceRunner | None = None,
                 tray_available: bool | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.config = config
        self.runner = runner
        self.history = vm.History()
        self.kind: str | None = None
        self.tooltip = ""
        self._quitting = False
        self._exited = False
        # What ends the process once the service is down; tests swap it out.
        self.exit_app: Callable[[], None] = _quit_application
        # The last /status (None: no answer), for how often to ask again.
        self._rate_status: dict | None = None

        self.tray_menu = menu = TrayMenu(self)
        if tray_available is None:
            tray_available = QSystemTrayIcon.isSystemTrayAvailable()
        self.tray: QSystemTrayIcon | None = None
        if tray_available:
            self.tray = QSystemTrayIcon(state_icon(vm.STARTING), self)
            self.tray.setContextMenu(menu.menu)
            self.tray.setToolTip("tray-app: starting")
        self.notifications = Notifications(self.tray, self)
        # `config` and `runner` are read when they are needed, not copied: a
        # saved Settings replaces the config, and tests swap in a runner.
        self.windows = TrayWindows(client, self.history, config=lambda: self.config,
                                   service_starting=self._runner_starting,
                                   settings_can_apply=self._service_hosted,
                                   panel_actions=(menu.open_chat_action, menu.force_cpu_action, menu.restart_action,
                                                  menu.settings_action),
                                   more_menu=menu.more_menu, parent=self)
        self.commands = TrayCommands(client, config=lambda: self.config, service_hosted=self._service_hosted,
                                     parent=self)
        self._wire_menu()
        self._wire_parts()
        self._wire_service()
        self._apply_state(vm.STARTING if self._runner_starting() else vm.DOWN,
                          vm.tooltip_text(None, service_starting=self._runner_starting()))

    # ----- wiring ------------------------------------------------------------------------

    def _wire_menu(self) -> None:
        menu, windows, commands = self.tray_menu, self.windows, self.commands
        for action, does in ((menu.state_action, windows.show_panel),
                             (menu.open_panel_action, windows.show_panel),
                             (menu.open_chat_action, windows.show_chat),
                             (menu.force_cpu_action, commands.force_cpu),
                             (menu.give_back_action, commands.toggle_give_back),
                             (menu.restart_action, commands.restart_workers),
                             (menu.choose_model_action, commands.choose_model),
                             (menu.download_action, windows.show_download),
                             (menu.view_logs_action, windows.show_logs),
                             (menu.open_logs_action, commands.open_logs_folder),
                             (menu.copy_url_action, commands.copy_api_url),
                             (menu.settings_action, windows.show_settings),
                             (menu.autostart_action, commands.set_start_on_login),
                             (menu.quit_action, self.quit)):
            connect_action(action, does)
        menu.model_load_requested.connect(lambda name, loaded: self.client.set_model_loaded(name, loaded))

    def _wire_parts(self) -> None:
        if self.tray is not None:
            self.tray.activated.connect(self._on_activated)
            # A notification is about the service's state: clicking it shows the details.
            self.tray.messageClicked.connect(self.windows.show_panel)
        self.windows.visibility_changed.connect(self._update_poll_rate)
        self.windows.panel_closed.connect(self.quit)
        self.windows.settings_saved.connect(self._apply_config)
        self.commands.notice.connect(self.notifications.notify)
        self.commands.config_saved.connect(self._apply_config)
        self.commands.start_on_login_changed.connect(self.tray_menu.show_start_on_login)

    def _wire_service(self) -> None:
        self.client.status_changed.connect(self._on_status)
        self.client.unreachable.connect(self._on_unreachable)
        self.client.command_finished.connect(self._on_command)
        if self.runner is not None:
            self.runner.started.connect(self.client.poll_now)
            self.runner.failed.connect(self._on_runner_failed)

    def start(self) -> None:
        if self._runner_starting():
            self._apply_state(vm.STARTING, vm.tooltip_text(None, service_starting=True))
        if self.tray is not None:
            self.tray.show()
        else:
            panel = self.windows.panel()
            panel.set_no_tray_reason(NO_TRAY_NOTE)
            panel.close_quits = True
            self.windows.show_panel()
        self.client.start()

    # ----- the service's life ------------------------------------------------------------

    def _runner_starting(self) -> bool:
        return self.runner is not None and self.runner.starting

    def _service_hosted(self) -> bool:
        """Whether this process runs the service, so a new config is applied by restarting it."""
        return self.runner is not None

    def _apply_config(self, new_config: Config, changes: dict) -> None:
        self.config = new_config
        self.windows.show_ram_floor(new_config.cpu.ram_floor_mib)
        where = new_config.source
        if self.runner is None:
            self.notifications.notify("settings", "Settings saved",
                                      f"Saved to {where}. Restart the service to apply them.")
            return
        self.runner.restart(new_config)
        self.client.set_base_url(base_url_for(new_config))
        self.notifications.watch_new_service()
        self._apply_state(vm.STARTING, vm.tooltip_text(None, service_starting=True))
        self.notifications.notify("settings", "Settings saved", f"Saved to {where}; restarting the service.")

    def quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        self.quitting.emit()
        log.info("quitting: stopping the service and its workers")
        self.windows.hide_for_quit()
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

    # ----- how often to poll -------------------------------------------------------------

    def _update_poll_rate(self) -> None:
        interval = poll_interval_ms(window_open=self.windows.watched_open(), status=self._rate_status)
        sooner = interval < self.client.interval_ms
        self.client.set_interval_ms(interval)
        if sooner and not self._quitting:
            self.client.poll_now()  # a window just opened: fresh numbers now, not at the next slow tick

    # ----- what the service says ---------------------------------------------------------

    def _on_status(self, status: dict) -> None:
        if self._quitting:
            return
        self._rate_status = status
        self._update_poll_rate()
        self.history.add(status)
        self._apply_state(vm.icon_kind(status), vm.tooltip_text(status, floor_mib=self.config.cpu.ram_floor_mib))
        self.tray_menu.show_status(status, self.config.cpu.ram_floor_mib)
        self.notifications.check(status)

    def _on_unreachable(self, message: str) -> None:
        if self._quitting:
            return
        self._rate_status = None
        self._update_poll_rate()
        starting = self._runner_starting()
        error = (self.runner.error if self.runner is not None and self.runner.error else None) or message
        self._apply_state(vm.STARTING if starting else vm.DOWN,
                          vm.tooltip_text(None, error=None if starting else error, service_starting=starting))
        self.windows.show_service_starting(starting)

    def _on_runner_failed(self, message: str) -> None:
        self._apply_state(vm.DOWN, vm.tooltip_text(None, error=message))
        self.windows.show_service_starting(False)
        self.notifications.notify("down", "tray-app: the service is down", message)

    def _on_command(self, what: str, ok: bool, message: str) -> None:
        if ok or what.startswith("cancel"):
            return  # a failed cancel is shown where it was asked for
        self.notifications.notify("error", f"Could not {what}", message)
        # The command didn't take: show what the service says, not what was clicked.
        set_checked_quietly(self.tray_menu.force_cpu_action,
                            bool(((self.client.last_status or {}).get("service") or {}).get("gpu_paused")))

    def _apply_state(self, kind: str, tooltip: str) -> None:
        self.windows.show_service_starting(self._runner_starting())
        if kind != self.kind:
            self.kind = kind
            self.tray_menu.show_kind(kind)
            if self.tray is not None:
                self.tray.setIcon(state_icon(kind))
            self.windows.show_state_icon(state_icon(kind))
            self.state_changed.emit(kind)
        if tooltip != self.tooltip:
            self.tooltip = tooltip
            if self.tray is not None:
                self.tray.setToolTip(as_written(tooltip))

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            panel = self.windows.panel()
            # A click toggles only a panel the user is looking at; one buried
            # under other windows is brought up instead of hidden.
            if panel.isVisible() and panel.isActiveWindow() and reason == QSystemTrayIcon.ActivationReason.Trigger:
                panel.hide()
            else:
                self.windows.show_panel()
        elif reason == QSystemTrayIcon.ActivationReason.MiddleClick:
            self.windows.show_chat()


def _quit_application() -> None:
    app = QApplication.instance()
    if app is not None:
        app.quit()


# ----- the entry point -------------------------------------------------------------------

def run_tray(config: Config, log_level: str = "INFO") -> int:
    problem = no_display()
    if problem:
        # Qt would abort the process; say what to do instead.
        print(f"tray-app: error: {problem}; run `tray-app serve` for the headless service", file=sys.stderr)
        return 2
    setup_logging(log_level)
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
    notifier = quit_on_signals(controller.quit, controller)  # noqa: F841 - kept alive until exit
    runner.start()
    controller.start()
    opened = os.environ.get("TRAY_APP_OPEN", "")
    if "panel" in opened:
        controller.windows.show_panel()
    if "chat" in opened:
        controller.windows.show_chat()
    if "logs" in opened:
        controller.windows.show_logs()
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
