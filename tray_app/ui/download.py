"""The tray's "Download model…": a GGUF from a Hugging Face-style hub into
the models folder, with whether it fits before, and a progress row during.

The download itself is core.download.download_model on a worker thread
(resumable, SHA-256 verified); its progress callback crosses to the GUI
thread as a queued signal. Cancel keeps the .part, so Download again
resumes. When it is done the running service is asked to read its models
folder again, and the new model is served at once.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import (
    QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit, QProgressBar, QPushButton, QVBoxLayout, QWidget,
)

from ..core.catalog.download import (
    DEFAULT_HUB_URL, HUB_URL_ENV, TOKEN_ENV, DownloadCancelled, DownloadError, DownloadResult, ModelRef,
    lookup_remote_file, new_client, parse_model_ref, render_progress, rough_fit,
)
from ..core.memory.fit import headroom_from_status
from . import colors, theme
from .background import BackgroundCall
from .client import ServiceClient
from .widgets import plain_label
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

Downloader = Callable[..., DownloadResult]


class _Progress(QObject):
    """Carries (done, total) from the download thread to the GUI thread."""

    moved = Signal(object, object)


class DownloadDialog(QDialog):
    finished_download = Signal(object)  # the DownloadResult, once saved

    def __init__(self, client: ServiceClient, models_folder: Path, *, ram_floor_mib: float, reserve_mib: float,
                 hub: str | None = None, downloader: Downloader | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from ..core.catalog.download import download_model

        self.client = client
        self.models_folder = models_folder
        self.hub = hub or os.environ.get(HUB_URL_ENV) or DEFAULT_HUB_URL
        self._token = os.environ.get(TOKEN_ENV) or None
        self._download = downloader or download_model
        self._ram_floor_mib = ram_floor_mib
        self._reserve_mib = reserve_mib
        self._cancel: threading.Event | None = None
        self._started = 0.0
        self.result: DownloadResult | None = None
        self.setWindowTitle("tray-app: download a model")
        self.setMinimumWidth(560)

        root = QVBoxLayout(self)
        form = QFormLayout()
        self.ref_edit = QLineEdit()
        self.ref_edit.setPlaceholderText("OWNER/NAME/FILE.gguf")
        self.ref_edit.setToolTip("A .gguf file on Hugging Face, e.g. "
                                 "bartowski/Qwen2.5-0.5B-Instruct-GGUF/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")
        self.ref_edit.textChanged.connect(self._on_ref_changed)
        label = QLabel("&File:")
        label.setBuddy(self.ref_edit)
        form.addRow(label, self.ref_edit)
        root.addLayout(form)
        self.fit_label = plain_label(f"From {self.hub}, into {models_folder}")  # and what the hub says
        self.fit_label.setWordWrap(True)
        theme.set_muted_text(self.fit_label)
        root.addWidget(self.fit_label)
        self.bar = QProgressBar()
        self.bar.setVisible(False)
        root.addWidget(self.bar)
        self.progress_label = plain_label()
        self.progress_label.setWordWrap(True)
        root.addWidget(self.progress_label)

        buttons = QDialogButtonBox()
        self.check_button = QPushButton("C&heck fit")
        self.check_button.setToolTip("Ask the hub for the file's size and say whether it fits here")
        self.download_button = QPushButton("&Download")
        self.download_button.setDefault(True)
        self.cancel_button = QPushButton("&Cancel download")
        self.cancel_button.setToolTip("Stop; the part already downloaded is kept, and Download resumes it")
        self.cancel_button.setEnabled(False)
        self.close_button = QPushButton("Cl&ose")
        for button in (self.check_button, self.download_button, self.cancel_button):
            buttons.addButton(button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.addButton(self.close_button, QDialogButtonBox.ButtonRole.RejectRole)
        self.check_button.clicked.connect(self.check_fit)
        self.download_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)
        self.close_button.clicked.connect(self.reject)
        root.addWidget(buttons)
        self._progress = _Progress()
        self._progress.moved.connect(self._on_progress)
        self._on_ref_changed(self.ref_edit.text())

    # ----- actions -----------------------------------------------------------------------

    def _ref(self) -> ModelRef | None:
        try:
            return parse_model_ref(self.ref_edit.text().strip())
        except DownloadError as exc:
            self._say(str(exc), error=True)
            return None

    def _on_ref_changed(self, text: str) -> None:
        ready = bool(text.strip()) and self._cancel is None
        self.check_button.setEnabled(ready)
        self.download_button.setEnabled(ready)

    def check_fit(self) -> None:
        ref = self._ref()
        if ref is None:
            return
        self._say(f"asking {self.hub} about {ref}…")
        status = self.client.last_status

        def work() -> str:
            with new_client() as http:
                remote = lookup_remote_file(http, self.hub, ref, token=self._token)
            if remote.size is None or not status:
                return "the size or this machine's free memory is unknown"
            headroom = headroom_from_status(status, ram_floor_mib=self._ram_floor_mib,
                                            default_reserve_mib=self._reserve_mib)
            return rough_fit(remote.size, headroom)[1]

        BackgroundCall(work, self._on_checked)

    def _on_checked(self, future: Future) -> None:
        try:
            self._say(f"{self.ref_edit.text().strip()}: {future.result()}")
        except DownloadError as exc:
            self._say(str(exc), error=True)

    def start(self) -> None:
        ref = self._ref()
        if ref is None or self._cancel is not None:
            return
        self._cancel = cancel = threading.Event()
        self._started = time.monotonic()
        self.bar.setVisible(True)
        self.bar.setRange(0, 0)
        self.cancel_button.setEnabled(True)
        self._on_ref_changed(self.ref_edit.text())
        self.ref_edit.setEnabled(False)
        self._say(f"downloading {ref}…")
        moved = self._progress.moved

        def work() -> DownloadResult:
            return self._download(self.hub, ref.repo, ref.file, self.models_folder, token=self._token,
                                  progress=lambda done, total: moved.emit(done, total), cancel=cancel)

        BackgroundCall(work, self._on_done)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self._say("stopping; the part downloaded so far is kept for a resume…")

    def reject(self) -> None:  # noqa: D401 - Qt's name: closing stops a download under way
        self.cancel()
        super().reject()

    # ----- what comes back -------------------------------------------------------------------

    def _on_progress(self, done: Any, total: Any) -> None:
        if total:
            # QProgressBar counts in int; KiB keeps a 40 GB file under its limit.
            self.bar.setRange(0, int(total) // 1024)
            self.bar.setValue(int(done) // 1024)
        self.progress_label.setText(render_progress(int(done), int(total) if total else None,
                                                    time.monotonic() - self._started))

    def _on_done(self, future: Future) -> None:
        self._cancel = None
        self.cancel_button.setEnabled(False)
        self.ref_edit.setEnabled(True)
        self._on_ref_changed(self.ref_edit.text())
        try:
            result = future.result()
        except DownloadCancelled as exc:
            self.bar.setVisible(False)
            self._say(f"stopped: {exc}")
            return
        except DownloadError as exc:
            self.bar.setVisible(False)
            self._say(str(exc), error=True)
            return
        self.result = result
        name = result.path.stem
        verified = "SHA-256 verified" if result.verified else "not verified: the hub publishes no SHA-256"
        self._say(f"saved {result.path.name} ({verified}). Asking the service to serve it as {name!r}…")
        self.client.send("POST", "/admin/library/rescan", {}, self._on_rescanned, what="read the models folder")
        self.finished_download.emit(result)

    def _on_rescanned(self, ok: bool, code: int, data: Any, message: str) -> None:
        assert self.result is not None
        name = self.result.path.stem
        if ok and name in ((data or {}).get("added") or ()):
            self._say(f"saved {self.result.path.name}: served now as the model {name!r} (Models menu, chat picker)")
        elif ok:
            self._say(f"saved {self.result.path.name}; the service already had a model called {name!r}")
        else:
            self._say(f"saved {self.result.path.name}; it is served from the next start ({message})")

    def _say(self, text: str, *, error: bool = False) -> None:
        self.progress_label.setText(text)
        theme.set_text_color(self.progress_label,
                             colors.status_color("error", theme.current_palette().window) if error else None)
