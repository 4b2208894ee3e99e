"""The chat window and the tray controller fed with snapshots, no service:
which request a Cancel reaches, the live time left, streaming in place,
notification and tray clicks, asking before a restart stops requests."""

from __future__ import annotations

import socket

import pytest
from PySide6.QtWidgets import QApplication, QMessageBox, QSystemTrayIcon

from tray_app.core.config import Config
from tray_app.ui.app import TrayController
from tray_app.ui.chat import ChatWindow
from tray_app.ui.client import ServiceClient

from tests.status_sample import conforming
from tray_app.ui import viewmodel as vm

from .test_viewmodel import READY, busy_overflow, paused, whole_request, whole_requests


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


class Asked(list):
    """The questions QMessageBox.question was asked, and the answer it gives."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = QMessageBox.StandardButton.No

    def question(self, parent, title, text, *args):
        self.append(text)
        return self.answer


@pytest.fixture
def asked(monkeypatch) -> Asked:
    asked = Asked()
    monkeypatch.setattr(QMessageBox, "question", staticmethod(asked.question))
    return asked


@pytest.fixture
def fed_controller(dead_url, monkeypatch):
    client = ServiceClient(dead_url)  # never started: the test feeds snapshots
    controller = TrayController(client, Config(), tray_available=True)
    controller.exit_app = lambda: None
    controller.restarts = []
    monkeypatch.setattr(client, "restart_workers", lambda callback=None: controller.restarts.append(True))
    yield controller
    # Windows go before the controller whose actions and menus they show.
    controller.tray.hide()
    for window in (controller.windows.panel_window, controller.windows.chat_window):
        if window is not None:
            window.hide()
            window.deleteLater()
    QApplication.processEvents()


def feed(controller: TrayController, status: dict) -> None:
    """A status as the client hands it on: whole (the client checked it against the contract)."""
    status = conforming(status)
    controller.client.last_status = status
    controller.client.status_changed.emit(status)


def with_cpu_requests(*requests: dict) -> dict:
    status = paused()
    status["requests"] = whole_requests([{"state": "running", "path": "cpu", "reason": "forced_cpu", **r}
                                         for r in requests])
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
        assert chat.banner.values["latency"].text() == "a new request would be answered in about 26 s, queue included"


def test_each_poll_rewrites_the_answer_line_in_place_not_the_transcript(qtbot, chat, monkeypatch) -> None:
    from tray_app.ui import chat as chat_module, chat_transcript

    monkeypatch.setattr(chat_module.ChatStream, "start", lambda self: None)  # the test plays the service
    chat.send("hello?")
    own = chat.request_id
    chat._on_routed({"served_by": "cpu", "reason": "forced_cpu", "fallback_model": "Small", "request_id": own})
    chat._on_delta("Once upon a time")
    qtbot.waitUntil(lambda: "Once upon a time" in chat.transcript.toPlainText())
    drawn: list[int] = []
    real = chat_transcript.render_html
    monkeypatch.setattr(chat_transcript, "render_html", lambda *args: drawn.append(1) or real(*args))
    for age in (8.0, 9.0, 10.0):
        chat.client.status_changed.emit(with_cpu_requests({"id": own, "age_s": age, "estimated_latency_s": 30.0}))
        qtbot.wait(80)  # past the 50 ms a scheduled redraw waits
        left = f"served by CPU · GPU paused (force CPU) · Small · about {30 - age:.0f} s left"
        text = chat.transcript.toPlainText()
        assert left in text and text.count("served by CPU") == 1
    # A whole transcript (long answers in it too) is not laid out again every second.
    assert drawn == []
    chat._on_delta(", a keeper")  # the answer still streams after its line changed
    qtbot.waitUntil(lambda: "Once upon a time, a keeper" in chat.transcript.toPlainText())
    assert "served by CPU · GPU paused (force CPU) · Small · about 20 s left" in chat.transcript.toPlainText()


def test_clicking_a_notification_opens_the_panel(qtbot, fed_controller) -> None:
    assert fed_controller.windows.panel_window is None or not fed_controller.windows.panel_window.isVisible()
    fed_controller.tray.messageClicked.emit()
    assert fed_controller.windows.panel().isVisible()


def test_a_burst_overflowing_a_busy_gpu_posts_no_notices(qtbot, dead_url) -> None:
    client = ServiceClient(dead_url)  # never started: the test feeds snapshots
    controller = TrayController(client, Config(), tray_available=False)
    for _ in range(10):
        client.status_changed.emit(busy_overflow())
        assert controller.notifications.notices == []
        assert controller.tray_menu.state_action.text() == vm.BUSY_TITLE
        client.status_changed.emit(READY)
        assert controller.notifications.notices == []
        assert controller.tray_menu.state_action.text() == vm.STATE_TITLES[vm.GPU]


# ----- confirmations before a restart stops requests, and the tray click -------------------

def test_restart_with_requests_running_asks_and_no_keeps_them(qtbot, fed_controller, asked) -> None:
    status = with_cpu_requests({"id": "a", "age_s": 2.0})
    status["requests"].append(whole_request({"id": "b", "state": "queued", "path": "cpu", "queue_position": 1}))
    feed(fed_controller, status)
    fed_controller.tray_menu.restart_action.trigger()
    assert asked == ["1 running and 1 queued requests are in the service. Restarting the workers now will stop "
                     "them; the clients get an error. Continue?"]
    assert fed_controller.restarts == []
    asked.answer = QMessageBox.StandardButton.Yes
    fed_controller.tray_menu.restart_action.trigger()
    assert len(asked) == 2
    assert fed_controller.restarts == [True]


def test_restart_of_an_idle_service_does_not_ask(qtbot, fed_controller, asked) -> None:
    feed(fed_controller, READY)
    fed_controller.tray_menu.restart_action.trigger()
    assert asked == []
    assert fed_controller.restarts == [True]


class FakeRunner:
    """Stands in for the ServiceRunner: records restarts."""

    starting = False
    error = None

    def __init__(self) -> None:
        self.restarts: list[Config] = []

    def restart(self, config: Config) -> None:
        self.restarts.append(config)


def test_choosing_a_model_with_requests_running_asks_first(qtbot, fed_controller, asked, tmp_path) -> None:
    from concurrent.futures import Future

    from tray_app.core.config import bundled_model_path

    fed_controller.config = Config(source=tmp_path / "config.toml")
    fed_controller.runner = runner = FakeRunner()
    feed(fed_controller, with_cpu_requests({"id": "a", "age_s": 2.0}))
    checked: Future = Future()
    checked.set_result(None)  # the model file was read and is usable
    model = str(bundled_model_path())

    def model_checked() -> None:
        fed_controller.commands.model_check = check = object()
        fed_controller.commands._on_model_checked(check, model, checked)

    model_checked()
    assert asked == ["1 running request is in the service. Switching the model now will stop it; "
                     "the clients get an error. Continue?"]
    assert runner.restarts == [] and not (tmp_path / "config.toml").exists()
    asked.answer = QMessageBox.StandardButton.Yes
    model_checked()
    assert [config.model.path for config in runner.restarts] == [model]


def test_tray_click_raises_a_buried_panel_and_hides_only_an_active_one(qtbot, fed_controller, monkeypatch) -> None:
    panel = fed_controller.windows.panel()
    fed_controller.windows.show_panel()
    raised: list[str] = []
    monkeypatch.setattr(panel, "raise_", lambda: raised.append("raise"))
    monkeypatch.setattr(panel, "activateWindow", lambda: raised.append("activate"))
    # Visible but buried under another window: not the active one.
    monkeypatch.setattr(panel, "isActiveWindow", lambda: False)
    fed_controller.tray.activated.emit(QSystemTrayIcon.ActivationReason.Trigger)
    assert panel.isVisible()
    assert raised == ["raise", "activate"]
    monkeypatch.setattr(panel, "isActiveWindow", lambda: True)
    fed_controller.tray.activated.emit(QSystemTrayIcon.ActivationReason.Trigger)
    assert not panel.isVisible()


# ----- streaming appends in place ------------------------------------------------------------

def test_streaming_appends_in_place_and_keeps_a_selection(qtbot, chat, monkeypatch) -> None:
    from tray_app.ui.chat import ChatStream

    monkeypatch.setattr(ChatStream, "start", lambda self: None)  # the test plays the service
    route = {"served_by": "gpu", "reason": "gpu_ready", "fallback_model": None}
    chat.send("first question")
    chat._on_routed(route)
    chat._on_delta("first answer")
    chat._on_finished("stop")
    chat.send("second question")
    chat._on_routed(route)
    chat._on_delta("Once")
    qtbot.waitUntil(lambda: "Once" in chat.transcript.toPlainText())

    document = chat.transcript.document()
    chat.transcript.setTextCursor(document.find("first answer"))
    set_html_calls: list[str] = []
    real_set_html = chat.transcript.setHtml
    monkeypatch.setattr(chat.transcript, "setHtml",
                        lambda text: (set_html_calls.append(text), real_set_html(text))[-1])
    for chunk in (" upon", " a time,\nthere", " was a sea."):
        chat._on_delta(chunk)
        qtbot.waitUntil(lambda: not chat.transcript.render_pending)
    assert "Once upon a time,\u2028there was a sea.\u25ae" in document.toPlainText().replace("\n", "\u2028")
    assert set_html_calls == []
    appended_end = document.find("sea.")
    assert appended_end.charFormat().foreground().color() != document.find("\u25ae").charFormat().foreground().color()
    assert chat.transcript.textCursor().selectedText() == "first answer"

    # What was appended reads the same as a full redraw would.
    appended = document.toPlainText()
    chat._render()
    assert document.toPlainText() == appended
    assert chat.transcript.textCursor().selectedText() == "first answer"
    chat._on_finished("stop")
    assert chat.transcript.toPlainText().count("Once upon a time,") == 1


def test_the_tray_menu_shows_the_headroom_under_the_state(qtbot, fed_controller) -> None:
    actions = fed_controller.tray_menu.menu.actions()
    headroom = fed_controller.tray_menu.headroom_action
    assert actions[1] is headroom and not headroom.isEnabled()
    feed(fed_controller, READY)
    assert fed_controller.tray_menu.headroom_action.text() == vm.menu_headroom_text(READY, Config().cpu.ram_floor_mib)
    assert fed_controller.tray_menu.headroom_action.text().startswith("VRAM ")


# ----- sharing the GPU from the tray menu ---------------------------------------------------

def test_the_menu_gives_the_gpu_back_and_shows_where_it_is(qtbot, fed_controller, monkeypatch) -> None:
    from .test_viewmodel import with_residency

    sent: list[bool] = []
    monkeypatch.setattr(fed_controller.client, "give_gpu_back", lambda given, callback=None: sent.append(given))
    fed_controller.notifications.notices = []
    feed(fed_controller, with_residency("loaded"))
    assert not fed_controller.tray_menu.residency_action.isVisible()
    assert fed_controller.tray_menu.give_back_action.text() == "Give the GPU &back now"
    fed_controller.tray_menu.give_back_action.trigger()
    feed(fed_controller, with_residency("given_back_by_user"))
    assert fed_controller.tray_menu.residency_action.isVisible()
    assert fed_controller.tray_menu.residency_action.text().startswith("GPU: given back by you")
    assert fed_controller.tray_menu.give_back_action.text() == "Use the GPU &again"
    fed_controller.tray_menu.give_back_action.trigger()
    assert sent == [True, False]
    feed(fed_controller, with_residency("given_away", text="GPU given to steam (9.1 GiB)"))
    feed(fed_controller, with_residency("loaded", last_load_s=1.5))
    assert not fed_controller.tray_menu.residency_action.isVisible()
    kinds = [notice[0] for notice in fed_controller.notifications.notices]
    assert kinds == ["gpu_given_back", "gpu_taken_again"]


def test_a_window_qt_already_destroyed_counts_as_closed_not_as_an_error(qtbot, fed_controller) -> None:
    # Seen when the X server died under the app: Qt destroyed the panel, and
    # the poll-rate timer then asked it whether it was visible, at quit.
    import shiboken6

    fed_controller.windows.show_panel()
    assert fed_controller.windows.watched_open()
    shiboken6.delete(fed_controller.windows.panel_window)
    assert fed_controller.windows.watched_open() is False
    fed_controller._update_poll_rate()  # raised RuntimeError before
    fed_controller.windows.panel_window = None  # gone: the fixture has nothing to close
