"""The guard against PySide6 6.12.0's lost references to None/True/False."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal

from tray_app.ui import qtcompat


class _Emitter(QObject):
    ticked = Signal(str)


def test_many_calls_and_emits_do_not_exhaust_none_or_the_bools() -> None:
    # Far more calls than None/True/False have references in a fresh process:
    # without the guard, a PySide6 with the bug aborts the interpreter here.
    holder = QObject()
    emitter = _Emitter()
    received: list[str] = []
    emitter.ticked.connect(received.append)
    for _ in range(100_000):
        holder.setObjectName("x")
    for _ in range(20_000):
        emitter.ticked.emit("t")
    assert len(received) == 20_000
    assert sys.getrefcount(None) > 0 and sys.getrefcount(True) > 0


def test_the_guard_is_only_active_when_needed() -> None:
    lost = qtcompat.measure()
    assert set(lost) == {"void", "emit"}
    if not any(lost.values()) or sys.version_info >= (3, 12):
        assert qtcompat.ACTIVE is False
    else:
        assert qtcompat.ACTIVE is True
        assert sys.getrefcount(None) > qtcompat._MARGIN // 2
