"""The whole answer's sink: its job is estimated again when each attempt's first event comes."""

from __future__ import annotations

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
