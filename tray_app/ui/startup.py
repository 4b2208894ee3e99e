"""What the desktop app sets up around the controller before Qt's loop runs:
the log file, quitting on SIGINT and SIGTERM, and whether there is a display
at all."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Callable

from PySide6.QtCore import QObject, QSocketNotifier

from ..core.base.files import PrivateRotatingFileHandler
from ..core.config import log_dir
from .windows import APP_LOG_NAME

log = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
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


def quit_on_signals(quit: Callable[[], None], parent: QObject) -> QSocketNotifier | None:
    """SIGINT/SIGTERM call `quit` on the GUI thread (workers stopped), with no polling timer."""
    try:
        reader, writer = socket.socketpair()
    except OSError:
        return None
    reader.setblocking(False)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read, parent)

    def woke() -> None:
        try:
            reader.recv(64)
        except OSError:
            pass
        quit()

    notifier.activated.connect(woke)
    notifier._sockets = (reader, writer)  # type: ignore[attr-defined] - keep them open
    return notifier


def no_display() -> str | None:
    if sys.platform.startswith("linux") and not os.environ.get("QT_QPA_PLATFORM") \
            and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        return "no display (neither DISPLAY nor WAYLAND_DISPLAY is set)"
    return None
