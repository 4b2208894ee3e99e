"""UI tests: pytest-qt, offscreen, against a real running service."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

import httpx
import pytest

from tray_app.core.memory import gguf_info


LONG_PROMPT = "Write a long story about a lighthouse keeper and the sea."

# The offscreen platform says this about every window it shows; it is
# the test platform talking, not the app.
OFFSCREEN_NOISE = r"This plugin does not support (propagateSizeHints|raise|grabWindow|requestActivate)"


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "tests/ui/" in str(item.path).replace("\\", "/"):
            # Any other Qt warning during a UI test fails it.
            item.add_marker(pytest.mark.qt_log_level_fail("WARNING"))
            item.add_marker(pytest.mark.qt_log_ignore(OFFSCREEN_NOISE))


@pytest.fixture(autouse=True)
def windows_outlive_their_test(monkeypatch):
    """A test's windows stay referenced until it is torn down.

    pytest-qt keeps only weak references to the widgets given to
    qtbot.addWidget, and processes events once the test function returns. A
    window then held only by reference cycles (a chart's lambda holds its
    panel) is freed by Python's cyclic GC whenever that runs; when it ran in
    the middle of the window's own pending paint event, Qt painted on a
    deleted widget and the process died (a segfault in HeadroomBar.paintEvent,
    depending on how many objects other imports had made). Here they live
    until pytest-qt has closed them, and are collected then, with nothing
    being painted."""
    from pytestqt.qtbot import QtBot

    kept: list = []
    add_widget = QtBot.addWidget

    def keeping(self, widget, **kwargs):
        kept.append(widget)
        return add_widget(self, widget, **kwargs)

    monkeypatch.setattr(QtBot, "addWidget", keeping)
    yield
    kept.clear()
    gc.collect()


@pytest.fixture
def live(service):
    """The service, back to normal before and after the test."""
    service.reset()
    yield service
    service.http.post("/admin/gpu", json={"paused": False, "simulated_pressure_mib": 0})
    for request in service.status()["requests"]:
        service.http.delete(f"/v1/requests/{request['id']}")
    service.wait_for(lambda s: not s["requests"], timeout=60, what="no requests in flight")


def wait_status(qtbot, service, predicate, timeout_ms: int = 60_000, what: str = "a /status condition") -> dict:
    """Wait for a /status condition while the Qt event loop keeps running
    (service.wait_for would sleep the GUI thread, and the UI's own requests
    with it)."""
    seen: dict = {}

    def check() -> bool:
        seen["status"] = service.status()
        return bool(predicate(seen["status"]))

    try:
        qtbot.waitUntil(check, timeout=timeout_ms)
    except Exception as exc:
        raise AssertionError(f"timed out waiting for {what}; last status: {seen.get('status')}") from exc
    return seen["status"]


@contextlib.contextmanager
def chat_window(qtbot, url: str, conversations_dir, **settings):
    """A shown ChatWindow on the service at url, its answer stopped and its client closed after."""
    from tray_app.ui.chat import ChatWindow
    from tray_app.ui.client import ServiceClient

    client = ServiceClient(url)
    client.start()
    window = ChatWindow(client, conversations_dir=conversations_dir, **settings)
    qtbot.addWidget(window)
    window.show()
    try:
        yield window
    finally:
        if window.busy:
            window.stop()
            qtbot.waitUntil(lambda: not window.busy, timeout=30_000)
        client.stop()


class Background:
    """A blocking httpx request on a thread: an outside client of the service."""

    def __init__(self, url: str, request_id: str, prompt: str = LONG_PROMPT, max_tokens: int = 1500,
                 stream: bool = True) -> None:
        self.request_id = request_id
        self.result: dict[str, Any] = {}
        self.done = threading.Event()

        def run() -> None:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream}
            try:
                with httpx.Client(base_url=url, timeout=300) as client:
                    # Named after itself, as an app would name itself in X-Client-Name.
                    response = client.post("/v1/chat/completions", json=body,
                                           headers={"X-Request-Id": request_id, "X-Client-Name": f"app {request_id}"})
                    self.result = {"status": response.status_code, "text": response.text,
                                   "headers": dict(response.headers)}
            except httpx.HTTPError as exc:
                self.result = {"error": repr(exc)}
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self, qtbot, timeout_ms: int = 120_000) -> dict[str, Any]:
        """Wait with the Qt event loop running (the UI's own requests go out meanwhile)."""
        qtbot.waitUntil(self.done.is_set, timeout=timeout_ms)
        return self.result


@pytest.fixture
def controller(qtbot, live):
    """The tray's controller on the live service, without a system tray."""
    from tray_app.core.config import Config
    from tray_app.ui.app import TrayController
    from tray_app.ui.client import ServiceClient

    client = ServiceClient(live.url)
    controller = TrayController(client, Config(), tray_available=False)
    controller.exit_app = lambda: None
    controller.client.start()
    yield controller
    client.stop()
    for window in (controller.windows.panel_window, controller.windows.chat_window):
        if window is not None:
            window.close_quits = False
            window.hide()
            window.deleteLater()


@pytest.fixture
def background(live):
    started: list[Background] = []

    def start(request_id: str, **kwargs) -> Background:
        request = Background(live.url, request_id, **kwargs)
        started.append(request)
        return request

    yield start
    for request in started:
        live.http.delete(f"/v1/requests/{request.request_id}")
    for request in started:
        request.done.wait(60)


@pytest.fixture
def parser_threads(monkeypatch) -> list[threading.Thread]:
    """The threads the real model-file parser runs on, as the dialog calls it."""
    threads: list[threading.Thread] = []
    real_parser = gguf_info.read_model_info

    def recording_parser(path):
        threads.append(threading.current_thread())
        return real_parser(path)

    monkeypatch.setattr(gguf_info, "read_model_info", recording_parser)
    return threads
