"""The tray's poll rate follows its windows and the service's state: seldom
with the panel and chat closed and nothing in flight, every second (and a
poll at once) when the panel opens or a request shows up (issue 32, part 6)."""

from __future__ import annotations

from tray_app.ui.poll_rate import ACTIVE_POLL_MS, IDLE_POLL_MS

from .test_chat_and_tray_fed import dead_url, feed, fed_controller  # noqa: F401 - fixtures
from .test_viewmodel import READY


def test_the_poll_rate_follows_the_panel_the_chat_and_the_requests(qtbot, fed_controller, monkeypatch):  # noqa: F811
    controller, client = fed_controller, fed_controller.client
    polls: list[bool] = []
    monkeypatch.setattr(client, "poll_now", lambda: polls.append(True))
    feed(controller, READY)
    assert client.interval_ms == IDLE_POLL_MS and polls == []
    controller.windows.show_panel()
    assert client.interval_ms == ACTIVE_POLL_MS and polls == [True]  # fresh numbers as it opens
    controller.windows.panel().hide()
    assert client.interval_ms == IDLE_POLL_MS
    controller.windows.show_chat()
    assert client.interval_ms == ACTIVE_POLL_MS
    controller.windows.chat().hide()
    assert client.interval_ms == IDLE_POLL_MS
    feed(controller, {**READY, "requests": [{"id": "r", "state": "running", "path": "gpu"}]})
    assert client.interval_ms == ACTIVE_POLL_MS
    feed(controller, READY)
    client.unreachable.emit("no answer")
    assert client.interval_ms == ACTIVE_POLL_MS
