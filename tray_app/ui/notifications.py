"""The tray's notifications: what the service's state changes are worth a
word, and the desktop notification that says it."""

from __future__ import annotations

import html
import logging
import sys

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QSystemTrayIcon

from . import viewmodel as vm

log = logging.getLogger(__name__)

NOTIFY_MS = 8000
# Kinds that mean something is wrong, shown with the warning icon.
WARNING_KINDS = ("degraded_start", "down", "error")


def notification_body(message: str, platform: str = sys.platform) -> str:
    """A notification's body as written. On Linux the notification server may
    read the body as markup (the freedesktop spec's body-markup), and a body
    holds model, peer and app names from elsewhere: escaped, a name like
    "<img src=...>" shows as text instead of loading anything."""
    return html.escape(message, quote=False) if platform.startswith("linux") else message


class Notifications(QObject):
    """Every notice of this session, kept in `notices` and logged, and shown
    as a desktop notification where the tray icon can show one."""

    notified = Signal(str, str, str)   # (kind, title, message)

    def __init__(self, tray: QSystemTrayIcon | None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.tray = tray
        self.notices: list[tuple[str, str, str]] = []
        self.watch_new_service()

    def watch_new_service(self) -> None:
        """Forget what the last service went through: a restarted one starts
        with no degraded spell or residency change to end."""
        self.degraded_notifier = vm.DegradedNotifier()
        self.residency_notifier = vm.ResidencyNotifier()

    def check(self, status: dict) -> None:
        """Notify what changed with this /status that is worth a word."""
        for notifier in (self.residency_notifier, self.degraded_notifier):
            notice = notifier.update(status)
            if notice is not None:
                self.notify(notice.kind, notice.title, notice.message)

    def notify(self, kind: str, title: str, message: str) -> None:
        log.info("notice: %s: %s", title, message.replace("\n", " "))
        self.notices.append((kind, title, message))
        if self.tray is not None and self.tray.isVisible() and self.tray.supportsMessages():
            icon = QSystemTrayIcon.MessageIcon.Warning if kind in WARNING_KINDS \
                else QSystemTrayIcon.MessageIcon.Information
            self.tray.showMessage(title, notification_body(message), icon, NOTIFY_MS)
        self.notified.emit(kind, title, message)
