"""Where a job's events go: collected into one OpenAI response object for
JSON clients, or relayed as SSE, recorded for Idempotency-Key replays."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from starlette.responses import Response

from ..dispatch.upstream import response_id, sse_bytes
from ..dispatch.jobs import Job, JobKind


class AggregatingSink:
    """Collects a worker's stream into one OpenAI response object.
    `on_first_event` runs when an attempt's first event comes (again after
    a reset): the job's estimate is made again then, as a stream's is."""

    def __init__(self, on_first_event: Callable[[], None] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self._on_first_event = on_first_event
        # Where the answer went on from another path's text, when it did (seam).
        self.resumed: dict[str, Any] | None = None

    def emit(self, event: dict[str, Any]) -> None:
        if not self.events and self._on_first_event is not None:
            self._on_first_event()
        self.events.append(event)

    def reset(self) -> None:
        self.events.clear()

    def seam(self, note: dict[str, Any]) -> None:
        # Nothing was sent: the whole answer is joined from both parts, and says so.
        self.resumed = note

    def _by_choice(self) -> tuple[int, dict[int, list[dict[str, Any]]]]:
        """The stream's choice parts grouped by their index (a request with
        n > 1 interleaves its choices), and the last event's created time."""
        parts: dict[int, list[dict[str, Any]]] = {}
        created = int(time.time())
        for event in self.events:
            created = event.get("created", created)
            for choice in event.get("choices") or ():
                index = choice.get("index", 0)
                parts.setdefault(index if isinstance(index, int) else 0, []).append(choice)
        return created, parts

    def chat_response(self, job: Job) -> dict[str, Any]:
        created, parts = self._by_choice()
        return self._response(job, "chat.completion", created,
                              [_chat_choice(index, parts.get(index, [])) for index in range(job.choices)])

    def completion_response(self, job: Job) -> dict[str, Any]:
        created, parts = self._by_choice()
        return self._response(job, "text_completion", created,
                              [_completion_choice(index, parts.get(index, [])) for index in range(job.choices)])

    def _response(self, job: Job, kind: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The envelope both response objects share; usage is the last (the only
        completed) attempt's, every choice's tokens summed."""
        completion_tokens = job.tokens_out
        response = {
            "id": response_id(job),
            "object": kind,
            "created": created,
            "model": self._model(job),
            "system_fingerprint": self._fingerprint(),
            "choices": choices,
            "usage": _usage(job.prompt_tokens, completion_tokens),
        }
        resumed = self._resumed_summary()
        if resumed is not None:
            # A field OpenAI's clients ignore, as in a stream's last chunk.
            response["resumed"] = resumed
        return response

    def _resumed_summary(self) -> dict[str, Any] | None:
        for event in reversed(self.events):
            if "resumed" in event:
                return event["resumed"]
        return self.resumed

    def _model(self, job: Job) -> str:
        return self.events[0].get("model", "") if self.events else ""

    def _fingerprint(self) -> str | None:
        return self.events[0].get("system_fingerprint") if self.events else None


def _chat_choice(index: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat choice, joined from its streamed parts."""
    content: list[str] = []
    reasoning: list[str] = []
    tool_calls: dict[int, dict[str, Any]] = {}
    logprobs: list[Any] | None = None
    finish_reason = None
    for choice in parts:
        if isinstance(choice.get("logprobs"), dict):
            logprobs = (logprobs or []) + list(choice["logprobs"].get("content") or ())
        delta = choice.get("delta") or {}
        if delta.get("content"):
            content.append(delta["content"])
        if delta.get("reasoning_content"):
            reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            slot = tool_calls.setdefault(call.get("index", 0), {
                "id": call.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
            function = call.get("function") or {}
            slot["id"] = slot["id"] or call.get("id")
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""
        if choice.get("finish_reason"):
            finish_reason = choice["finish_reason"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not tool_calls else None}
    if reasoning:
        # Where llama-server (and DeepSeek's API) put a thinking model's reasoning.
        message["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
    return {"index": index, "message": message, "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish_reason}


def _completion_choice(index: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One completion choice, joined from its streamed parts."""
    text: list[str] = []
    # llama-server's shape (lists per token under "content"), each list
    # joined across chunks.
    logprobs: dict[str, list[Any]] | None = None
    finish_reason = None
    for choice in parts:
        text.append(choice.get("text") or "")
        if isinstance(choice.get("logprobs"), dict):
            logprobs = logprobs or {}
            for key, values in choice["logprobs"].items():
                if isinstance(values, list):
                    logprobs.setdefault(key, []).extend(values)
        if choice.get("finish_reason"):
            finish_reason = choice["finish_reason"]
    return {"index": index, "text": "".join(text), "logprobs": logprobs, "finish_reason": finish_reason}


def wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_chunk(job: Job, last_event: dict[str, Any]) -> dict[str, Any]:
    """The last chunk OpenAI sends for stream_options.include_usage: no
    choices, the usage of the whole request (of its one execution, after a
    replay too: the replay started from nothing)."""
    completion_tokens = job.tokens_out
    return {
        "id": last_event.get("id"),
        "object": "chat.completion.chunk" if job.kind is JobKind.CHAT else "text_completion",
        "created": last_event.get("created", int(time.time())),
        "model": last_event.get("model"),
        "system_fingerprint": last_event.get("system_fingerprint"),
        "choices": [],
        "usage": _usage(job.prompt_tokens, completion_tokens),
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class QueueSink:
    """Hands events to the SSE relay; the first emit commits the job."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def emit(self, event: dict[str, Any]) -> None:
        self.job.commit()
        self.queue.put_nowait(("event", event))

    def reset(self) -> None:
        assert not self.job.committed, "a committed stream can't be reset"

    def seam(self, note: dict[str, Any]) -> None:
        self.queue.put_nowait(("seam", note))


# Sends one chunk of a streamed answer to the client (RecordedStream).
Write = Callable[[bytes], Awaitable[None]]

# One SSE event's bytes; a relayed plain delta's were made on the fast path (upstream.PlainDeltas).
sse = sse_bytes


class RecordedStream(Response):
    """A streamed response written straight to ASGI's send, that keeps
    what it sent, for Idempotency-Key replays. `completed` is set by the
    relay once the answer has ended normally; only then is the recording
    worth replaying.

    Not Starlette's StreamingResponse: that puts two async generators, its
    own loop and a task group (a second listener for the disconnect, which
    the route's watcher already hears) between every token and the socket.
    Here the relay awaits `write` for each chunk, in the request's task
    (a task hand-off per token was most of the service's work per streamed token)."""

    def __init__(self, headers: dict[str, str], media_type: str) -> None:
        self.chunks: list[bytes] = []
        self.on_finish = None
        self.completed = False
        self.status_code = 200
        self.media_type = media_type
        self._route_headers = headers
        self._produce: Callable[[Write], Awaitable[None]] | None = None
        # No body: no Content-Length, the answer goes out chunked.
        self.init_headers(headers)

    def relay(self, produce: Callable[[Write], Awaitable[None]]) -> None:
        """`produce(write)` writes the answer's chunks, in order, and returns at its end."""
        self._produce = produce

    async def __call__(self, scope, receive, send) -> None:
        assert self._produce is not None, "relay() names what the stream sends"
        chunks = self.chunks

        async def write(chunk: bytes) -> None:
            if not chunk:
                return
            chunks.append(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self._produce(write)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self.on_finish is not None:
                self.on_finish(("stream", self._route_headers, list(chunks), self.media_type), self.completed)
