"""The chat window against the real service: streaming, route line, Stop,
the conversation, and the degraded banner's Cancel on its own queued request."""

from __future__ import annotations

import re

import pytest
from PySide6.QtCore import Qt

from tray_app.ui.chat import ChatStream, ChatWindow
from tray_app.ui.client import ServiceClient

from .conftest import LONG_PROMPT, chat_window, wait_status

WAIT_MS = 120_000


@pytest.fixture
def chat(qtbot, live, tmp_path):
    # Greedy decoding: the answers, and so what the tests can say of them,
    # are the same on every run (a sampled answer was once two emoji long).
    with chat_window(qtbot, live.url, tmp_path / "conversations", max_tokens=48, temperature=0) as window:
        yield window


@pytest.mark.integration
def test_streams_a_real_answer_and_says_which_path_served_it(qtbot, chat, live) -> None:
    deltas: list[str] = []
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as finished:
        assert chat.send("Count from one to ten in words.")
        chat.stream.delta.connect(deltas.append)
    assert finished.args == ["ok"]
    answer = chat.turns[-1]
    assert answer.text and answer.text == "".join(deltas)
    assert len(deltas) >= 3  # it arrived token by token, not in one piece
    assert answer.meta.startswith("served by GPU · admitted · took ")
    assert re.search(r" · took .+ · \d+(\.\d)? tok/s( · |$)", answer.meta), answer.meta
    assert chat.history == [{"role": "user", "content": "Count from one to ten in words."},
                            {"role": "assistant", "content": answer.text}]
    assert "served by GPU · admitted" in chat.transcript.toPlainText()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()


@pytest.mark.integration
def test_the_stream_counts_the_servers_tokens(qtbot, live) -> None:
    client = ServiceClient(live.url)
    stream = ChatStream(client, [{"role": "user", "content": "Count from one to ten in words."}], max_tokens=12,
                        temperature=0)
    with qtbot.waitSignal(stream.finished, timeout=WAIT_MS):
        stream.start()
    # The usage chunk (stream_options.include_usage) says how many tokens; the
    # chunks that carried text can be fewer (a token may be half a character).
    assert stream.completion_tokens is not None and 0 < stream.chunks <= stream.completion_tokens <= 12
    assert stream.tokens == stream.completion_tokens
    assert stream.speed_text().endswith(" tok/s")


@pytest.mark.integration
def test_a_system_prompt_and_regenerate_against_the_real_service(qtbot, chat, tmp_path) -> None:
    chat.system_edit.setPlainText("You answer in one short sentence.")
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as first:
        chat.send("What is a lighthouse?")
        sent = chat.stream.messages
    assert first.args == ["ok"]
    assert sent[0] == {"role": "system", "content": "You answer in one short sentence."}
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as again:
        assert chat.regenerate()
        resent = chat.stream.messages
    assert again.args == ["ok"] and resent == sent
    assert [t.role for t in chat.turns] == ["user", "assistant"] and chat.turns[-1].text
    assert chat.history == [{"role": "user", "content": "What is a lighthouse?"},
                            {"role": "assistant", "content": chat.turns[-1].text}]
    saved = list((tmp_path / "conversations").glob("*.json"))
    assert len(saved) == 1 and "You answer in one short sentence." in saved[0].read_text()


@pytest.mark.integration
def test_keeps_the_conversation_and_sends_it_each_turn(qtbot, chat) -> None:
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS):
        chat.send("My name is Ada. Reply with one word.")
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as second:
        chat.send("What is my name?")
        sent = chat.stream.messages
    assert second.args == ["ok"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == "My name is Ada. Reply with one word."
    assert len(chat.history) == 4
    # Hiding the window keeps the session; "New chat" starts over.
    chat.close()
    assert not chat.isVisible() and len(chat.turns) == 4
    chat.clear()
    assert chat.turns == [] and chat.history == []


@pytest.mark.integration
def test_stop_cancels_the_generation_through_the_service(qtbot, chat, live) -> None:
    chat.max_tokens = 300
    chat.send(LONG_PROMPT)
    request_id = chat.request_id
    qtbot.waitUntil(lambda: len(chat.turns[-1].text) > 20, timeout=WAIT_MS)
    assert any(r["id"] == request_id for r in live.status()["requests"])
    with qtbot.waitSignal(chat.answer_finished, timeout=30_000) as finished:
        qtbot.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    assert finished.args == ["stopped"]
    assert chat.turns[-1].error == "Stopped."
    assert chat.turns[-1].text  # what was said stays
    assert not any(r["id"] == request_id for r in live.status()["requests"])
    events = [e for e in live.status()["events"] if e.get("kind") == "canceled"]
    assert any(e.get("id") == request_id for e in events), events
    # The partial answer is kept in the conversation.
    assert chat.history[-1]["role"] == "assistant"


@pytest.mark.integration
def test_esc_stops_a_real_generation_like_the_stop_button(qtbot, chat, live) -> None:
    chat.max_tokens = 300
    chat.activateWindow()
    qtbot.waitUntil(chat.isActiveWindow, timeout=5000)
    chat.input.setPlainText(LONG_PROMPT)
    qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)  # Ctrl+Enter sends
    assert chat.busy
    request_id = chat.request_id
    qtbot.waitUntil(lambda: len(chat.turns[-1].text) > 20, timeout=WAIT_MS)
    with qtbot.waitSignal(chat.answer_finished, timeout=30_000) as finished:
        qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    assert finished.args == ["stopped"]
    assert chat.turns[-1].error == "Stopped."
    assert not any(r["id"] == request_id for r in live.status()["requests"])


@pytest.mark.integration
def test_degraded_banner_in_chat_cancels_its_own_queued_request(qtbot, chat, live, background) -> None:
    live.http.post("/admin/gpu", json={"paused": True})
    background("chat-blocker")
    wait_status(qtbot, live, lambda s: any(r["id"] == "chat-blocker" and r["state"] == "running" for r in s["requests"]),
                what="the CPU busy with another client's request")
    chat.send("Say hello.")
    request_id = chat.request_id
    wait_status(qtbot, live, lambda s: any(r["id"] == request_id and r["state"] == "queued" for r in s["requests"]),
                what="the chat's request queued")
    qtbot.waitUntil(lambda: chat.banner.cancel_button(request_id) is not None, timeout=WAIT_MS)
    banner = chat.banner
    assert banner.isVisible()
    assert banner.values["reason"].text() == "The GPU path is paused (force CPU)"
    assert "you are 1st in the queue" in banner.values["limits"].text()
    assert re.fullmatch(r"Your request · 1st in the CPU queue · (about .+ left|due now|overdue by .+)",
                        banner._rows[request_id][1].text())
    assert banner.values["latency"].text().startswith("a new request would be answered in about ")
    assert "Waiting in the CPU queue" in chat.state_label.text()
    with qtbot.waitSignal(chat.answer_finished, timeout=30_000) as finished:
        qtbot.mouseClick(banner.cancel_button(request_id), Qt.MouseButton.LeftButton)
    assert finished.args == ["stopped"]
    assert not any(r["id"] == request_id for r in live.status()["requests"])
    assert any(r["id"] == "chat-blocker" for r in live.status()["requests"])  # not the other client's
    assert chat.history == []  # nothing came back, so the question isn't repeated next turn


@pytest.mark.integration
def test_a_cpu_answer_says_so_with_the_reason_in_words(qtbot, chat, live) -> None:
    live.http.post("/admin/gpu", json={"paused": True})
    wait_status(qtbot, live, lambda s: s["degraded"]["active"], what="degraded mode")
    with qtbot.waitSignal(chat.answer_finished, timeout=WAIT_MS) as finished:
        chat.send("Say hi.")
    assert finished.args == ["ok"]
    meta = chat.turns[-1].meta
    model = live.status()["degraded"]["fallback_model"]
    assert meta.startswith(f"served by CPU · GPU paused (force CPU) · {model} · took "), meta


@pytest.mark.integration
def test_errors_from_the_service_are_shown_not_raised(qtbot, live) -> None:
    client = ServiceClient(live.url)
    stream = ChatStream(client, [{"role": "bogus", "content": "x"}])
    with qtbot.waitSignal(stream.failed, timeout=30_000) as failed:
        stream.start()
    message, code = failed.args
    assert code == "invalid_value" and "is not a known role" in message


def test_no_service_is_an_error_line_not_a_hang(qtbot) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ServiceClient(f"http://127.0.0.1:{port}")
    window = ChatWindow(client)
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.answer_finished, timeout=30_000) as finished:
        window.send("hello?")
    assert finished.args == ["failed"]
    assert "the connection to the service failed" in window.turns[-1].error
    assert window.history == []
