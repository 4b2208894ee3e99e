"""The chat window and the tray controller fed with snapshots, no service:
which request a Cancel reaches, the live time left, notification clicks."""

from __future__ import annotations

import socket

import pytest

from tray_app.core.config import Config
from tray_app.ui.app import TrayController
from tray_app.ui.chat import ChatWindow
from tray_app.ui.client import ServiceClient

from tray_app.ui import viewmodel as vm

from .test_viewmodel import READY, busy_overflow, paused


@pytest.fixture
def dead_url():
    """A port nothing listens on: a chat request there fails at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def chat(qtbot, dead_url, monkeypatch):
    client = ServiceClient(dead_url)  # never started: the test feeds snapshots
    window = ChatWindow(client)
    qtbot.addWidget(window)
    window.show()
    window.canceled: list[str] = []
    monkeypatch.setattr(client, "cancel", lambda request_id, callback=None: window.canceled.append(request_id))
    return window


def with_cpu_requests(*requests: dict) -> dict:
    status = paused()
    status["requests"] = [{"state": "running", "path": "cpu", "reason": "forced_cpu", **r} for r in requests]
    return status


def test_an_idle_chat_offers_no_cancel_for_other_clients_requests(qtbot, chat) -> None:
    chat.client.status_changed.emit(with_cpu_requests({"id": "other", "age_s": 2.0, "estimated_latency_s": 30.0}))
    assert chat.banner.isVisible()  # degraded mode is still explained
    assert chat.banner.cancel_button("other") is None
    assert chat.banner.banner.requests == ()


def test_a_row_cancel_cancels_that_request_not_the_chats_own(qtbot, chat) -> None:
    with qtbot.waitSignal(chat.answer_finished, timeout=30_000):
        chat.send("hello?")
        own = chat.request_id
        # A row for another request, as an earlier banner could have left it.
        chat.banner.cancel_requested.emit("other")
        assert chat.canceled == ["other"]
        assert not chat.stream.stopping
        chat.banner.cancel_requested.emit(own)
        assert chat.canceled == ["other", own]


def test_the_answer_line_says_time_left_then_overdue_on_each_poll(qtbot, chat) -> None:
    with qtbot.waitSignal(chat.answer_finished, timeout=30_000):
        chat.send("hello?")
        own = chat.request_id
        # The service's headers, as they arrive for a CPU answer: the estimate is fixed at admission.
        chat._on_routed({"served_by": "cpu", "reason": "forced_cpu", "fallback_model": "Small",
                         "estimated_latency": "50.0", "request_id": own})
        chat.client.status_changed.emit(with_cpu_requests({"id": own, "age_s": 8.0, "estimated_latency_s": 30.0}))
        assert chat.turns[-1].meta == "served by CPU · GPU paused (force CPU) · Small · about 22 s left"
        chat.client.status_changed.emit(with_cpu_requests({"id": own, "age_s": 42.0, "estimated_latency_s": 30.0}))
        assert chat.turns[-1].meta == "served by CPU · GPU paused (force CPU) · Small · overdue by 12 s"
        assert chat.banner.banner.requests[0].text == "Your request · running on the CPU · overdue by 12 s"
        assert chat.banner.values["latency"].text() == "a new request would wait about 26 s"


def test_clicking_a_notification_opens_the_panel(qtbot, dead_url) -> None:
    controller = TrayController(ServiceClient(dead_url), Config(), tray_available=True)
    controller.exit_app = lambda: None
    try:
        assert controller._panel is None or not controller._panel.isVisible()
        controller.tray.messageClicked.emit()
        panel = controller.panel()
        qtbot.addWidget(panel)
        assert panel.isVisible()
    finally:
        controller.tray.hide()


def test_a_burst_overflowing_a_busy_gpu_posts_no_notices(qtbot, dead_url) -> None:
    client = ServiceClient(dead_url)  # never started: the test feeds snapshots
    controller = TrayController(client, Config(), tray_available=False)
    for _ in range(10):
        client.status_changed.emit(busy_overflow())
        assert controller.notices == []
        assert controller.state_action.text() == vm.BUSY_TITLE
        client.status_changed.emit(READY)
        assert controller.notices == []
        assert controller.state_action.text() == vm.STATE_TITLES[vm.GPU]
