"""Every SSE reader splits lines where SSE does (LF, CRLF), never on the
Unicode line separators JSON leaves raw inside strings (U+0085, U+2028,
U+2029). The drill's two readers are tested against a real loopback HTTP
server that streams an answer whose token holds them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from tray_app.core.base.http_basics import SseLineSplitter, SseLineTooLong, sse_lines
from tray_app.drill import profiles
from tray_app.drill.client import DrillClient, DrillClock
from tray_app.drill.records import RequestRecord

# A token with every separator that str.splitlines (and httpx's iter_lines) splits on but SSE doesn't.
TOKEN = "a\u2028b\u2029c\u0085d"


def _event(payload: object) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


ANSWER = (_event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
          + _event({"choices": [{"index": 0, "delta": {"content": TOKEN}, "finish_reason": None}]})
          + _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
          + b"data: [DONE]\n\n")


@pytest.fixture()
def sse_server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.end_headers()
            self.wfile.write(ANSWER)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - the http.server signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_drill_client_keeps_a_unicode_line_separator_inside_a_token(sse_server):
    client = DrillClient(sse_server, DrillClock())
    try:
        record = client.send(RequestRecord(id="req-sep", phase="t", label="t", kind="chat", stream=True,
                                           max_tokens=8), {"messages": [{"role": "user", "content": "hi"}]})
    finally:
        client.close()
    assert record.transport_error is None
    assert record.output_text == TOKEN
    assert record.saw_done


def test_the_drill_profiles_stream_keeps_a_unicode_line_separator_inside_a_token(sse_server):
    ttft, _ = profiles._one_stream(sse_server)
    # One content event, read whole: the first token's time is known.
    assert ttft is not None


def test_the_splitter_cuts_lines_only_at_line_feeds_even_across_chunks():
    wire = _event({"content": TOKEN}).replace(b"\n\n", b"\r\n\r\n") + b"data: [DONE]"
    # Three-byte chunks cut through the separators' UTF-8 sequences too.
    lines = list(sse_lines(wire[start:start + 3] for start in range(0, len(wire), 3)))
    assert lines == [f"data: {json.dumps({'content': TOKEN}, ensure_ascii=False)}", "", "data: [DONE]"]


def test_the_splitter_refuses_a_line_that_never_ends():
    splitter = SseLineSplitter(max_line_bytes=8)
    assert splitter.feed(b"data: 1\n") == ["data: 1"]
    with pytest.raises(SseLineTooLong):
        splitter.feed(b"data: 123456789")
