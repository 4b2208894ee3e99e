"""Run one blocking call on a worker thread and hand its outcome to the GUI thread.

Reading a model file's header is the case in point: for a stranger's file it
may take seconds (up to the parser's caps), and on the GUI thread that would
freeze the tray and every window meanwhile.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

# Calls whose outcome has not been delivered yet. Holding them here, not as Qt
# children of a window, keeps the worker thread from emitting on an object
# the GUI thread may be deleting at that moment.
_in_flight: set[BackgroundCall] = set()


class BackgroundCall(QObject):
    """Starts `work()` on a daemon thread; `on_done(future)` then runs on the
    GUI thread, where `future.result()` returns or raises what `work` did."""

    # Emitted from the worker thread; Qt queues it to this object's thread (the GUI's).
    _finished = Signal(object)
    # After on_done has run: lets a caller (or a test) wait for the outcome.
    delivered = Signal()

    def __init__(self, work: Callable[[], Any], on_done: Callable[[Future], None]) -> None:
        super().__init__()
        self._on_done = on_done
        self._finished.connect(self._deliver)
        _in_flight.add(self)
        threading.Thread(target=self._run, args=(work,), name="tray-app-background", daemon=True).start()

    def _run(self, work: Callable[[], Any]) -> None:
        future: Future = Future()
        try:
            future.set_result(work())
        except Exception as exc:  # noqa: BLE001 - handed to on_done, which decides
            future.set_exception(exc)
        self._finished.emit(future)

    def _deliver(self, future: Future) -> None:
        _in_flight.discard(self)
        try:
            self._on_done(future)
        finally:
            self.delivered.emit()
