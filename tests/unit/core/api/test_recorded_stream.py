"""RecordedStream: a streamed answer written straight to ASGI's send, and
what it keeps for an Idempotency-Key replay."""

from __future__ import annotations

import asyncio

import pytest

from tray_app.core.api.sinks import RecordedStream


class Client:
    """The ASGI side: what the stream sent, and a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    @property
    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent if m["type"] == "http.response.body"]


def finished_with(stream: RecordedStream) -> list:
    finished: list = []
    stream.on_finish = lambda recorded, completed: finished.append((recorded, completed))
    return finished


def test_each_chunk_goes_out_as_written_then_the_end():
    stream = RecordedStream({"X-Request-Id": "r1"}, "text/event-stream")
    finished = finished_with(stream)

    async def produce(write):
        await write(b"data: 1\n\n")
        await write(b"")  # nothing to send: no empty chunk goes out (it would end a chunked body)
        await write(b"data: 2\n\n")
        stream.completed = True

    stream.relay(produce)
    client = Client()
    asyncio.run(stream({"type": "http"}, client.receive, client.send))

    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"x-request-id"] == b"r1"
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert b"content-length" not in headers  # the length is unknown: chunked
    assert client.bodies == [(b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"", False)]
    assert finished == [(("stream", {"X-Request-Id": "r1"}, [b"data: 1\n\n", b"data: 2\n\n"], "text/event-stream"),
                         True)]


def test_a_stream_cut_short_is_recorded_as_incomplete_and_not_ended():
    stream = RecordedStream({}, "application/x-ndjson")
    finished = finished_with(stream)

    async def produce(write):
        await write(b'{"a":1}\n')
        raise asyncio.CancelledError  # the server stopping mid-answer

    stream.relay(produce)
    client = Client()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stream({"type": "http"}, client.receive, client.send))
    assert client.bodies == [(b'{"a":1}\n', True)]  # no end of body: the client sees it cut
    assert finished == [(("stream", {}, [b'{"a":1}\n'], "application/x-ndjson"), False)]
