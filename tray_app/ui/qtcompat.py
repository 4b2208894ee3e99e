"""Guard against a PySide6 reference-counting bug (PySide6 6.12.0 on CPython 3.11).

In that release, every call from Python to a Qt method that returns void
gives back None without taking a reference to it, and `Signal.emit()` /
`disconnect()` do the same with True/False. Each call leaves None (or a bool)
with one reference fewer. CPython 3.12+ makes these objects immortal, so
nothing happens there; on 3.11 a long-running app (a label updated each second,
a signal per streamed token) reaches zero after some tens of thousands of
calls and aborts with "Fatal Python error: none_dealloc: deallocating None".
PySide6 6.11.3 does not have the bug.

On import this module measures whether the installed PySide6 leaks; only if it
does, and only on a CPython without immortal objects, it adds a large margin
to the reference counts of None, True and False (objects that are never freed
anyway), so the app can run for years. Nothing changes on a good PySide6.
"""

from __future__ import annotations

import ctypes
import sys

from PySide6 import __version__ as PYSIDE_VERSION
from PySide6.QtCore import QObject, Signal

_SAMPLES = 32
# Far more than any process will leak, far less than overflows a Py_ssize_t.
_MARGIN = sys.maxsize // 8


class _Probe(QObject):
    fired = Signal(int)


def measure() -> dict[str, int]:
    """References lost per call: {'void': to None, 'emit': to True/False}."""
    probe = _Probe()
    none_before = sys.getrefcount(None)
    for _ in range(_SAMPLES):
        probe.setObjectName("probe")
    none_lost = none_before - sys.getrefcount(None)
    bools_before = sys.getrefcount(True) + sys.getrefcount(False)
    for i in range(_SAMPLES):
        probe.fired.emit(i)
    bools_lost = bools_before - (sys.getrefcount(True) + sys.getrefcount(False))
    return {"void": round(none_lost / _SAMPLES), "emit": round(bools_lost / _SAMPLES)}


def _immortal_singletons() -> bool:
    return sys.implementation.name != "cpython" or sys.version_info >= (3, 12)


def _pad(obj: object) -> None:
    refcount = ctypes.c_ssize_t.from_address(id(obj))
    if refcount.value < _MARGIN:
        refcount.value += _MARGIN


def guard() -> bool:
    """Pad the singletons' reference counts if this PySide6 leaks them; True if it did."""
    lost = measure()
    if not any(lost.values()) or _immortal_singletons():
        return False
    for obj in (None, True, False):
        _pad(obj)
    return True


def describe() -> str:
    return (f"PySide6 {PYSIDE_VERSION} on Python {sys.version.split()[0]} loses a reference to None/True/False "
            "on each call; worked around (PySide6 6.11.3, or Python 3.12+, does not need the workaround)")


ACTIVE = guard()
