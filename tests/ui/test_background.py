"""BackgroundCall: the work runs on a worker thread, its outcome on the GUI thread."""

from __future__ import annotations

import threading

import pytest

from tray_app.ui.background import BackgroundCall


def run(qtbot, work):
    outcome: dict = {}

    def on_done(future) -> None:
        outcome["gui_thread"] = threading.current_thread() is threading.main_thread()
        outcome["future"] = future

    call = BackgroundCall(work, on_done)
    with qtbot.waitSignal(call.delivered, timeout=10_000):
        pass
    return outcome


def test_work_runs_off_the_gui_thread_and_its_result_comes_back_on_it(qtbot) -> None:
    outcome = run(qtbot, lambda: threading.current_thread() is threading.main_thread())
    assert outcome["future"].result() is False  # the work did not run on the GUI thread
    assert outcome["gui_thread"] is True


def test_an_exception_in_the_work_is_raised_by_the_result(qtbot) -> None:
    def fail() -> None:
        raise ValueError("no such model")

    outcome = run(qtbot, fail)
    assert outcome["gui_thread"] is True
    with pytest.raises(ValueError, match="no such model"):
        outcome["future"].result()
