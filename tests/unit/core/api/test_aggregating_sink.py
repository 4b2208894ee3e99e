"""The whole answer's sink: its job is estimated again when each attempt's first event comes."""

from __future__ import annotations

import asyncio

from tests.fakes.service import in_process_service, isolate_user_folders
from tray_app.core.api.sinks import AggregatingSink


def test_the_first_event_of_each_attempt_asks_for_a_fresh_estimate_once():
    asked: list[int] = []
    sink = AggregatingSink(on_first_event=lambda: asked.append(len(sink.events)))
    sink.emit({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    sink.emit({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
    assert asked == [0]
    # A replay (the GPU worker failed before the end): the next attempt's first event asks again.
    sink.reset()
    sink.emit({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert asked == [0, 0] and len(sink.events) == 1


def test_without_a_callback_it_only_collects():
    sink = AggregatingSink()
    sink.emit({"choices": []})
    assert sink.events == [{"choices": []}]


async def test_a_whole_answers_estimate_is_made_again_at_its_first_token(tmp_path, monkeypatch):
    """The real app in-process: the worker holds the first byte for 2 s, so the estimate made
    at the first token (its age so far, then the rest) is over 2 s, where admission's, which
    the header and the banner kept before, was about half a second."""
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        first_byte = asyncio.Event()
        rig.upstream.script("cpu").hold = first_byte
        answer = asyncio.create_task(rig.client.post(
            "/v1/chat/completions", headers={"X-Force-Path": "cpu", "X-Request-Id": "held"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        admitted = None
        while admitted is None:
            await asyncio.sleep(0.05)
            rows = (await rig.client.get("/status")).json()["requests"]
            admitted = next((row["estimated_latency_s"] for row in rows if row["id"] == "held"), None)
        assert admitted < 1.0
        await asyncio.sleep(2.0)
        first_byte.set()
        response = await answer
        assert response.status_code == 200, response.text
        assert float(response.headers["X-Estimated-Latency"]) >= max(2.0, admitted + 1.0)
