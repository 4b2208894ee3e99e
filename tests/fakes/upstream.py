"""An OpenAI-compatible upstream that answers like llama-server, in-process.

`FakeUpstream.transport()` is an httpx.MockTransport: give it to the
service's HTTP client (Service(http_transport=...)) or to any httpx client,
and each request to a FakeWorker's base_url (http://<name>.worker), or to a
peer configured at http://<name>.worker:<port>, is answered by the script of
that name (a peer's /v1/models lists `models`): /v1/chat/completions and
/v1/completions stream SSE the way llama-server does (a role delta, one
event per token, the finish, its usage chunk, [DONE]). The knobs fail the
answer before its first byte, mid-stream, slow its tokens or stall them; `hold` keeps
an answer waiting, so a test can fill a lane.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import httpx


@dataclass
class Script:
    """How one upstream answers. Every field is a knob a test may turn."""

    # The answer's tokens; None: "Hello from <name>", so a test sees which worker answered.
    tokens: list[str] | None = None
    # Refused at connect: nothing reached the process (httpx.ConnectError).
    fail_before_first_byte: bool = False
    # An HTTP error before any byte of an answer, with llama-server's error body.
    error_status: int | None = None
    error_message: str = "the fake upstream failed"
    # The connection breaks after this many tokens (httpx.ReadError), and
    # then on_break runs (a FakeWorker's crash: the process died mid-answer).
    fail_after_tokens: int | None = None
    on_break: Callable[[], None] | None = None
    # Seconds between tokens.
    token_delay_s: float = 0.0
    # The answer stops after this many tokens and never ends (the connection
    # stays open), after calling on_stall: a test moves its FakeClock there.
    stall_after_tokens: int | None = None
    on_stall: Callable[[], None] | None = None
    # Set: every answer waits for it before its first byte.
    hold: asyncio.Event | None = None
    # What its /v1/models lists (a peer's health check reads it).
    models: list[str] = field(default_factory=lambda: ["upstream-model"])


@dataclass(frozen=True)
class SeenRequest:
    upstream: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class FakeUpstream:
    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.seen: list[SeenRequest] = []

    def script(self, name: str) -> Script:
        """The script of the upstream called `name` (a FakeWorker's name: "gpu", "cpu", ...)."""
        return self.scripts.setdefault(name, Script())

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def answered_by(self, name: str) -> list[SeenRequest]:
        return [seen for seen in self.seen if seen.upstream == name]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host.removesuffix(".worker")
        script = self.script(name)
        path = request.url.path
        if request.method == "GET" and path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.method == "GET" and path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": model, "object": "model", "owned_by": name} for model in script.models]})
        body = json.loads(request.content or b"{}")
        self.seen.append(SeenRequest(name, path, body, dict(request.headers)))
        if script.fail_before_first_byte:
            raise httpx.ConnectError("connection refused (fake upstream)", request=request)
        if script.hold is not None:
            await script.hold.wait()
        if script.error_status is not None:
            return httpx.Response(script.error_status, json={"error": {
                "code": script.error_status, "message": script.error_message, "type": "server_error"}})
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return httpx.Response(404, json={"error": {"code": 404, "message": "File Not Found",
                                                       "type": "not_found_error"}})
        tokens = script.tokens if script.tokens is not None else ["Hello", " from", f" {name}"]
        chat = path == "/v1/chat/completions"
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Stream(sse_events(tokens, chat, body, script, request)))


async def sse_events(tokens: list[str], chat: bool, body: dict[str, Any], script: Script,
                     request: httpx.Request) -> AsyncIterator[bytes]:
    """llama-server's stream for one answer, with the script's faults."""
    created = int(time.time())
    limit = body.get("max_tokens")
    answer = tokens[:limit] if isinstance(limit, int) and limit >= 0 else tokens
    finish = "length" if len(answer) < len(tokens) else "stop"
    tokens = answer

    def event(choice: dict[str, Any]) -> bytes:
        payload = {"id": "chatcmpl-upstream" if chat else "cmpl-upstream",
                   "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": "upstream-model", "choices": [{"index": 0, **choice}]}
        return f"data: {json.dumps(payload)}\n\n".encode()

    if chat:
        yield event({"delta": {"role": "assistant", "content": None}, "finish_reason": None})
    for sent, token in enumerate(tokens):
        if script.fail_after_tokens is not None and sent >= script.fail_after_tokens:
            if script.on_break is not None:
                script.on_break()
            raise httpx.ReadError("connection reset by peer (fake upstream)", request=request)
        if script.stall_after_tokens is not None and sent >= script.stall_after_tokens:
            if script.on_stall is not None:
                script.on_stall()
            await asyncio.Event().wait()
        if script.token_delay_s:
            await asyncio.sleep(script.token_delay_s)
        yield event({"delta": {"content": token}, "finish_reason": None} if chat
                    else {"text": token, "finish_reason": None})
    yield event({"delta": {}, "finish_reason": finish} if chat else {"text": "", "finish_reason": finish})
    usage = {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 5 + len(tokens)}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]
