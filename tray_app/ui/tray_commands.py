"""What the tray's commands do, besides opening a window: pause the GPU path,
give the GPU back, restart the workers, switch the model, open the logs
folder, copy the API URL, start on login.

Each asks the service over the client or changes the desktop, and says what
came of it through its signals; the controller decides what follows (a
restart with a new config, a notification, the menu's check mark).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QMessageBox

from ..core.base.files import make_private_dir
from ..core.config import Config, ConfigError, log_dir
from ..desktop import autostart
from . import viewmodel as vm
from .client import ServiceClient
from .widgets import as_written


class TrayCommands(QObject):
    """The tray's commands. `config` and `service_hosted` (whether this
    process runs the service, so a new config can be applied by a restart)
    are read when a command runs."""

    notice = Signal(str, str, str)         # (kind, title, message)
    config_saved = Signal(object, object)  # (the new config, the changes as saved)
    start_on_login_changed = Signal(bool)  # whether it is on now, changed or not

    def __init__(self, client: ServiceClient, *, config: Callable[[], Config], service_hosted: Callable[[], bool],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self._config = config
        self._service_hosted = service_hosted
        self.model_check = None  # the BackgroundCall reading a chosen model file, while it runs

    def force_cpu(self, checked: bool) -> None:
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

    # ----- switching the model -----------------------------------------------------------

    def choose_model(self) -> None:
        from ..core.memory.gguf_info import read_model_info
        from .background import BackgroundCall
        from .settings import choose_model_file

        path = choose_model_file(None, self._config().model.path)
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
        if self._service_hosted() and not self._confirm_interruption("Switching the model"):
            return
        try:
            new_config, _ = save_changes(self._config(), {"model": {"path": path}})
        except (ConfigError, OSError) as exc:
            QMessageBox.warning(None, "tray-app: model not saved", as_written(str(exc)))
            return
        self.config_saved.emit(new_config, {"model": {"path": path}})

    # ----- the desktop -------------------------------------------------------------------

    def open_logs_folder(self) -> None:
        folder = self._logs_folder()
        make_private_dir(folder)
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            QGuiApplication.clipboard().setText(str(folder))
            self.notice.emit("logs", "Logs folder",
                             f"{folder}\n(no file manager answered; the path is on the clipboard)")

    def _logs_folder(self) -> Path:
        for worker in (self.client.last_status or {}).get("workers") or ():
            if worker.get("log"):
                candidate = Path(worker["log"]).parent
                if candidate.is_dir():
                    return candidate
        return log_dir()

    def copy_api_url(self) -> None:
        QGuiApplication.clipboard().setText(self.client.api_url)
        self.notice.emit("copied", "API URL copied", self.client.api_url)

    def set_start_on_login(self, enabled: bool) -> None:
        try:
            if enabled:
                autostart.enable()
            else:
                autostart.disable()
        except OSError as exc:
            self.notice.emit("autostart", "Start on login could not be changed", str(exc))
        self.start_on_login_changed.emit(autostart.is_enabled())
